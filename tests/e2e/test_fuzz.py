"""A CI-sized wire fuzz (tests/wire_fuzz.py): a few hundred hypothesis-made requests of every RPC against a real
server (the tiny random-weight Llama, so that valid generations are quick; API keys on): no call ends INTERNAL,
UNKNOWN or UNAVAILABLE, the server is still serving afterwards, and every KV page is free again.
`LMRPC_FUZZ_CASES` sets the number of cases (default 300); bench/fuzz.py runs the long one."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from wire_fuzz import Case, WireFuzzer, cases

from lmrpc.client import Client, ServingStatus

if TYPE_CHECKING:
    from tests.e2e.conftest import RunningServer

pytestmark = pytest.mark.e2e

API_KEY = "fuzz-key-0123456789abcdef"
CASES = int(os.environ.get("LMRPC_FUZZ_CASES", "300"))


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
