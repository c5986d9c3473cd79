"""Soak: mixed traffic against a real server for a given time, watching for what only time shows.

    .venv/bin/python bench/soak.py --duration 1800 --json soak.json     # the 30-minute run (docs/reliability.md)
    .venv/bin/python bench/soak.py --duration 90 --warmup 30            # the CI-sized run (tests/e2e/test_soak.py)

The traffic, from --concurrency workers each picking at random: streamed and merged Generate calls, n > 1 with
seeds, structured output (regex, JSON schema), logprobs (prompt and top-k), a cancel after the first deltas, an
Abort by rid, a deadline that passes mid-generation, invalid requests, Complete with best_of, ChatComplete.

Reports: the server's RSS at the end of warm-up and at the end (and its peak), KV pages still held once the traffic
has stopped (a leak), p50/p99 call latency per minute, and call outcomes by status code per kind. Exit 1 when a page
leaked, RSS grew more than --max-rss-growth after warm-up, the server died, or a call ended INTERNAL, UNKNOWN or
UNAVAILABLE.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serverproc import ServerProcess, resident_bytes, start

from lmrpc.client import AsyncClient, LmrpcError

BAD = frozenset({"INTERNAL", "UNKNOWN", "UNAVAILABLE", "DATA_LOSS"})
PROMPTS = ("The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Explain gravity to a child.",
           "List three colors:", "def fibonacci(n):", "Translate 'good morning' into French:")


class Soak:
    def __init__(self, client: AsyncClient, max_new_tokens: int, seed: int) -> None:
        self.client = client
        self.max_new = max_new_tokens
        self.rng = random.Random(seed)
        self.started = time.monotonic()
        self.latencies: dict[int, list[float]] = collections.defaultdict(list)  # minute -> seconds of OK calls
        self.outcomes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.bad: list[str] = []  # messages of calls that ended with a BAD code
        self._rid = 0

    def _params(self, **extra: Any) -> dict[str, Any]:
        return {"max_new_tokens": self.rng.randint(4, self.max_new), "temperature": self.rng.choice([0.0, 0.7]),
                **extra}

    def _prompt(self) -> str:
        return self.rng.choice(PROMPTS)

    # ---- the kinds of call -----------------------------------------------------------------------------------

    async def stream(self) -> None:
        async for _ in await self.client.generate(self._prompt(), sampling_params=self._params(), stream=True):
            pass

    async def merged(self) -> None:
        await self.client.generate([self._prompt(), self._prompt()], sampling_params=self._params())

    async def samples(self) -> None:
        await self.client.generate(self._prompt(), sampling_params=self._params(n=3, sampling_seed=7, temperature=0.8))

    async def grammar(self) -> None:
        constraint = self.rng.choice([{"regex": "(yes|no|maybe)[.!]"},
                                      {"json_schema": json.dumps({"type": "object", "properties": {
                                          "name": {"type": "string", "maxLength": 8}}, "required": ["name"]})}])
        await self.client.generate(self._prompt(), sampling_params=self._params(**constraint, max_new_tokens=24))

    async def logprobs(self) -> None:
        await self.client.generate(self._prompt(), sampling_params=self._params(), return_logprob=True,
                                   top_logprobs_num=5, logprob_start_len=0, return_text_in_logprobs=True)

    async def cancel(self) -> None:
        stream = await self.client.generate(self._prompt(), sampling_params=self._params(max_new_tokens=64,
                                                                                      ignore_eos=True), stream=True)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break  # leaving the loop cancels the call
        await stream.aclose()
        raise _Outcome("CANCELLED")

    async def abort(self) -> None:
        self._rid += 1
        rid = f"soak-{self._rid}"
        stream = await self.client.generate(self._prompt(), rid=rid, stream=True,
                                            sampling_params=self._params(max_new_tokens=64, ignore_eos=True))
        finish = None
        async for delta in stream:
            if finish is None and delta.finish is None:
                finish = "asked"
                await self.client.abort(rid)
            if delta.finish is not None:
                finish = delta.finish.reason.name
        raise _Outcome(f"OK/{finish}")

    async def deadline(self) -> None:
        await self.client.generate(self._prompt(), sampling_params=self._params(max_new_tokens=96, ignore_eos=True),
                                   timeout=0.4)

    async def invalid(self) -> None:
        await self.client.generate(self._prompt(), sampling_params={"temperature": -1.0, "top_p": 2.0})

    async def complete(self) -> None:
        await self.client.complete([self._prompt()], max_tokens=self.rng.randint(4, self.max_new), n=2, best_of=3,
                                   seed=1, logprobs=2)

    async def chat(self) -> None:
        await self.client.chat([{"role": "user", "content": self._prompt()}], max_tokens=self.max_new,
                               temperature=0)

    KINDS = ("stream", "merged", "samples", "grammar", "logprobs", "cancel", "abort", "deadline", "invalid",
             "complete", "chat")

    async def one(self) -> None:
        kind = self.rng.choice(self.KINDS)
        call: Callable[[], Awaitable[None]] = getattr(self, kind)
        began = time.monotonic()
        try:
            await call()
            code = "OK"
        except _Outcome as o:
            code = o.code
        except LmrpcError as e:
            code = e.code.name
            if code in BAD:
                self.bad.append(f"{kind}: {code}: {e}")
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            if code in BAD:
                self.bad.append(f"{kind}: {code}: {e.details()}")
        now = time.monotonic()
        self.outcomes[kind][code] += 1
        if code.startswith("OK"):
            self.latencies[int((began - self.started) // 60)].append(now - began)

    async def worker(self, until: float) -> None:
        while time.monotonic() < until:
            await self.one()


class _Outcome(Exception):
    """A call that ended as intended, other than plainly OK (a cancel, an abort's finish)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def _percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def run(args: argparse.Namespace, server: ServerProcess | None, target: str) -> dict[str, Any]:
    pid = server.pid if server is not None else None
    samples: list[dict[str, Any]] = []
    async with AsyncClient(target) as client:
        await client.wait_until_ready(600)
        soak = Soak(client, args.max_new_tokens, args.seed)
        stop_at = soak.started + args.duration
        rss_warm: list[int] = []

        async def sample() -> None:
            while time.monotonic() < stop_at:
                load = await client.get_load()
                t = time.monotonic() - soak.started
                rss = resident_bytes(pid) if pid is not None else load.resident_memory_bytes
                samples.append({"t": round(t), "rss_mib": round(rss / 2**20, 1), "used_pages": load.kv_cache_used_pages,
                                "running": load.running_outputs, "waiting": load.waiting_outputs,
                                "tok_s": round(load.generation_tokens_per_second, 1)})
                if not rss_warm and t >= args.warmup:
                    rss_warm.append(rss)
                await asyncio.sleep(args.sample_every)

        await asyncio.gather(sample(), *(soak.worker(stop_at) for _ in range(args.concurrency)))
        # Traffic over: every page must come back.
        settle_until = time.monotonic() + 60
        load = await client.get_load()
        while (load.kv_cache_used_pages or load.running_outputs or load.waiting_outputs) and \
                time.monotonic() < settle_until:
            await asyncio.sleep(0.5)
            load = await client.get_load()
        rss_end = resident_bytes(pid) if pid is not None else load.resident_memory_bytes
    rss_start = rss_warm[0] if rss_warm else (samples[0]["rss_mib"] * 2**20 if samples else 0)
    minutes = []
    for minute in sorted(soak.latencies):
        values = soak.latencies[minute]
        minutes.append({"minute": minute + 1, "calls": len(values), "p50_s": round(statistics.median(values), 3),
                        "p99_s": round(_percentile(values, 99), 3)})
    codes: collections.Counter[str] = collections.Counter()
    for by_code in soak.outcomes.values():
        codes.update(by_code)
    growth = (rss_end - rss_start) / rss_start if rss_start else 0.0
    return {
        "duration_s": args.duration, "warmup_s": args.warmup, "concurrency": args.concurrency,
        "rss_start_mib": round(rss_start / 2**20, 1), "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_peak_mib": max((s["rss_mib"] for s in samples), default=0.0), "rss_growth": round(growth, 4),
        "pages_leaked": load.kv_cache_used_pages, "outputs_left": load.running_outputs + load.waiting_outputs,
        "calls": sum(codes.values()), "codes": dict(codes),
        "by_kind": {k: dict(v) for k, v in sorted(soak.outcomes.items())},
        "latency_by_minute": minutes, "bad_calls": soak.bad[:20], "samples": samples,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=1800, help="seconds of traffic (1800)")
    p.add_argument("--warmup", type=float, default=120, help="seconds before the RSS baseline is taken (120)")
    p.add_argument("--concurrency", type=int, default=6, help="callers at once (6)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="largest output of an ordinary call (24)")
    p.add_argument("--max-rss-growth", type=float, default=0.10, help="fail above this RSS growth after warm-up (0.10)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS/load samples (5)")
    p.add_argument("--seed", type=int, default=0, help="the traffic's random seed (0)")
    p.add_argument("--model", help="model for the server started here (default: the bundled SmolLM2-135M)")
    p.add_argument("--kv-cache-tokens", type=int, default=32768,
                   help="the started server's KV pool (32768: small enough that RSS shows the process, not the pool)")
    p.add_argument("--target", help="soak a running server instead (RSS read from its GetLoad)")
    p.add_argument("--json", metavar="FILE", help="also write the report here")
    args = p.parse_args()

    server = None
    if args.target is None:
        flags = ["--kv-cache-tokens", str(args.kv_cache_tokens), "--stalled-stream-timeout", "10"]
        if args.model:
            flags += ["--model", args.model]
        server = start(*flags)
        print(f"server {server.target} (pid {server.pid}) ready; soaking for {args.duration:g} s", flush=True)
    target = args.target or (server.target if server else "")
    try:
        report = asyncio.run(run(args, server, target))
        if server is not None:
            report["server_alive"] = server.process.poll() is None
    finally:
        if server is not None:
            code = server.stop()
    if server is not None:
        report["server_exit_code"] = code
    problems = []
    if report["pages_leaked"] or report["outputs_left"]:
        problems.append(f"{report['pages_leaked']} KV pages and {report['outputs_left']} outputs left after the "
                        "traffic")
    if report["rss_growth"] > args.max_rss_growth:
        problems.append(f"RSS grew {report['rss_growth']:.1%} after warm-up (limit {args.max_rss_growth:.0%})")
    if report["bad_calls"]:
        problems.append(f"{len(report['bad_calls'])}+ calls ended INTERNAL/UNKNOWN/UNAVAILABLE")
    if server is not None and (not report.get("server_alive") or report.get("server_exit_code") != 0):
        problems.append(f"the server died or did not exit cleanly (exit {report.get('server_exit_code')})")
    report["problems"] = problems
    report["ok"] = not problems
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
