"""The contract from outside Python: a Node.js client (@grpc/grpc-js, protos from proto/) against a real server."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from google.rpc import status_pb2

from lmrpc.client import Client, LmrpcError

if TYPE_CHECKING:
    from tests.e2e.conftest import RunningServer

pytestmark = pytest.mark.e2e

NODE_DIR = Path(__file__).parent / "node"
SCRIPT = NODE_DIR / "client_test.mjs"
STAMP = NODE_DIR / "node_modules" / ".lmrpc-installed"  # hash of the manifest + lock last installed


def _manifest_hash() -> str:
    digest = hashlib.sha256()
    for name in ("package.json", "package-lock.json"):
        path = NODE_DIR / name
        digest.update(path.read_bytes() if path.exists() else b"")
    return digest.hexdigest()


@pytest.fixture(scope="session")
def node_deps() -> Path:
    """node_modules installed from the lock (once; skipped when it already matches package.json and the lock)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        if os.environ.get("CI"):  # the CI machines have them: a skip there would hide a broken interop test
            pytest.fail("node and npm are not on PATH; CI machines have them")
        pytest.skip("node and npm are needed for the Node.js interop test")
    wanted = _manifest_hash()
    if not (STAMP.exists() and STAMP.read_text() == wanted):
        has_lock = (NODE_DIR / "package-lock.json").exists()
        command = ["npm", "ci" if has_lock else "install", "--no-audit", "--no-fund"]
        done = subprocess.run(command, cwd=NODE_DIR, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
        STAMP.write_text(wanted)
    return NODE_DIR / "node_modules"


def _googleapis_dir() -> Path:
    """Where googleapis-common-protos put google/rpc/*.proto (site-packages), for the script to decode the details."""
    root = Path(status_pb2.__file__).resolve().parents[2]
    assert (root / "google" / "rpc" / "error_details.proto").is_file(), f"no google/rpc protos under {root}"
    return root


API_KEY = "node-test-key-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed_server(launch_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server of its own that requires an API key (--api-key-file), so the Node client shows it passes one."""
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# the Node test's key\n{API_KEY}\n")
    running = launch_server("--api-key-file", str(keys), "--sampling-defaults", "openai")
    yield running
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def summary(node_deps: Path, keyed_server: RunningServer) -> dict[str, Any]:
    command = ["node", str(SCRIPT), keyed_server.target, "--googleapis", str(_googleapis_dir()), "--api-key", API_KEY]
    done = subprocess.run(command, cwd=NODE_DIR, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"the Node.js client failed (exit {done.returncode}):\n{done.stderr}\n{done.stdout}"
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["ok"] is True and result["failures"] == []
    return result


def test_node_streams_deltas_and_the_last_finishes(summary: dict[str, Any]) -> None:
    stream = summary["stream"]
    assert stream["deltas"] > 1
    assert stream["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS")
    assert stream["usage"]["completion_tokens"] <= 12
    assert stream["usage"]["prompt_tokens"] > 0
    assert "Paris" in stream["text"]


def test_node_cancel_is_cancelled_and_aborted_on_the_server(summary: dict[str, Any]) -> None:
    cancel = summary["cancel"]
    assert cancel["code"] == "CANCELLED"
    assert cancel["deltas_before_cancel"] >= 1
    assert cancel["still_running_after"] == []


def test_node_decodes_bad_request_details(summary: dict[str, Any]) -> None:
    invalid = summary["invalid_argument"]
    assert invalid["code"] == "INVALID_ARGUMENT"
    assert invalid["status_code"] == 3
    assert "temperature" in invalid["message"]
    fields = [v["field"] for v in invalid["field_violations"]]
    assert "sampling_params[0].temperature" in fields


def test_node_completes_with_a_usage_chunk(summary: dict[str, Any]) -> None:
    complete = summary["complete"]
    assert complete["model"] == "SmolLM2-135M-Instruct"
    assert complete["finish_reason"] in ("COMPLETION_FINISH_REASON_LENGTH", "COMPLETION_FINISH_REASON_STOP")
    assert "Paris" in complete["text"]
    assert 0 < complete["usage"]["completion_tokens"] <= 6


def test_node_chats_and_decodes_its_bad_request(summary: dict[str, Any]) -> None:
    chat = summary["chat"]
    assert chat["content"] and chat["usage"]["prompt_tokens"] > 0
    assert [v["field"] for v in chat["invalid"]["field_violations"]] == ["messages"]


def test_node_passes_the_api_key_and_reads_the_orca_trailer(summary: dict[str, Any]) -> None:
    auth = summary["auth"]
    assert auth["unauthenticated"] == "UNAUTHENTICATED" and auth["stream_unauthenticated"] == "UNAUTHENTICATED"
    assert "Bearer" in auth["unauthenticated_message"]
    assert auth["health_without_key"] == "SERVING"
    assert auth["load"]["kv_cache_pages"] > 0 and auth["load"]["max_running_outputs"] == 64
    report = bytes.fromhex(auth["orca_report_hex"])
    assert b"kv_cache" in report and b"running_outputs" in report  # utilization and named_metrics keys
    assert report[0] in (0x11, 0x2A)  # mem_utilization (field 2, double) or utilization (field 5), in field order


def test_both_services_need_the_key_from_python_and_the_cli(keyed_server: RunningServer) -> None:
    with Client(keyed_server.target) as keyless:
        for call in (lambda: keyless.chat("Hi", max_tokens=2), lambda: keyless.complete("Hi", max_tokens=2),
                     lambda: keyless.generate("Hi", sampling_params={"max_new_tokens": 2}), keyless.get_load):
            with pytest.raises(LmrpcError) as info:
                call()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert keyless.health().name == "SERVING"
    with Client(keyed_server.target, api_key=API_KEY) as keyed:
        assert keyed.chat("Hi", max_tokens=2, temperature=0).choices[0].message.content is not None
        assert keyed.complete("Hi", max_tokens=2).choices
    cli = [os.path.join(os.path.dirname(sys.executable), "lmrpc"), "load", "--target", keyed_server.target]
    denied = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=False,
                            env={k: v for k, v in os.environ.items() if k != "LMRPC_API_KEY"})
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    allowed = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=False,
                             env={**os.environ, "LMRPC_API_KEY": API_KEY})
    assert allowed.returncode == 0 and "kv_cache_pages:" in allowed.stdout, allowed.stderr
    flag = subprocess.run([*cli, "--api-key", API_KEY, "--json"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert flag.returncode == 0 and json.loads(flag.stdout)["max_running_outputs"] == 64
