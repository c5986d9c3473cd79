"""The cost of return_hidden_states, in one engine: 8 greedy streams without hidden states against the same with
every position's hidden state (HIDDEN_STATES_MODE_ALL) and with the last one only (LAST), decode tok/s. Issue 13's
target: hidden states cost <= 10% of throughput (ratio >= 0.90).

    .venv/bin/python bench/hidden_states.py [--model PATH] [--streams 8] [--prompt-len 64] [--new-tokens 64]
                                            [--rounds 5] [--json FILE]

The engine runs in-process (AsyncEngine, engine defaults). In each round the three workloads take turns, the order
rotating between rounds; each workload gets new random prompt tokens (no prefix-cache hits). Decode tok/s is the
tokens after each workload's first one over the time from that first token to the last; beside it, the same tokens
per CPU second of the whole process (steadier where other work shares the cores). Each ratio is taken per round
(with hidden states / plain, the same round) and the median over rounds is reported. Beside them, the share of the
engine's step time spent in the hidden-state path (timed inside the same steps, so the machine's noise scales
both). Every run checks that each output got the hidden states its mode promises (ALL: prompt + output - 1 rows;
LAST: exactly one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from lmrpc.server.config import EngineConfig, ModelConfig
from lmrpc.server.engine import hidden_states
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineRequest, HiddenStatesMode, SamplingParams
from lmrpc.server.models.loader import default_gguf

P = ParamSpec("P")
R = TypeVar("R")
WORKLOADS: tuple[tuple[str, HiddenStatesMode | None], ...] = (
    ("plain", None),
    ("hidden all", HiddenStatesMode.ALL),
    ("hidden last", HiddenStatesMode.LAST),
)


class PathTimer:
    """Wall time the engine thread spends in steps, and within them in the hidden-state path (the executor picking
    and normalizing rows, the engine keeping and handing them out): a share measured inside the same steps, so the
    machine's noise scales both. Installed by wrapping those functions on the running engine."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.step_s = 0.0  # in Engine.step
        self.hidden_s = 0.0  # in ModelExecutor._hidden, hidden_states.record and hidden_states.take
        inner = engine.engine
        inner.step = self._timed(inner.step, "step_s")  # type: ignore[method-assign]
        inner.executor._hidden = self._timed(inner.executor._hidden, "hidden_s")  # type: ignore[method-assign]
        hidden_states.record = self._timed(hidden_states.record, "hidden_s")
        hidden_states.take = self._timed(hidden_states.take, "hidden_s")

    def _timed(self, fn: Callable[P, R], into: str) -> Callable[P, R]:
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, into, getattr(self, into) + time.perf_counter() - start)
        return timed

    def reset(self) -> tuple[float, float]:
        """(step seconds, hidden-state seconds) since the last reset."""
        out = (self.step_s, self.hidden_s)
        self.step_s = self.hidden_s = 0.0
        return out


@dataclass(frozen=True)
class Run:
    """One workload's figures in one round."""

    tok_s: float  # decode tokens per second (wall clock)
    tok_cpu_s: float  # decode tokens per CPU second of this process (all threads): steadier on a shared machine
    hidden_share: float  # of the engine's step time, the share spent in the hidden-state path
    hidden_rows: int  # hidden-state rows received over all streams


async def run(engine: AsyncEngine, timer: PathTimer, mode: HiddenStatesMode | None, streams: int, prompt_len: int,
              new_tokens: int, seed: int) -> Run:
    """Decode tok/s of `streams` greedy streams of fresh random prompts, asking for hidden states in `mode`."""
    rng = random.Random(seed)
    requests = []
    for i in range(streams):
        rid = f"s{seed}-{i}"
        requests.append(EngineRequest(
            rid, rid, i, tuple(rng.randrange(100, 40000) for _ in range(prompt_len)),
            SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True), hidden_states=mode))
    timer.reset()
    first: float | None = None
    first_cpu = 0.0
    tokens = 0
    rows: dict[str, int] = {r.request_id: 0 for r in requests}
    async for out in engine.generate(requests):
        rows[out.request_id] += len(out.hidden_states)
        if out.token_ids:
            now = time.perf_counter()
            if first is None:
                first, first_cpu = now, time.process_time()
                tokens += len(out.token_ids) - 1
            else:
                tokens += len(out.token_ids)
    assert first is not None
    elapsed, cpu = time.perf_counter() - first, time.process_time() - first_cpu
    want = {None: 0, HiddenStatesMode.ALL: prompt_len + new_tokens - 1, HiddenStatesMode.LAST: 1}[mode]
    assert all(n == want for n in rows.values()), f"{mode}: hidden rows per stream {sorted(set(rows.values()))}, " \
                                                  f"want {want}"
    step_s, hidden_s = timer.reset()
    return Run(tokens / elapsed, tokens / cpu, hidden_s / step_s, sum(rows.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_gguf()))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", metavar="FILE", help="write every round's figures here")
    args = p.parse_args()
    engine = AsyncEngine.start(EngineConfig(model=ModelConfig(path=args.model)))
    timer = PathTimer(engine)
    runs: dict[str, list[Run]] = {name: [] for name, _ in WORKLOADS}
    try:
        for i, (_, mode) in enumerate(WORKLOADS):  # warm-up: first calls' one-time costs, each path once
            asyncio.run(run(engine, timer, mode, args.streams, 8, 4, seed=-1 - i))
        seed = 0
        for r in range(args.rounds):
            shift = r % len(WORKLOADS)
            for name, mode in WORKLOADS[shift:] + WORKLOADS[:shift]:
                seed += 1  # every workload of every round: new prompts
                runs[name].append(asyncio.run(run(engine, timer, mode, args.streams, args.prompt_len,
                                                  args.new_tokens, seed)))
    finally:
        engine.shutdown()
    print(f"{args.streams} streams, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy, "
          f"{args.rounds} rounds ({args.model}):")
    for title, figure in (("decode tok/s (wall clock)", lambda x: x.tok_s),
                          ("decode tok per CPU second of the process", lambda x: x.tok_cpu_s)):
        plain = [figure(x) for x in runs["plain"]]
        print(f"  {title}")
        print(f"    {'workload':<12} {'median':>8} {'ratio':>6}   per round: figure; ratio to plain")
        for name, _ in WORKLOADS:
            values = [figure(x) for x in runs[name]]
            ratios = [x / b for x, b in zip(values, plain, strict=True)]
            line = f"    {name:<12} {statistics.median(values):8.1f} {statistics.median(ratios):6.3f}   " \
                   f"{', '.join(f'{x:.1f}' for x in values)}"
            if name != "plain":
                line += f"; {', '.join(f'{q:.3f}' for q in ratios)}"
            print(line)
    print("  share of the engine's step time in the hidden-state path (the whole run: prefill and decode steps)")
    for name, _ in WORKLOADS[1:]:
        shares = [x.hidden_share for x in runs[name]]
        print(f"    {name:<12} {statistics.median(shares):8.2%}          {', '.join(f'{q:.2%}' for q in shares)}")
    print("  target: ratio >= 0.90 (median over rounds of with hidden states / plain in the same round)")
    print("  command: " + shlex.join([sys.executable, *sys.argv]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": {k: [vars(x) for x in v] for k, v in runs.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
