"""The published client distribution on its own: `pip install ./client` into a fresh venv gives the stubs, the
client and the `lmrpc` CLI, and does not bring torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def run(*cmd: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=check, env=env, cwd="/")


def test_client_installs_alone_without_torch(tmp_path: Path) -> None:
    # Build from a copy so that the build leaves nothing (build/, *.egg-info) in the work tree.
    src = tmp_path / "client"
    shutil.copytree(ROOT / "client", src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python, lmrpc = env_dir / "bin" / "python", env_dir / "bin" / "lmrpc"

    install = run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", src, check=False)
    assert install.returncode == 0, install.stderr[-4000:]

    imports = "from lmrpc.v1 import generate_pb2, generate_pb2_grpc; import lmrpc.client, lmrpc.client.cli; " \
              "import sys; print(generate_pb2.GenerateRequest.DESCRIPTOR.full_name, 'torch' in sys.modules)"
    assert run(python, "-c", imports).stdout.split() == ["lmrpc.v1.GenerateRequest", "False"]

    help_text = run(lmrpc, "--help").stdout
    for command in ("generate", "info", "tokenize", "detokenize", "health", "abort"):
        assert command in help_text
    assert "--max-new-tokens" in run(lmrpc, "generate", "--help").stdout

    unreachable = run(lmrpc, "health", "--target", "127.0.0.1:1", "--timeout", "5", check=False)
    assert unreachable.returncode == 1 and "UNAVAILABLE" in unreachable.stderr

    no_torch = run(python, "-c", "import torch", check=False)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    installed = run(python, "-m", "pip", "list", "--format=freeze").stdout.lower()
    assert "lmrpc-client==" in installed and "torch" not in installed and "numpy" not in installed

