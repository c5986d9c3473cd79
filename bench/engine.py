"""Engine throughput next to HF transformers' `generate`, same weights, same dtype, one run.

    .venv/bin/python bench/engine.py [--model DIR] [--dtype bfloat16] [--quantization none] [--batches 1 8 32]
                                     [--prompt-len 128] [--new-tokens 128] [--repeats 5] [--skip-hf] [--no-auto]

For each concurrency B it prints decode tok/s (all sequences' generated tokens after the first, over the time
after the first token) and prefill tok/s, for lmrpc's engine and for HF (greedy, EOS ignored, equal-length random
prompts so HF needs no padding). Issue 3's target: lmrpc >= 1.5x HF decode throughput at B=1 and B=32.

Each system runs in a process of its own, started once (this script re-runs itself with --worker): torch's CPU
kernels run on an OpenMP pool per calling thread, and a pool left behind by one system would slow the other. The
systems then take turns: each of --repeats rounds runs every batch size on every system back to back (the order of
the systems alternating between rounds), so a shared machine's slow and fast minutes fall on both alike. Figures
are medians over rounds; "ratio" is the median over rounds of lmrpc / HF within the round. Both run the same
weights in --dtype (bf16 by default): lmrpc with --quantization none unless told otherwise (its default for the
bundled GGUF is its own int4 blocks, which HF would dequantize); where lmrpc's default `--dtype auto` means another
dtype on this CPU (float32 without bf16 instructions), lmrpc is also measured at it, in extra columns. The served
comparison with llama.cpp is bench/served.py.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from lmrpc.server.models.linear import resolve_dtype


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

Run = Callable[[list[list[int]]], Figures]


def lmrpc_worker(args: argparse.Namespace, dtype: str) -> Run:
    from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from lmrpc.server.engine.async_engine import AsyncEngine
    from lmrpc.server.engine.types import EngineRequest, SamplingParams

    engine = AsyncEngine.start(EngineConfig(
        model=ModelConfig(path=args.model, dtype=dtype, device="cpu", quantization=args.quantization),
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

    return lambda batch: asyncio.run(run(batch))  # the engine thread lives on; the process exit ends it


def hf_worker(args: argparse.Namespace, dtype: str) -> Run:
    from transformers import AutoModelForCausalLM

    from lmrpc.server.config import ModelConfig
    from lmrpc.server.models.loader import resolve_model_path

    path, gguf = resolve_model_path(ModelConfig(path=args.model))
    if gguf is not None:  # transformers dequantizes the GGUF file itself
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.eval()

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
    return run


WORKERS: dict[str, Callable[[argparse.Namespace, str], Run]] = {"lmrpc": lmrpc_worker, "hf": hf_worker}


def serve(args: argparse.Namespace) -> None:
    """Worker side: load, say "ready", then answer each "<batch> <seed>" line with that run's figures as JSON."""
    run = WORKERS[args.worker](args, args.worker_dtype)
    print("ready", flush=True)
    for line in sys.stdin:
        batch, seed = map(int, line.split())
        print(json.dumps(asdict(run(prompts(batch, args.prompt_len, seed)))), flush=True)


class Worker:
    """Parent side: one system in a process of its own, started once, measured on request."""

    def __init__(self, system: str, dtype: str, argv: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, *argv, "--worker", system, "--worker-dtype", dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker exited with {self.proc.wait()}")
        return line.strip()

    def _expect(self, word: str) -> None:
        while (line := self._line()) != word:  # libraries may print before the worker does
            print(line, file=sys.stderr)

    def run(self, batch: int, seed: int) -> Figures:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{batch} {seed}\n")
        self.proc.stdin.flush()
        return Figures(**json.loads(self._line()))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


# ---- the table -----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory or GGUF (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none", choices=("auto", "none", "int8", "int4"),
                        help="lmrpc's weights (none: the same dense weights HF runs)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians are printed")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--no-auto", action="store_true", help="skip the extra lmrpc run at --dtype auto")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve(args)
        return

    argv = sys.argv[1:]
    systems = {"lmrpc": ("lmrpc", args.dtype)}
    if not args.skip_hf:
        systems["hf"] = ("hf", args.dtype)
    auto_dtype = resolve_dtype("auto", torch.device("cpu"))
    if not args.no_auto and auto_dtype != getattr(torch, args.dtype):  # else the same system twice
        systems["auto"] = ("lmrpc", "auto")
    workers = {name: Worker(system, dtype, argv) for name, (system, dtype) in systems.items()}
    runs: dict[str, dict[int, list[Figures]]] = {name: {b: [] for b in args.batches} for name in workers}
    for r in range(args.repeats):
        order = list(workers) if r % 2 == 0 else list(reversed(workers))
        for b in args.batches:
            for name in order:
                runs[name][b].append(workers[name].run(b, seed=r))
    for worker in workers.values():
        worker.close()

    def ratio(name: str, b: int) -> str:
        if name not in runs or "hf" not in runs:
            return "   n/a"
        pairs = zip(runs[name][b], runs["hf"][b], strict=True)
        return f"{statistics.median(o.decode_tok_s / h.decode_tok_s for o, h in pairs):5.2f}x"

    med = {name: {b: median(figures) for b, figures in per_batch.items()} for name, per_batch in runs.items()}
    ours, hf, auto = med["lmrpc"], med.get("hf", {}), med.get("auto", {})
    print(f"\nmodel={args.model or 'SmolLM2-135M-Instruct (embedded)'} dtype={args.dtype} prompt={args.prompt_len} "
          f"new={args.new_tokens} threads={torch.get_num_threads()} medians of {args.repeats} interleaved rounds")
    header = (f"{'lmrpc decode':>12} {'HF decode':>10} {'ratio':>6} | {'lmrpc prefill':>13} {'HF prefill':>10} | "
              f"{'auto decode':>11} {'ratio':>6} {'auto prefill':>12}")
    print(f"{'batch':>5} | {header}")
    for b in args.batches:
        o, h, a = ours[b], hf.get(b), auto.get(b)
        hd = f"{h.decode_tok_s:10.1f}" if h else f"{'-':>10}"
        hp = f"{h.prefill_tok_s:10.1f}" if h else f"{'-':>10}"
        ad = f"{a.decode_tok_s:11.1f}" if a else f"{'-':>11}"
        ap = f"{a.prefill_tok_s:12.1f}" if a else f"{'-':>12}"
        print(f"{b:>5} | {o.decode_tok_s:12.1f} {hd} {ratio('lmrpc', b)} | {o.prefill_tok_s:13.1f} {hp} | "
              f"{ad} {ratio('auto', b)} {ap}")
    print("ratio: median over rounds of lmrpc / HF decode tok/s measured in the same round")
    if "auto" not in runs and not args.no_auto:
        auto_name = str(auto_dtype).removeprefix("torch.")
        print(f"--dtype auto is {auto_name} on this CPU: the lmrpc columns are its figures")


if __name__ == "__main__":
    main()
