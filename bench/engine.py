"""Engine throughput next to HF transformers' `generate`, same weights, same dtype, one run.

    .venv/bin/python bench/engine.py [--model DIR] [--dtype bfloat16] [--batches 1 8 32] [--prompt-len 128]
                                     [--new-tokens 128] [--skip-hf] [--no-auto]

For each concurrency B it prints decode tok/s (all sequences' generated tokens after the first, over the time
after the first token) and prefill tok/s, for lmrpc's engine and for HF (greedy, EOS ignored, equal-length random
prompts so HF needs no padding). Issue 3's target: lmrpc >= 1.5x HF decode throughput at B=1 and B=32.

Both run the same weights in --dtype (bf16 by default). lmrpc is also measured at its default `--dtype auto`
(float32 on CPUs without bf16 instructions; see server/lmrpc/server/models/linear.py), in extra columns.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, replace

import torch

from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.engine import AsyncEngine
from lmrpc.server.models.loader import resolve_model_path
from lmrpc.server.protocol import EngineRequest, SamplingParams


@dataclass(frozen=True)
class Figures:
    prefill_tok_s: float  # prompt tokens / time to the first token of the last sequence
    decode_tok_s: float  # generated tokens after the first / time after the first token


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(batch)]


async def run_lmrpc(engine: AsyncEngine, batch: list[list[int]], new_tokens: int) -> Figures:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [EngineRequest(f"b{i}-{time.monotonic_ns()}", f"b{i}", i, tuple(p), params) for i, p in enumerate(batch)]
    first: dict[str, float] = {}
    start = time.perf_counter()
    async for out in engine.generate(reqs):
        if out.token_ids and out.request_id not in first:
            first[out.request_id] = time.perf_counter()
    end = time.perf_counter()
    t_first = max(first.values()) - start
    prompt_tokens = sum(len(p) for p in batch)
    return Figures(prompt_tokens / t_first, len(batch) * (new_tokens - 1) / (end - start - t_first))


def run_hf(model: torch.nn.Module, batch: list[list[int]], new_tokens: int) -> Figures:
    ids = torch.tensor(batch)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    t_first = gen(1)
    t_all = gen(new_tokens)
    return Figures(ids.numel() / t_first, len(batch) * (new_tokens - 1) / max(t_all - t_first, 1e-9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory or GGUF (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--no-auto", action="store_true", help="skip the extra lmrpc run at --dtype auto")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    model_config = ModelConfig(path=args.model, dtype=args.dtype, device="cpu")
    ours = run_engine(model_config, args)
    auto = {} if args.no_auto else run_engine(replace(model_config, dtype="auto"), args)

    hf: dict[int, Figures] = {}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(model_config)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        run_hf(hf_model, prompts(1, 8), 4)  # warm-up
        for b in args.batches:
            hf[b] = run_hf(hf_model, prompts(b, args.prompt_len), args.new_tokens)

    print(f"\nmodel={model_config.path or 'SmolLM2-135M-Instruct (embedded)'} dtype={args.dtype} "
          f"prompt={args.prompt_len} new={args.new_tokens} threads={torch.get_num_threads()}")
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


def run_engine(model_config: ModelConfig, args: argparse.Namespace) -> dict[int, Figures]:
    engine = AsyncEngine.start(EngineConfig(
        model=model_config,
        cache=CacheConfig(num_tokens=max(args.batches) * (args.prompt_len + args.new_tokens) * 2),
        scheduler=SchedulerConfig(max_running_requests=max(args.batches), max_batched_tokens=2048,
                                  max_prefill_chunk=2048),
        sampling_defaults="openai",
    ))
    engine.warmup()
    figures: dict[int, Figures] = {}
    for b in args.batches:
        figures[b] = asyncio.run(run_lmrpc(engine, prompts(b, args.prompt_len), args.new_tokens))
    engine.shutdown()
    return figures


if __name__ == "__main__":
    main()
