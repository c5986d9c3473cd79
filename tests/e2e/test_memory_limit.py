"""The server inside a real memory cgroup (a child of this process's own, v1 or v2): it sizes its KV pool from the
cgroup's limit, not the host's memory, reports the limit in GetLoad and its RSS as a metric; a pool or a model that
cannot fit is a clear start-up error (exit 3), not an OOM kill."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmrpc.client import Client
from lmrpc.server import memory
from lmrpc.server.models.linear import resolve_dtype

pytestmark = pytest.mark.e2e

GIB = 1 << 30
LIMIT = 3 * GIB // 2


def _child_cgroup() -> tuple[Path, str]:
    """A fresh child of this process's memory cgroup, and the file that limits it; skip where none can be made."""
    v2_path, v1_path = memory._cgroup_paths(memory.PROC_SELF / "cgroup")
    v2_mount, v1_mount = memory._mounts(memory.PROC_SELF / "mountinfo")
    name = f"lmrpc-test-{uuid.uuid4().hex[:8]}"
    candidates = []
    if v1_mount is not None and v1_path is not None:
        candidates.append((memory._directory(v1_mount, v1_path) / name, "memory.limit_in_bytes"))
    if v2_mount is not None and v2_path is not None:
        candidates.append((memory._directory(v2_mount, v2_path) / name, "memory.max"))
    for directory, limit_file in candidates:
        try:
            directory.mkdir()
        except OSError:
            continue
        if (directory / limit_file).exists():
            return directory, limit_file
        directory.rmdir()
    pytest.skip("cannot create a memory cgroup here (needs root and a writable v1 memory or v2 hierarchy with the "
                "memory controller delegated)")


@pytest.fixture()
def cgroup() -> Iterator[tuple[Path, str]]:
    directory, limit_file = _child_cgroup()
    (directory / limit_file).write_text(str(LIMIT))
    yield directory, limit_file
    for _ in range(50):
        try:
            directory.rmdir()
            return
        except OSError:  # its last process is still exiting
            time.sleep(0.1)


def _start_in(cgroup: Path, *args: str) -> subprocess.Popen[str]:
    # The shell puts itself into the cgroup, then becomes the server: everything the server allocates is charged there.
    command = (f'echo $$ > "{cgroup}/cgroup.procs" && exec "{sys.executable}" -m lmrpc.server --host 127.0.0.1 '
               f'--port 0 {" ".join(args)}')
    return subprocess.Popen(["sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_the_pool_is_sized_from_the_cgroup_limit(cgroup: tuple[Path, str]) -> None:
    directory, _ = cgroup
    process = _start_in(directory, "--metrics-port", "0")
    assert process.stdout is not None
    lines: list[str] = []
    target = ""
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("lmrpc-server listening on "):
                target = "127.0.0.1:" + line.rsplit(":", 1)[1].strip()
            if line.startswith("lmrpc-server ready") or process.poll() is not None:
                break
        log = "".join(lines)
        assert target and "lmrpc-server ready" in log, log
        sized = re.search(r"KV cache: (\d+) tokens .* from 0\.25 of the cgroup v\d memory limit of 1\.50 GiB", log)
        assert sized, log
        tokens = int(sized.group(1))
        assert 2048 <= tokens < 0.25 * LIMIT / 23040 + 1  # a share of what the limit leaves (bf16 SmolLM2 bytes/token)
        with Client(target) as client:
            load = client.get_load()
            assert load.memory_limit_bytes == LIMIT
            assert load.kv_cache_pages * 16 <= tokens and 0 < load.resident_memory_bytes < LIMIT
            assert [r.text for r in client.generate("Hello", sampling_params={"max_new_tokens": 4})]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def test_an_explicit_pool_over_the_limit_is_a_clear_error(cgroup: tuple[Path, str]) -> None:
    directory, _ = cgroup
    process = _start_in(directory, "--kv-cache-tokens", "200000")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 3, output  # not -9: nothing was OOM-killed
    # 200,000 tokens of SmolLM2's KV cache: 4.29 GiB in bfloat16, twice that where --dtype auto is float32
    needs = 4.29 if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16 else 8.58
    assert f"lmrpc-server: error: not enough memory: --kv-cache-tokens 200000 needs {needs:.2f} GiB" in output
    assert "cgroup v" in output and "memory limit of 1.50 GiB" in output


def test_a_model_bigger_than_the_limit_is_refused_before_loading(cgroup: tuple[Path, str], tmp_path: Path) -> None:
    directory, _ = cgroup
    model = tmp_path / "big-model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with open(model / "model.safetensors", "wb") as f:  # sparse: 2 GiB long, no disk used
        f.truncate(2 * GIB)
    process = _start_in(directory, "--model", str(model))
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 3, output
    assert "the model's weights (2.00 GiB) do not fit in the cgroup v" in output
