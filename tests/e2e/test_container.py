"""The image, proven: built from the repo's Dockerfile on a debootstrapped Debian base by scripts/container.sh (CI's
stage "container image", in the background while the rest runs; that stage also runs the image once to build its
kernels into the cache volume), run with podman as non-root on a read-only root filesystem under a 2 GiB memory
limit: it becomes SERVING, sizes its KV pool from the container's limit, generates, and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmrpc.client import Client, ServingStatus

pytestmark = pytest.mark.e2e

IMAGE = os.environ.get("LMRPC_TEST_IMAGE", "localhost/lmrpc:test")
# Kept across runs: the kernels are built once per machine (CI's image stage builds them into it before this test).
CACHE_VOLUME = os.environ.get("LMRPC_TEST_CACHE_VOLUME", "lmrpc-test-cache")
# Set by scripts/test.sh in CI, where the image is built in the background: a file that holds the build's exit code
# once it ends, and the build's log.
BUILD_STATUS = os.environ.get("LMRPC_TEST_IMAGE_STATUS")
BUILD_LOG = os.environ.get("LMRPC_TEST_IMAGE_LOG")
BUILD_WAIT_S = 1800


def _wait_for_the_build() -> None:
    if BUILD_STATUS is None:
        return
    status = Path(BUILD_STATUS)
    deadline = time.monotonic() + BUILD_WAIT_S
    while not status.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"CI's background build of {IMAGE} did not end within {BUILD_WAIT_S} s")
        time.sleep(2)
    code = status.read_text().strip()
    if code != "0":
        log = Path(BUILD_LOG).read_text(errors="replace")[-6000:] if BUILD_LOG else "(no log)"
        pytest.fail(f"building {IMAGE} failed (exit {code}):\n{log}")
# This VM's cgroups are a v1/v2 hybrid that crun refuses, and podman's default ulimits exceed the hard limits here.
RUN_FLAGS = ("--runtime", "runc", "--network", "host", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


def _podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def image() -> str:
    _wait_for_the_build()
    if shutil.which("podman") is None or _podman("image", "exists", IMAGE, check=False).returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"CI builds {IMAGE} (scripts/test.sh, stage 'container image'); it is missing")
        pytest.skip(f"no podman image {IMAGE}: build it with scripts/container.sh (needs root, podman, runc, "
                    "debootstrap)")
    return IMAGE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def container(image: str) -> Iterator[tuple[str, str]]:
    name = f"lmrpc-test-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    _podman("run", "-d", "--name", name, *RUN_FLAGS, "--read-only", "--tmpfs", "/tmp",
            "-v", f"{CACHE_VOLUME}:/opt/lmrpc-cache", "--memory", "2g", image,
            "lmrpc-server", "--host", "127.0.0.1", "--port", str(port), "--drain-delay", "0.5")
    try:
        yield name, f"127.0.0.1:{port}"
    finally:
        _podman("rm", "-f", name, check=False)


def test_the_image_serves_non_root_read_only_and_exits_cleanly(container: tuple[str, str]) -> None:
    name, target = container
    with Client(target) as client:
        try:
            client.wait_until_ready(900)  # a new cache volume (off CI): the kernels are built first
        except TimeoutError:
            logs = _podman("logs", name, check=False)
            raise AssertionError(f"not SERVING:\n{logs.stdout[-4000:]}\n{logs.stderr[-4000:]}") from None
        assert client.health("lmrpc.v1.GenerateService") is ServingStatus.SERVING
        [result] = client.generate("The capital of France is",
                                   sampling_params={"max_new_tokens": 8, "temperature": 0})
        assert result.usage is not None and result.usage.completion_tokens > 0 and result.text
        load = client.get_load()
    assert load.memory_limit_bytes == 2 << 30  # the container's limit, not the host's memory
    inspect = _podman("inspect", "--format", "{{.Config.User}} {{.HostConfig.ReadonlyRootfs}}", name).stdout.split()
    assert inspect == ["10001:10001", "true"]
    uid = _podman("exec", name, "id", "-u").stdout.strip()
    assert uid == "10001"
    denied = _podman("exec", name, "touch", "/opt/lmrpc/src/x", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr

    _podman("kill", "--signal", "TERM", name)
    started = time.monotonic()
    code = _podman("wait", name, timeout=120).stdout.strip()
    assert code == "0", _podman("logs", name, check=False).stdout[-4000:]
    assert time.monotonic() - started < 60
    logs = _podman("logs", name, check=False)
    output = logs.stdout + logs.stderr
    assert "KV cache:" in output and "memory limit of 2.00 GiB" in output, output[-4000:]
    assert "lmrpc-server ready" in output
