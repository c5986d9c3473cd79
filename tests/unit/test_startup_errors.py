"""A server that cannot start says why in one plain line, with no traceback. A --model that cannot be served: exit 4
(models.types.ModelLoadError; the user's file is at fault, not the server): a path that names no model, a file that
is not GGUF, cut short, without a tensor the model needs or with one of another shape than its header gives; and a
model that loads but cannot generate (its warm-up fails: never SERVING). Flags that cannot work here: exit 2, naming
the flag as typed (--device cuda without CUDA, --lora-modules naming no adapter, --kv-cache-tokens below a page, a
--port or --metrics-port in use)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_gguf import T as GGML
from tiny_gguf import write_tiny_llama

from lmrpc.server.__main__ import EXIT_BAD_MODEL
from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.models.gguf_file import GGUFFile
from lmrpc.server.models.loader import default_gguf
from lmrpc.server.models.types import ModelLoadError, ModelNotFoundError


def _missing(tmp: Path) -> Path:
    return tmp / "no-such-model.gguf"


def _no_config(tmp: Path) -> Path:
    (tmp / "model").mkdir()
    return tmp / "model"


def _not_gguf(tmp: Path) -> Path:
    (tmp / "model.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    return tmp / "model.gguf"


def _cut_short(tmp: Path) -> Path:
    # The bundled file's header is whole in its first 3 MB; its first tensor, the embeddings, is not.
    with open(default_gguf(), "rb") as f:
        (tmp / "cut.gguf").write_bytes(f.read(3_000_000))
    return tmp / "cut.gguf"


def _holed(tmp: Path) -> Path:
    return write_tiny_llama(tmp / "holed.gguf", GGML.Q4_0, leave_out=("blk.1.ffn_down.weight",))


def _wrong_shape(tmp: Path) -> Path:
    return write_tiny_llama(tmp / "wrong.gguf", GGML.Q4_0, halve_rows=("blk.0.attn_q.weight",))


def _bad_header(tmp: Path) -> Path:
    return write_tiny_llama(tmp / "heads.gguf", GGML.Q4_0, header_heads=3)  # 256 wide: no whole heads


@pytest.mark.parametrize(("make", "says"), [
    (_missing, "no such file or directory (--model takes an HF model directory or a .gguf file)"),
    (_no_config, "no config.json (--model takes an HF model directory or a .gguf file)"),
    (_not_gguf, "not a GGUF file"),
    (_cut_short, "tensor 'token_embd.weight' runs past the end of the file (truncated?)"),
    (_holed, "needs tensor 'model.layers.1.mlp.down_proj.weight' (blk.1.ffn_down.weight in the file's names)"),
    (_wrong_shape, "tensor 'model.layers.0.self_attn.q_proj.weight' is [128, 256] where the model's config makes it "
                   "[256, 256]"),
    (_bad_header, "its header is no valid model config: "),
])
def test_a_model_that_cannot_be_served_is_one_plain_line_and_exit_4(
        tmp_path: Path, make: Callable[[Path], Path], says: str) -> None:
    model = make(tmp_path)
    done = subprocess.run([sys.executable, "-m", "lmrpc.server", "--model", str(model), "--host", "127.0.0.1",
                           "--port", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_BAD_MODEL == 4, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lmrpc-server: error: cannot serve {model}: ") and last.count(str(model)) == 1, last
    assert says in last and "Traceback" not in done.stdout, last


def test_a_checkpoint_without_a_tensor_is_one_plain_line_and_exit_4(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "holed"
    shutil.copytree(tiny_llama_dir, model)
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model / "model.safetensors")
    done = subprocess.run([sys.executable, "-m", "lmrpc.server", "--model", str(model), "--host", "127.0.0.1",
                           "--port", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"lmrpc-server: error: cannot serve {model}: the model needs tensor 'model.layers.1.mlp.down_proj.weight', "
        "which no .safetensors file has")


def test_model_errors_are_the_value_and_file_errors_callers_caught_before(tmp_path: Path) -> None:
    path = _not_gguf(tmp_path)
    with pytest.raises(ModelLoadError) as caught:
        GGUFFile(path)
    assert isinstance(caught.value, ValueError)
    assert issubclass(ModelNotFoundError, ModelLoadError) and issubclass(ModelNotFoundError, FileNotFoundError)


def test_a_model_whose_warm_up_fails_is_a_model_load_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_tiny_llama(tmp_path / "tiny.gguf", GGML.Q4_0)
    engine = AsyncEngine.start(EngineConfig(model=ModelConfig(path=str(model), device="cpu"),
                                            cache=CacheConfig(num_tokens=1024)))
    try:
        def broken(batch: object) -> object:
            raise RuntimeError("no kernel for this shape")

        monkeypatch.setattr(engine.engine.executor, "forward", broken)
        with pytest.raises(ModelLoadError, match=r"warm-up generation failed: .*no kernel for this shape"):
            engine.warmup()
        monkeypatch.undo()
        engine.warmup()  # the same engine, its forward whole again: no error
    finally:
        engine.shutdown()


def _start(*flags: str, port: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmrpc.server", "--host", "127.0.0.1", "--port", str(port), *flags],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("which", ["--port", "--metrics-port"])
def test_a_port_in_use_is_a_flag_error(which: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _start(port=port) if which == "--port" else _start("--metrics-port", str(port))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    said = {"--port": f"--host/--port: cannot listen on 127.0.0.1:{port} (the port is in use",
            "--metrics-port": f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}"}[which]
    assert done.stderr.strip().splitlines()[-1].startswith(f"lmrpc-server: error: {said}"), done.stderr


def test_lora_modules_naming_no_adapter_is_a_flag_error(tmp_path: Path) -> None:
    done = _start("--lora-modules", f"x={tmp_path / 'nothing'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"lmrpc-server: error: --lora-modules: no LoRA adapter at {tmp_path / 'nothing'}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine serves --device cuda")
def test_device_cuda_without_cuda_is_a_flag_error() -> None:
    done = _start("--device", "cuda:1")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "lmrpc-server: error: --device cuda:1: no CUDA device here")


def test_config_errors_name_the_flag_typed(capsys: pytest.CaptureFixture[str]) -> None:
    from lmrpc.server.__main__ import engine_config, parse_args

    with pytest.raises(SystemExit) as exc:
        engine_config(parse_args(["--kv-cache-tokens", "10"]))
    assert exc.value.code == 2
    assert "lmrpc-server: error: --kv-cache-tokens must hold at least one page" in capsys.readouterr().err
