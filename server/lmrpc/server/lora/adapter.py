"""Reading a PEFT LoRA adapter (a directory with adapter_config.json and adapter_model.safetensors) and checking it
against the served model: target modules among q, k, v, o, gate, up, down; rank at most `--max-lora-rank`; the
scale alpha/r, or alpha/sqrt(r) with rsLoRA. No torch work beyond reading the tensors. Under --lora-root both files
are read through userinput.read_confined: a file symlinked out of the root is refused like a directory that is."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from lmrpc.server.lora.errors import AdapterError, AdapterErrorKind
from lmrpc.server.userinput import OutsideRoot, clip, read_confined

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names -> ours. q/k/v land in the fused qkv product, gate/up in the fused gate_up product.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT saves without the adapter's name; older
# versions and other tools keep ".default" before ".weight").
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class ModuleLora:
    """One module's low-rank pair of one layer, as stored by PEFT."""

    a: torch.Tensor  # [rank, in] float32
    b: torch.Tensor  # [out, rank] float32


@dataclass(frozen=True)
class AdapterFile:
    """A PEFT adapter as read from disk, checked for shape against the model."""

    path: str  # the directory, resolved
    rank: int  # r
    alpha: float  # lora_alpha
    rslora: bool  # use_rslora: scale alpha / sqrt(r) instead of alpha / r
    modules: dict[tuple[int, str], ModuleLora]  # (layer, PEFT module name) -> its pair

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise AdapterError(AdapterErrorKind.INVALID, f"adapter at {clip(self.path)}: rank {self.rank} must be >= 1")

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({m for _, m in self.modules}))


@dataclass(frozen=True)
class ModelDims:
    """The served model's sizes an adapter must match (per PEFT module name: (in, out) features)."""

    layers: int  # decoder layers
    features: dict[str, tuple[int, int]]  # PEFT module name -> (in_features, out_features)


def read_adapter(directory: Path, dims: ModelDims, max_rank: int, root: str | None = None) -> AdapterFile:
    """Read and check one adapter directory; raises AdapterError naming what does not fit. root (a real path, the
    adapter root of a request's load): every file must resolve under it."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    config_bytes = _read(config_path, directory, root)
    try:
        config = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(AdapterErrorKind.INVALID,
                           f"{_shown(config_path)}: unreadable adapter config: {clip(str(exc))}") from exc
    if not isinstance(config, dict):
        raise AdapterError(AdapterErrorKind.INVALID, f"{_shown(config_path)}: the adapter config must be a JSON object")
    _check_config(config, config_path, max_rank)
    weights = _read(weights_path, directory, root)
    try:
        tensors = load_safetensors(weights)
    except SafetensorError as exc:
        raise AdapterError(AdapterErrorKind.INVALID,
                           f"{_shown(weights_path)}: unreadable safetensors: {clip(str(exc))}") from exc
    del weights  # the tensors are copies: let the file's bytes go before the products are built
    rank = int(config["r"])
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(AdapterErrorKind.INVALID,
                               f"{_shown(weights_path)}: tensor {clip(repr(key))} is not a LoRA pair of a decoder "
                               f"layer's projection (supported target modules: {', '.join(MODULES)})")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[which] = tensor
    modules = {key: _module(key, pair, dims, rank, weights_path) for key, pair in pairs.items()}
    if not modules:
        raise AdapterError(AdapterErrorKind.INVALID, f"{_shown(weights_path)}: no LoRA weights in the file")
    return AdapterFile(str(directory), rank, float(config.get("lora_alpha", rank)),
                       bool(config.get("use_rslora", False)), modules)


def _shown(path: Path) -> str:
    """A path for an error message: derived from a request's path, so cut to userinput.MAX_ECHO_CHARS."""
    return clip(str(path))


def _read(path: Path, directory: Path, root: str | None) -> bytes:
    """One file of the adapter (confined to `root` when given), as an AdapterError naming what is wrong."""
    try:
        return read_confined(str(path), root)
    except OutsideRoot as exc:
        raise AdapterError(AdapterErrorKind.PERMISSION,
                           f"{_shown(path)} resolves outside the adapter root (--lora-root)") from exc
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        raise AdapterError(AdapterErrorKind.NOT_FOUND, f"no LoRA adapter at {_shown(directory)}: it needs "
                                                       f"{CONFIG_FILE} and {WEIGHTS_FILE} (files)") from exc
    except OSError as exc:  # not a regular file (a FIFO, a device), no permission, an I/O error
        raise AdapterError(AdapterErrorKind.INVALID, f"{_shown(path)}: unreadable: {exc.strerror or exc}") from exc


def _check_config(config: dict[str, object], path: Path, max_rank: int) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(AdapterErrorKind.INVALID,
                           f"{_shown(path)}: peft_type {clip(repr(config.get('peft_type')))} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(AdapterErrorKind.INVALID,
                           f"{_shown(path)}: r must be a positive integer, got {clip(repr(rank))}")
    if rank > max_rank:
        raise AdapterError(AdapterErrorKind.INVALID,
                           f"{_shown(path)}: rank {rank} is above this server's limit {max_rank} (--max-lora-rank)")
    unsupported = [(key, config.get(key)) for key in ("rank_pattern", "alpha_pattern", "modules_to_save",
                                                      "layers_to_transform")
                   if config.get(key)]
    if config.get("use_dora"):
        unsupported.append(("use_dora", True))
    if config.get("bias", "none") != "none":
        unsupported.append(("bias", config.get("bias")))
    if unsupported:
        names = ", ".join(f"{key}={value!r}" for key, value in unsupported)
        raise AdapterError(AdapterErrorKind.INVALID, f"{_shown(path)}: unsupported adapter settings: {clip(names)}")


def _module(key: tuple[int, str], pair: dict[str, torch.Tensor], dims: ModelDims, rank: int,
            path: Path) -> ModuleLora:
    layer, module = key
    where = f"{_shown(path)}: layer {layer} {module}"
    if module not in dims.features:
        raise AdapterError(AdapterErrorKind.INVALID,
                           f"{where}: target module {module!r} is not one of this model's ({', '.join(MODULES)})")
    if not 0 <= layer < dims.layers:
        raise AdapterError(AdapterErrorKind.INVALID, f"{where}: the model has {dims.layers} layers")
    if set(pair) != {"A", "B"}:
        raise AdapterError(AdapterErrorKind.INVALID, f"{where}: needs both lora_A and lora_B")
    in_features, out_features = dims.features[module]
    a, b = pair["A"].float(), pair["B"].float()
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise AdapterError(AdapterErrorKind.INVALID,
                           f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the model "
                           f"(expected [{rank}, {in_features}] and [{out_features}, {rank}])")
    return ModuleLora(a.contiguous(), b.contiguous())
