"""What every multimodal family shares: our language model read from the checkpoint's text weights (whichever prefix
transformers wrote), the encoder and projector as transformers modules with their weights loaded from the same files
(float32, eval), and `encode_media`, the executor's call for one item's rows (engine/media_rows.py).

A family subclasses `MultimodalLM`, registers its HF architecture name (models.register) and says how its encoder
turns one item's processor tensors into rows (`run_encoder`), how many positions those tensors fill
(`count_positions`), and which placeholder token each modality has (`placeholders`)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from transformers import AutoProcessor, PretrainedConfig

from lmrpc.server.media.types import Media, Modality, MultimodalProcessor
from lmrpc.server.models.llama import LlamaForCausalLM
from lmrpc.server.models.quantized import LinearBuilder
from lmrpc.server.models.types import MediaSpan
from lmrpc.server.models.weights import Matrix, WeightSource

# Where transformers versions put the language model's weights: ours are named as a causal LM's ("model.*",
# "lm_head.*"); a checkpoint may hold them under either prefix of each pair (first found wins).
TEXT_PREFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model.", ("language_model.model.", "model.language_model.", "model.")),
    ("lm_head.", ("language_model.lm_head.", "lm_head.")),
)

EncoderInput = Mapping[str, np.ndarray]  # one item's processor tensors, by the HF processor's names


class PrefixedWeights:
    """A checkpoint's weights seen under our language model's names (`TEXT_PREFIXES`)."""

    def __init__(self, inner: WeightSource) -> None:
        self._inner = inner

    def _name(self, name: str) -> str:
        for ours, theirs in TEXT_PREFIXES:
            if name.startswith(ours):
                for prefix in theirs:
                    candidate = prefix + name[len(ours) :]
                    if self._inner.has(candidate):
                        return candidate
        return name

    def has(self, name: str) -> bool:
        return self._inner.has(self._name(name))

    def tensor(self, name: str) -> torch.Tensor:
        return self._inner.tensor(self._name(name))

    def matrix(self, name: str) -> Matrix:
        return self._inner.matrix(self._name(name))


def load_module(module: nn.Module, weights: WeightSource, prefixes: tuple[str, ...]) -> nn.Module:
    """module with its parameters and buffers read from the checkpoint under the first prefix that holds them all,
    in float32 and eval mode (no dropout)."""
    names = list(module.state_dict())
    for prefix in prefixes:
        if all(weights.has(prefix + n) for n in names):
            module.load_state_dict({n: weights.tensor(prefix + n).float() for n in names}, strict=True)
            return module.float().eval()
    raise KeyError(f"the checkpoint has no {type(module).__name__} weights under any of {prefixes}")


def span_key(media: Media, count: int, inputs: EncoderInput | None) -> bytes:
    """An item's cache identity (MediaSpan.key): its media digest, its options, how many positions it fills and the
    shapes of its encoder's tensors (a resize that changes the rows changes them), so equal keys mean equal rows."""
    shapes = b"" if inputs is None else repr(sorted((k, v.shape) for k, v in inputs.items())).encode()
    extra = repr(media.options).encode() + count.to_bytes(4, "little") + shapes
    return hashlib.blake2b(media.digest + extra, digest_size=16).digest()


@dataclass(frozen=True)
class Placeholder:
    """A modality's placeholder token: one in a prompt per item, expanded to the item's positions."""

    modality: Modality  # which items it stands for
    token: str  # its text, e.g. "<image>"
    token_id: int  # its id
    # what a prompt writes for one item: the token with the model's markers around it, e.g. Qwen2-VL's
    # "<|vision_start|><|image_pad|><|vision_end|>" (ChatComplete writes it where a template renders text only)
    text: str = ""

    def __post_init__(self) -> None:
        if not self.text:
            object.__setattr__(self, "text", self.token)
        assert self.token in self.text


class MultimodalLM(LlamaForCausalLM):
    """Our language model (the checkpoint's text_config) plus a transformers encoder; the executor's CausalLM, and
    engine/media_rows.MediaEncoder."""

    # The HF processor's keyword for this modality's items (processor(text=..., images=[...]) or audio=[...]).
    PROCESSOR_KEYWORD: ClassVar[Mapping[Modality, str]] = {Modality.IMAGE: "images", Modality.AUDIO: "audio"}

    def __init__(self, config: PretrainedConfig, weights: WeightSource, builder: LinearBuilder) -> None:
        super().__init__(config.get_text_config(), PrefixedWeights(weights), builder)
        self.hf_config = config  # the whole checkpoint's config (the encoder's part too)
        self.build_encoder(config, weights)

    def build_encoder(self, config: PretrainedConfig, weights: WeightSource) -> None:
        """Create the encoder and projector modules (float32, on CPU: speed does not matter yet)."""
        raise NotImplementedError

    def run_encoder(self, inputs: EncoderInput) -> torch.Tensor:
        """One item's processor tensors -> its rows [positions, hidden] float32."""
        raise NotImplementedError

    @classmethod
    def count_positions(cls, config: PretrainedConfig, modality: Modality, inputs: EncoderInput) -> int:
        """How many positions one item's tensors fill; ValueError (the user's message) for tensors the encoder cannot
        take (wrong names, shapes)."""
        raise NotImplementedError

    @classmethod
    def fixed_positions(cls, config: PretrainedConfig, modality: Modality) -> int | None:
        """How many positions every item of the modality fills, where that is fixed (an embedding item must have
        that many rows); None where it depends on the item."""
        return None

    @classmethod
    def placeholders(cls, config: PretrainedConfig, hf_processor: object) -> tuple[Placeholder, ...]:
        """The placeholder token of each modality the model takes."""
        raise NotImplementedError

    @classmethod
    def processor_kwargs(cls, media: Media) -> dict[str, Any]:
        """Extra keywords for the HF processor's call on one item (its MediaOptions, where the family takes them)."""
        return {}

    @classmethod
    def sampling_rate(cls, hf_processor: object) -> int:
        """Audio models: the rate clips must have; 0 for image-only models."""
        return 0

    @classmethod
    def audio_limits(cls, hf_processor: object) -> tuple[int, float | None]:
        """Audio models: (the fewest samples at sampling_rate that give the encoder one position, the longest clip in
        seconds the model takes or None); (0, None) for models without audio (MultimodalProcessor's
        min_audio_samples and max_audio_seconds)."""
        return 0, None

    def encode_media(self, span: MediaSpan) -> torch.Tensor:
        """One item (span.encoder_input) -> its rows [span.length, hidden] float32, on the engine thread."""
        with torch.inference_mode():
            return self.run_encoder(span.encoder_input).float()

    def make_processor(self, path: Path) -> MultimodalProcessor:
        """The MultimodalProcessor the service calls (models/multimodal/processor.py), over the directory's HF
        processor."""
        from lmrpc.server.models.multimodal.processor import MediaPromptProcessor

        hf = AutoProcessor.from_pretrained(path)
        return MediaPromptProcessor(type(self), self.hf_config, hf, self.shape.hidden)
