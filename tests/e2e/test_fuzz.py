"""A CI-sized wire fuzz (tests/wire_fuzz.py): a few hundred hypothesis-made requests of every RPC against a real
server (the tiny random-weight Llama, so that valid generations are quick; API keys on): no call ends INTERNAL,
UNKNOWN or UNAVAILABLE, the server is still serving afterwards, and every KV page is free again.
`LMRPC_FUZZ_CASES` sets the number of cases (default 300); bench/fuzz.py runs the long one.

The limits run (tests/limit_fuzz.py) does the same with valid requests pushed toward and past the server's bounds,
against a server of its own with the LoRA RPCs served (--enable-lora-admin, an empty --lora-root), and lists every
forbidden status with its request. `LMRPC_LIMITS_FUZZ_CASES` sets its cases (default 200);
bench/fuzz.py --mode limits runs thousands."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from limit_fuzz import LimitCase, LimitRun, limit_cases, read_limits
from wire_fuzz import Case, WireFuzzer, cases

from lmrpc.client import Client, ServingStatus

if TYPE_CHECKING:
    from tests.e2e.conftest import RunningServer

pytestmark = pytest.mark.e2e

API_KEY = "fuzz-key-0123456789abcdef"
CASES = int(os.environ.get("LMRPC_FUZZ_CASES", "300"))
LIMIT_CASES = int(os.environ.get("LMRPC_LIMITS_FUZZ_CASES", "200"))


@pytest.fixture(scope="module")
def fuzz_server(launch_server: Any, tiny_llama_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    keys = tmp_path_factory.mktemp("fuzz") / "keys"
    keys.write_text(API_KEY + "\n")
    running = launch_server("--model", str(tiny_llama_dir), "--dtype", "float32", "--api-key-file", str(keys),
                            "--enable-custom-logit-processor", "--kv-cache-tokens", "65536",
                            "--max-queued-per-client", "64", "--stalled-stream-timeout", "5")
    yield running
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=60) == 0


def test_fuzzed_requests_never_crash_nor_leak(fuzz_server: RunningServer) -> None:
    fuzzer = WireFuzzer(fuzz_server.target, API_KEY)

    # derandomize: CI sends the same cases every run (a failure reproduces); bench/fuzz.py draws new ones.
    @settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def one(case: Case) -> None:
        fuzzer.send(case)

    try:
        one()
        assert fuzz_server.process.poll() is None, "the server died"
        load = fuzzer.settled()
        assert load.kv_cache_used_pages == 0
        with Client(fuzz_server.target, api_key=API_KEY) as client:
            assert client.health() is ServingStatus.SERVING
            assert client.generate("Hello", sampling_params={"max_new_tokens": 3})[0].usage is not None
    finally:
        fuzzer.close()
    print(f"\nfuzz: {sum(fuzzer.codes.values())} calls, codes {dict(fuzzer.codes)}")
    print({method: dict(codes) for method, codes in sorted(fuzzer.by_method.items())})
    for method in ("Generate", "Complete", "ChatComplete"):
        print(method, fuzzer.messages[method].most_common(6))
    assert sum(fuzzer.codes.values()) >= CASES
    # The run must reach the model, not only the validators.
    generated = sum(fuzzer.by_method[m]["OK"] + fuzzer.by_method[m]["DEADLINE_EXCEEDED"]
                    for m in ("Generate", "Complete", "ChatComplete"))
    assert generated > CASES // 20, dict(fuzzer.by_method)
    assert fuzzer.codes["INVALID_ARGUMENT"] > CASES // 10, dict(fuzzer.codes)


@pytest.fixture(scope="module")
def limits_server(launch_server: Any, tiny_llama_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("limits-fuzz")
    (home / "keys").write_text(API_KEY + "\n")
    (home / "lora").mkdir()
    # No per-client cap: a call of exactly the capacity's outputs is let in, and the limit refuses one more.
    running = launch_server("--model", str(tiny_llama_dir), "--dtype", "float32", "--api-key-file",
                            str(home / "keys"), "--enable-custom-logit-processor", "--kv-cache-tokens", "65536",
                            "--stalled-stream-timeout", "5", "--enable-lora-admin", "--lora-root", str(home / "lora"))
    yield running
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=60) == 0


def test_requests_past_the_limits_are_refused_cleanly(limits_server: RunningServer) -> None:
    fuzzer = WireFuzzer(limits_server.target, API_KEY, raise_forbidden=False)  # every forbidden status, listed
    run = LimitRun(fuzzer)
    limits, _ = read_limits(fuzzer.channel, API_KEY)

    @settings(max_examples=LIMIT_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(limit_cases(limits, timeout=10.0))
    def one(case: LimitCase) -> None:
        run.send(case)

    try:
        one()
        summary = run.summary()
        print(f"\nlimits fuzz: {sum(fuzzer.codes.values())} calls, codes {dict(fuzzer.codes)}")
        print(json.dumps({k: summary[k] for k in ("by_kind", "slowest_refused", "refusals_over_1s")}))
        assert not summary["forbidden"], json.dumps(summary["forbidden"], indent=1)
        assert limits_server.process.poll() is None, "the server died"
        assert fuzzer.settled().kv_cache_used_pages == 0
        with Client(limits_server.target, api_key=API_KEY) as client:
            assert client.health() is ServingStatus.SERVING
            assert client.generate("Hello", sampling_params={"max_new_tokens": 3})[0].usage is not None
    finally:
        fuzzer.close()
    assert sum(fuzzer.codes.values()) >= LIMIT_CASES
    # Both sides of the limits: requests let in (and run) as well as refused.
    assert fuzzer.codes["OK"] > LIMIT_CASES // 10 and fuzzer.codes["INVALID_ARGUMENT"] > LIMIT_CASES // 10, \
        dict(fuzzer.codes)
