"""Where an engine run's time goes: prefill steps against decode steps, and inside a step the forward, the sampler
and the rest. Engine alone (no gRPC), the bundled model at its defaults unless told otherwise.

    .venv/bin/python bench/phases.py [--streams 32] [--prompt-len 128] [--new-tokens 128] [--quantization auto]
                                     [--repeats 3] [--model FILE] [--no-expand-codes]
                                     [--max-batched-tokens N]

Each repeat sends --streams requests of random token ids at once (greedy, EOS ignored, prefix cache off so every
repeat prefills), after one untimed warm-up run. Per repeat it prints wall time and tok/s, then per kind of step
(prefill: any chunk of more than one token; decode: one token per sequence) the count, total and mean time of the
whole step and of the model's forward, and the step phases outside the forward summed over all steps, and the rows
(tokens) each kind of step ran. On a GPU the forward's timer waits for the device (torch.cuda.synchronize), so its
work is counted there, not in the first phase that reads a result back (the sampler). One run on a shared machine
proves little: compare repeats, and A/B a change in alternating runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.sequence import ScheduledBatch
from lmrpc.server.engine.types import EngineRequest, SamplingParams

PHASES = ("_sample", "_update", "_emit")  # Engine methods timed besides the forward


class StepClock:
    """Wraps the engine's step, its executor's forward and the PHASES, and sums their times by kind of step."""

    def __init__(self, engine: Any) -> None:
        self.totals: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.counts: collections.Counter[str] = collections.Counter()
        self.rows: collections.Counter[str] = collections.Counter()  # rows (tokens) the forwards of each kind ran
        self.kind: str | None = None
        forward = engine.executor.forward
        on_gpu = engine.executor.device.type == "cuda"

        def forward_done(batch: ScheduledBatch) -> Any:
            out = forward(batch)
            if on_gpu:
                torch.cuda.synchronize()  # kernels run asynchronously: count them here, not in the sampler
            return out

        def timed_forward(batch: ScheduledBatch) -> Any:
            self.kind = "decode" if all(c.num_tokens == 1 for c in batch.chunks) else "prefill"
            self.rows[self.kind] += sum(c.num_tokens for c in batch.chunks)
            return self._time(f"forward {self.kind}", forward_done, batch)

        engine.executor.forward = timed_forward
        step = engine.step

        def timed_step() -> None:
            self.kind = None
            started = time.perf_counter()
            step()
            if self.kind is not None:  # a step that ran the model
                self._add(f"step {self.kind}", time.perf_counter() - started)

        engine.step = timed_step
        for name in PHASES:
            method = getattr(engine, name)
            setattr(engine, name, lambda *a, _m=method, _n=name, **k: self._time(f"phase {_n}", _m, *a, **k))

    def _time(self, key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._add(key, time.perf_counter() - started)

    def _add(self, key: str, seconds: float) -> None:
        self.totals[key] += seconds
        self.counts[key] += 1

    def reset(self) -> None:
        self.totals.clear()
        self.counts.clear()
        self.rows.clear()


async def run(engine: AsyncEngine, streams: int, prompt_len: int, new_tokens: int, rng: random.Random) -> None:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = [
        EngineRequest(f"phases-{rng.getrandbits(64):x}", "bench", i,
                      tuple(rng.randrange(100, 40000) for _ in range(prompt_len)), params)
        for i in range(streams)
    ]
    async for _ in engine.generate(requests):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--int8-activations", action="store_true",
                        help="int4 products take int8 activations (as the server's flag)")
    parser.add_argument("--no-int16-activations", dest="int16_activations", action="store_false",
                        help="int4 products with float32 compute keep exact float32 inputs (as the server's flag)")
    parser.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the bundled model)")
    parser.add_argument("--max-batched-tokens", type=int, default=None,
                        help="tokens per step (as the server's flag; default: sized to the model)")
    parser.add_argument("--no-expand-codes", dest="expand_codes", action="store_false",
                        help="8-bit weights keep no bfloat16 copy of their codes (as the server's flag)")
    args = parser.parse_args()

    tokens = args.streams * (args.prompt_len + args.new_tokens + 64)
    config = EngineConfig(
        model=ModelConfig(path=args.model, quantization=args.quantization, int8_activations=args.int8_activations,
                          int16_activations=args.int16_activations, expand_codes=args.expand_codes),
        cache=CacheConfig(num_tokens=tokens, enable_prefix_cache=False),
        scheduler=SchedulerConfig(max_batched_tokens=args.max_batched_tokens),
        sampling_defaults="openai",  # no model-side defaults (a repetition penalty, say) on top of plain greedy
    )
    engine = AsyncEngine.start(config)
    try:
        engine.warmup()
        clock = StepClock(engine.engine)
        rng = random.Random(0)
        asyncio.run(run(engine, args.streams, args.prompt_len, 2, rng))  # untimed: first-call costs
        for repeat in range(args.repeats):
            clock.reset()
            started = time.perf_counter()
            asyncio.run(run(engine, args.streams, args.prompt_len, args.new_tokens, rng))
            wall = time.perf_counter() - started
            print(f"repeat {repeat + 1}: {args.streams} streams x {args.new_tokens} tokens in {wall:.2f} s, "
                  f"{args.streams * args.new_tokens / wall:.1f} tok/s ({args.quantization}"
                  f"{', int8 activations' if args.int8_activations else ''}"
                  f"{'' if args.int16_activations else ', no int16 activations'})")
            for key in sorted(clock.totals):
                total, count = clock.totals[key], clock.counts[key]
                print(f"  {key:18s} {total:7.3f} s  {count:4d} x {1000 * total / count:7.2f} ms")
            for kind, rows in sorted(clock.rows.items()):
                seconds = clock.totals[f"forward {kind}"]
                print(f"  rows {kind:13s} {rows:7d}    {rows / clock.counts[f'forward {kind}']:7.1f} a step, "
                      f"{1000 * seconds / rows:.2f} ms a row")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
