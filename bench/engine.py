"""Engine throughput next to HF transformers' `generate`, same weights, same dtype, one run.

    .venv/bin/python bench/engine.py [--model DIR] [--dtype bfloat16] [--batches 1 8 32] [--prompt-len 128]
                                     [--new-tokens 128] [--repeats 3] [--skip-hf] [--no-auto]

For each concurrency B it prints decode tok/s (all sequences' generated tokens after the first, over the time
after the first token) and prefill tok/s, for lmrpc's engine and for HF (greedy, EOS ignored, equal-length random
prompts so HF needs no padding). Each figure is the median of --repeats runs. Issue 3's target: lmrpc >= 1.5x HF
decode throughput at B=1 and B=32.

Each system is measured in a fresh process of its own (this script re-runs itself with --worker): torch's CPU
kernels run on an OpenMP pool per calling thread, and a pool left behind by the other system would slow the
second one measured. Both run the same weights in --dtype (bf16 by default). lmrpc is also measured at its
default `--dtype auto` (bfloat16 where the CPU has bf16 instructions, else float32), in extra columns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Figures:
    prefill_tok_s: float  # prompt tokens / time to the first token of the last sequence
    decode_tok_s: float  # generated tokens after the first / time after the first token


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(batch)]


def median(runs: list[Figures]) -> Figures:
    return Figures(statistics.median(r.prefill_tok_s for r in runs), statistics.median(r.decode_tok_s for r in runs))


# ---- workers (one system per process) ------------------------------------------------------------------------


def lmrpc_worker(args: argparse.Namespace, dtype: str) -> dict[int, Figures]:
    from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from lmrpc.server.engine.engine import AsyncEngine
    from lmrpc.server.protocol import EngineRequest, SamplingParams

    engine = AsyncEngine.start(EngineConfig(
        model=ModelConfig(path=args.model, dtype=dtype, device="cpu"),
        # no prefix cache: every run computes its prompts afresh, as HF does
        cache=CacheConfig(num_tokens=max(args.batches) * (args.prompt_len + args.new_tokens) * 2,
                          enable_prefix_cache=False),
        scheduler=SchedulerConfig(max_running_requests=max(args.batches), max_batched_tokens=2048,
                                  max_prefill_chunk=2048),
        sampling_defaults="openai",
    ))
    engine.warmup()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    async def run(batch: list[list[int]]) -> Figures:
        reqs = [EngineRequest(f"b{i}-{time.monotonic_ns()}", f"b{i}", i, tuple(p), params)
                for i, p in enumerate(batch)]
        first: dict[str, float] = {}
        start = time.perf_counter()
        async for out in engine.generate(reqs):
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
        end = time.perf_counter()
        t_first = max(first.values()) - start
        prompt_tokens = sum(len(p) for p in batch)
        return Figures(prompt_tokens / t_first, len(batch) * (args.new_tokens - 1) / (end - start - t_first))

    figures = {b: median([asyncio.run(run(prompts(b, args.prompt_len, seed=r))) for r in range(args.repeats)])
               for b in args.batches}
    engine.shutdown()
    return figures


def hf_worker(args: argparse.Namespace, dtype: str) -> dict[int, Figures]:
    from transformers import AutoModelForCausalLM

    from lmrpc.server.config import ModelConfig
    from lmrpc.server.models.loader import resolve_model_path

    path = resolve_model_path(ModelConfig(path=args.model))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    def gen(batch: list[list[int]], n: int) -> float:
        ids = torch.tensor(batch)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    def run(batch: list[list[int]]) -> Figures:
        t_first = gen(batch, 1)
        t_all = gen(batch, args.new_tokens)
        return Figures(len(batch) * len(batch[0]) / t_first,
                       len(batch) * (args.new_tokens - 1) / max(t_all - t_first, 1e-9))

    gen(prompts(1, 8), 4)  # warm-up
    return {b: median([run(prompts(b, args.prompt_len, seed=r)) for r in range(args.repeats)])
            for b in args.batches}


WORKERS = {"lmrpc": lmrpc_worker, "hf": hf_worker}


def measure(system: str, dtype: str, argv: list[str]) -> dict[int, Figures]:
    """Run one system in a fresh process and read its figures (JSON on the last line of its output)."""
    proc = subprocess.run([sys.executable, __file__, *argv, "--worker", system, "--worker-dtype", dtype],
                          stdout=subprocess.PIPE, text=True, check=True)
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    return {int(b): Figures(**f) for b, f in raw.items()}


# ---- the table -----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory or GGUF (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is printed")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--no-auto", action="store_true", help="skip the extra lmrpc run at --dtype auto")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        figures = WORKERS[args.worker](args, args.worker_dtype)
        print(json.dumps({b: asdict(f) for b, f in figures.items()}))
        return

    argv = sys.argv[1:]
    ours = measure("lmrpc", args.dtype, argv)
    auto = {} if args.no_auto else measure("lmrpc", "auto", argv)
    hf = {} if args.skip_hf else measure("hf", args.dtype, argv)

    print(f"\nmodel={args.model or 'SmolLM2-135M-Instruct (embedded)'} dtype={args.dtype} prompt={args.prompt_len} "
          f"new={args.new_tokens} threads={torch.get_num_threads()} median of {args.repeats}")
    header = (f"{'lmrpc decode':>12} {'HF decode':>10} {'ratio':>6} | {'lmrpc prefill':>13} {'HF prefill':>10} | "
              f"{'auto decode':>11} {'ratio':>6} {'auto prefill':>12}")
    print(f"{'batch':>5} | {header}")
    for b in args.batches:
        o, h, a = ours[b], hf.get(b), auto.get(b)
        ratio = f"{o.decode_tok_s / h.decode_tok_s:5.2f}x" if h else "   n/a"
        hd = f"{h.decode_tok_s:10.1f}" if h else f"{'-':>10}"
        hp = f"{h.prefill_tok_s:10.1f}" if h else f"{'-':>10}"
        ad = f"{a.decode_tok_s:11.1f}" if a else f"{'-':>11}"
        ar = f"{a.decode_tok_s / h.decode_tok_s:5.2f}x" if a and h else "   n/a"
        ap = f"{a.prefill_tok_s:12.1f}" if a else f"{'-':>12}"
        print(f"{b:>5} | {o.decode_tok_s:12.1f} {hd} {ratio} | {o.prefill_tok_s:13.1f} {hp} | {ad} {ar} {ap}")


if __name__ == "__main__":
    main()
