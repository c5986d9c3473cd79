"""The long wire fuzz: thousands of hypothesis-made requests of every RPC (tests/wire_fuzz.py) against a real
server, then the same checks as the CI-sized run (tests/e2e/test_fuzz.py): no call ended INTERNAL, UNKNOWN or
UNAVAILABLE, the server is alive and serving, no output runs and no KV page is held.

    .venv/bin/python bench/fuzz.py --cases 5000                    # the default model, a server of its own
    .venv/bin/python bench/fuzz.py --cases 500 --model DIR         # another model (e.g. a tiny one: quicker)
    .venv/bin/python bench/fuzz.py --cases 5000 --target HOST:PORT --api-key KEY   # a running server
    .venv/bin/python bench/fuzz.py --mode limits --cases 5000      # valid requests pushed past the limits

--mode limits (tests/limit_fuzz.py) sends valid requests mutated toward and past the server's bounds (counts,
nesting, sizes, long strings, control characters), to a server started with --enable-lora-admin and an empty
--lora-root; it lists every forbidden status with its request instead of stopping at the first (--shrink: stop and
shrink it), reports the codes by mutation kind and the slowest calls, and also fails when the server's RSS grew by
10% or more from after its warm-up (one call of each template) to the end.

Prints the status codes by method and a JSON summary (--json FILE writes it too). Exit 0 when every check held.
A failing case is shrunk by hypothesis and printed; --seed replays a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.strategies import SearchStrategy
from limit_fuzz import LimitCase, LimitRun, limit_cases, read_limits, warm_up_cases
from serverproc import ServerProcess, resident_bytes, start
from wire_fuzz import Case, WireFuzzer, cases

from lmrpc.client import Client, ServingStatus

API_KEY = "bench-fuzz-key-0123456789"
RSS_GROWTH_LIMIT = 0.10  # limits mode: RSS growth from after the warm-up to the end that fails the run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=5000, help="requests to send (5000)")
    p.add_argument("--model", help="model for the server started here (default: the bundled SmolLM2-135M)")
    p.add_argument("--target", help="fuzz a running server instead (its RSS is not read)")
    p.add_argument("--api-key", help="with --target: the server's API key, if it wants one")
    p.add_argument("--seed", type=int, help="hypothesis seed (default: random)")
    p.add_argument("--json", metavar="FILE", help="also write the summary here")
    p.add_argument("--mode", choices=("wire", "limits"), default="wire",
                   help="wire: random requests of every RPC; limits: valid ones pushed past the limits (wire)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="limits mode: each call's deadline, seconds (10; a call of 320 outputs let in may pass it "
                        "on a slow machine: DEADLINE_EXCEEDED is allowed, and its outputs must be freed)")
    p.add_argument("--shrink", action="store_true",
                   help="limits mode: stop at the first forbidden status and let hypothesis shrink it")
    args = p.parse_args()

    server: ServerProcess | None = None
    api_key = args.api_key
    if args.target is None:
        keys = Path(tempfile.mkdtemp()) / "keys"
        keys.write_text(API_KEY + "\n")
        api_key = API_KEY
        flags = ["--api-key-file", str(keys), "--enable-custom-logit-processor", "--stalled-stream-timeout", "5"]
        if args.mode == "wire":
            flags += ["--max-queued-per-client", "64"]
        else:
            # No per-client cap, so that a call of exactly the capacity's outputs is admitted and the limit is the
            # one refusing capacity + 1; the LoRA RPCs served, with a root, so that they reach their checks; a KV
            # pool of its own size, so that RSS shows the process rather than the pool.
            flags += ["--enable-lora-admin", "--lora-root", tempfile.mkdtemp(prefix="fuzz-lora-"),
                      "--kv-cache-tokens", "32768"]
        if args.model:
            flags += ["--model", args.model]
        server = start(*flags)
        print(f"server {server.target} (pid {server.pid}) ready", flush=True)
    target = args.target or (server.target if server else "")
    limits_mode = args.mode == "limits"
    fuzzer = WireFuzzer(target, api_key, raise_forbidden=not limits_mode or args.shrink)
    limit_run = LimitRun(fuzzer) if limits_mode else None
    summary: dict[str, Any] = {"mode": args.mode}
    strategy: SearchStrategy[Any] = cases()
    send: Callable[[Any], object] = fuzzer.send
    if limit_run is not None:
        limits, guessed = read_limits(fuzzer.channel, api_key)
        summary |= {"limits": vars(limits), "limits_guessed": guessed,
                    "rss_ready_mib": round(resident_bytes(server.pid) / 2**20) if server else None}
        # One valid call of each template before RSS is read: what first calls load (tokenizer and grammar
        # caches, buffers) is not growth.
        for case in warm_up_cases():
            limit_run.send(case)
        strategy, send = limit_cases(limits, args.timeout), limit_run.send
    started = time.monotonic()
    failure: str | None = None
    progress = {"n": 0}
    rss_trace: list[int] = []  # MiB every 100 cases
    # RSS growth is measured from after the first tenth of the cases, the server settled both times: by then what is
    # kept on purpose (compiled grammars and matchers up to their bounds, buffers sized by the largest calls) has
    # mostly filled; a leak goes on growing.
    rss_start = {"bytes": resident_bytes(server.pid) if server else 0, "after_cases": 0}
    warm_cases = max(1, args.cases // 10) if limits_mode else 0

    @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(case: Case | LimitCase) -> None:
        send(case)
        progress["n"] += 1
        if progress["n"] == warm_cases and server is not None:
            rss_start.update(bytes=settled_rss(fuzzer, server.pid), after_cases=warm_cases)
        if progress["n"] % 100 == 0:
            rss_trace.append(round(resident_bytes(server.pid) / 2**20) if server else 0)
        if progress["n"] % 250 == 0:
            print(f"  {progress['n']} cases, {time.monotonic() - started:.0f} s, RSS {rss_trace[-1]} MiB: "
                  f"{dict(fuzzer.codes)}", flush=True)

    run = hypothesis_seed(args.seed)(one) if args.seed is not None else one
    try:
        run()
    except AssertionError as e:  # a forbidden status: hypothesis has shrunk the case and printed it
        failure = str(e)
    summary |= {"cases": sum(fuzzer.codes.values()), "seconds": round(time.monotonic() - started),
                "codes": dict(fuzzer.codes), "by_method": {m: dict(c) for m, c in sorted(fuzzer.by_method.items())},
                "failure": failure}
    if limit_run is not None:
        summary |= limit_run.summary()
    try:
        load = fuzzer.settled()
        summary["pages_held_after"] = load.kv_cache_used_pages
        with Client(target, api_key=api_key) as client:
            summary["serving_after"] = client.health() is ServingStatus.SERVING
    except Exception as e:  # noqa: BLE001 (reported in the summary: the run's verdict)
        summary["settle_error"] = repr(e)
    if server is not None:
        summary["server_alive"] = server.process.poll() is None
        summary["rss_start_mib"] = round(rss_start["bytes"] / 2**20)
        summary["rss_start_after_cases"] = rss_start["after_cases"]
        summary["rss_end_mib"] = round(settled_rss(fuzzer, server.pid) / 2**20)
        summary["rss_trace_mib"] = rss_trace
        summary["server_exit_code"] = server.stop()
    fuzzer.close()
    ok = (failure is None and summary.get("pages_held_after") == 0 and summary.get("serving_after") is True
          and summary.get("server_alive", True) and summary.get("server_exit_code", 0) == 0)
    if limits_mode:
        growth = (summary["rss_end_mib"] - summary["rss_start_mib"]) / summary["rss_start_mib"] if server else 0.0
        summary["rss_growth_pct"] = round(100 * growth, 2)
        ok = ok and not summary["forbidden"] and growth < RSS_GROWTH_LIMIT
    summary["ok"] = ok
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if ok else 1


def settled_rss(fuzzer: WireFuzzer, pid: int) -> int:
    """The server's RSS once nothing runs and its engine has idled a few ticks (it trims the heap then): the start
    and the end of a run are read alike, so growth compares what the process holds, not where a burst left it."""
    fuzzer.settled()
    time.sleep(1.0)
    return resident_bytes(pid)


if __name__ == "__main__":
    raise SystemExit(main())
