"""A real lmrpc-server subprocess on a loopback port with the real default model, shared by the e2e tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from lmrpc.client import Client


@dataclass
class RunningServer:
    target: str  # host:port
    process: subprocess.Popen[str]  # the server process
    metrics_target: str | None = None  # host:port of /metrics, when started with --metrics-port
    # Its output after "ready", read on a thread: the server logs a line per request, and an unread pipe would
    # fill up and block it.
    output: list[str] = field(default_factory=list)

    def stop(self) -> int:
        """SIGTERM, then its exit code within 60 s (killed if it is still running then)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()


# The KV pool of a test server unless its test names one: the default (a quarter of the host's available memory,
# 5.6 GiB on a 24 GiB machine) is made resident at start, ~15 s of page faults per server that no test here needs.
TEST_POOL = ("--kv-cache-tokens", "32768")


def start_server(*args: str, timeout: float = 300) -> RunningServer:
    pool = () if "--kv-cache-tokens" in args else TEST_POOL
    process = subprocess.Popen(
        [sys.executable, "-m", "lmrpc.server", "--host", "127.0.0.1", "--port", "0", *pool, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    target = ""
    metrics_target: str | None = None
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        if line.startswith("lmrpc-server listening on "):
            target = "127.0.0.1:" + line.rsplit(":", 1)[1].strip()
        if line.startswith("lmrpc-server metrics on "):
            metrics_target = "127.0.0.1:" + line.rsplit(":", 1)[1].strip()
        if line.startswith("lmrpc-server ready"):
            break
        if time.monotonic() > deadline:
            break
    if not target or process.poll() is not None:
        process.kill()
        raise RuntimeError("lmrpc-server did not start")
    running = RunningServer(target, process, metrics_target)
    threading.Thread(target=lambda: running.output.extend(process.stdout or ()), daemon=True).start()
    return running


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The container test runs last: in CI its image is built in the background (scripts/test.sh), and this gives
    the build the whole run to finish."""
    items.sort(key=lambda item: item.path.name == "test_container.py")


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    running = start_server("--enable-custom-logit-processor", "--sampling-defaults", "openai", "--metrics-port", "0")
    yield running
    assert running.stop() == 0


@pytest.fixture()
def client(server: RunningServer) -> Iterator[Client]:
    with Client(server.target) as c:
        yield c


@pytest.fixture(scope="session")
def launch_server() -> Callable[..., RunningServer]:
    """start_server for tests that need a server with flags of their own (they stop it themselves)."""
    return start_server

