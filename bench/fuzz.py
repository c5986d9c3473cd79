"""The long wire fuzz: thousands of hypothesis-made requests of every RPC (tests/wire_fuzz.py) against a real
server, then the same checks as the CI-sized run (tests/e2e/test_fuzz.py): no call ended INTERNAL, UNKNOWN or
UNAVAILABLE, the server is alive and serving, no output runs and no KV page is held.

    .venv/bin/python bench/fuzz.py --cases 5000                    # the default model, a server of its own
    .venv/bin/python bench/fuzz.py --cases 500 --model DIR         # another model (e.g. a tiny one: quicker)
    .venv/bin/python bench/fuzz.py --cases 5000 --target HOST:PORT --api-key KEY   # a running server

Prints the status codes by method and a JSON summary (--json FILE writes it too). Exit 0 when every check held.
A failing case is shrunk by hypothesis and printed; --seed replays a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from serverproc import ServerProcess, resident_bytes, start
from wire_fuzz import Case, WireFuzzer, cases

from lmrpc.client import Client, ServingStatus

API_KEY = "bench-fuzz-key-0123456789"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=5000, help="requests to send (5000)")
    p.add_argument("--model", help="model for the server started here (default: the bundled SmolLM2-135M)")
    p.add_argument("--target", help="fuzz a running server instead (its RSS is not read)")
    p.add_argument("--api-key", help="with --target: the server's API key, if it wants one")
    p.add_argument("--seed", type=int, help="hypothesis seed (default: random)")
    p.add_argument("--json", metavar="FILE", help="also write the summary here")
    args = p.parse_args()

    server: ServerProcess | None = None
    api_key = args.api_key
    if args.target is None:
        keys = Path(tempfile.mkdtemp()) / "keys"
        keys.write_text(API_KEY + "\n")
        api_key = API_KEY
        flags = ["--api-key-file", str(keys), "--enable-custom-logit-processor", "--max-queued-per-client", "64",
                 "--stalled-stream-timeout", "5"]
        if args.model:
            flags += ["--model", args.model]
        server = start(*flags)
        print(f"server {server.target} (pid {server.pid}) ready", flush=True)
    target = args.target or (server.target if server else "")
    fuzzer = WireFuzzer(target, api_key)
    rss_start = resident_bytes(server.pid) if server else 0
    started = time.monotonic()
    failure: str | None = None
    progress = {"n": 0}

    @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases())
    def one(case: Case) -> None:
        fuzzer.send(case)
        progress["n"] += 1
        if progress["n"] % 250 == 0:
            print(f"  {progress['n']} cases, {time.monotonic() - started:.0f} s: {dict(fuzzer.codes)}", flush=True)

    run = hypothesis_seed(args.seed)(one) if args.seed is not None else one
    try:
        run()
    except AssertionError as e:  # a forbidden status: hypothesis has shrunk the case and printed it
        failure = str(e)
    summary: dict[str, Any] = {"cases": sum(fuzzer.codes.values()), "seconds": round(time.monotonic() - started),
                               "codes": dict(fuzzer.codes),
                               "by_method": {m: dict(c) for m, c in sorted(fuzzer.by_method.items())},
                               "failure": failure}
    try:
        load = fuzzer.settled()
        summary["pages_held_after"] = load.kv_cache_used_pages
        with Client(target, api_key=api_key) as client:
            summary["serving_after"] = client.health() is ServingStatus.SERVING
    except Exception as e:  # noqa: BLE001 (reported in the summary: the run's verdict)
        summary["settle_error"] = repr(e)
    if server is not None:
        summary["server_alive"] = server.process.poll() is None
        summary["rss_start_mib"] = round(rss_start / 2**20)
        summary["rss_end_mib"] = round(resident_bytes(server.pid) / 2**20)
        summary["server_exit_code"] = server.stop()
    fuzzer.close()
    ok = (failure is None and summary.get("pages_held_after") == 0 and summary.get("serving_after") is True
          and summary.get("server_alive", True) and summary.get("server_exit_code", 0) == 0)
    summary["ok"] = ok
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
