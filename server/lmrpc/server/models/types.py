"""What a model takes in and hands up besides tensors: the model's description (`ModelInfo`, `ExpertsInfo`) and a
prompt's images and audio as the model's processor placed them (`PromptMedia`, `MediaSpan`, `RopePositions`); and the
errors of a `--model` that cannot be served (`ModelLoadError`). No torch, no protobuf: the engine's types
(`engine/types.py`) carry these, and the torch-free scheduler imports them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ModelLoadError(ValueError):
    """The model the server was started with cannot be served: its file is not a GGUF file, or is cut short or
    malformed, or names an architecture or a quantization with no implementation here. The message says which and
    where; `lmrpc-server` prints it and exits 4 (no traceback: the user's file is at fault, not the server)."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """`--model` names no model: a path that does not exist, a directory without an HF config, no weights in it, or
    the default model's package not installed."""


@dataclass(frozen=True, eq=False)  # identity-compared: encoder_input holds arrays, which have no plain ==
class MediaSpan:
    """One image or audio clip placed in a prompt: the positions it fills and what gives their rows."""

    start: int  # its first prompt position
    length: int  # prompt positions it fills (its placeholder token, expanded by the model's processor)
    # The item's cache identity: Media.digest and whatever else changes its rows (models.multimodal.base.span_key).
    # Position i of the span is keyed key + i (4 bytes): bytes never equal a token id, the same image gives the same
    # keys (a prefix-cache hit) and a different one different keys (never shared pages).
    key: bytes
    wire_field: str  # where the item came from on the wire, for errors: "image_data[0].items[1]"
    rows: bytes | None = None  # precomputed float32 little-endian [length, hidden] (Media.embedding), used as given
    # What the model's encoder takes to compute the rows (its processor's tensors for this item alone, numpy arrays),
    # opaque to the engine; None when rows are given. The encoder runs on the engine thread (engine/media_rows.py).
    encoder_input: Any = None

    def __post_init__(self) -> None:
        assert self.start >= 0 and self.length >= 1
        assert (self.rows is None) != (self.encoder_input is None), "a span has rows or an encoder input"

    @property
    def end(self) -> int:
        return self.start + self.length

    def position_keys(self, lo: int, hi: int) -> list[bytes]:
        """The prefix-cache keys of prompt positions [lo, hi), which lie inside the span."""
        return [self.key + (p - self.start).to_bytes(4, "little") for p in range(lo, hi)]



@dataclass(frozen=True)
class RopePositions:
    """A prompt's multimodal rotary positions (M-RoPE, Qwen2-VL): three per token, temporal, height and width. An
    image's tokens lie on its grid; a text token has three equal positions, one more than the largest before it.
    Only the rotation reads them: the KV cache keeps every token at its ordinary index."""

    prompt: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # [3][prompt_len]: temporal, height, width
    # a position p past the prompt (generated, or recomputed after preemption) rotates by p + delta in all three:
    # max(prompt) + 1 - prompt_len (<= 0: an image's grid takes fewer positions than it has tokens)
    delta: int

    def __post_init__(self) -> None:
        assert len(self.prompt) == 3 and len({len(c) for c in self.prompt}) == 1, "three equally long components"

    def span(self, start: int, end: int) -> tuple[list[int], list[int], list[int]]:
        """The three components of positions [start, end)."""
        cut = min(end, len(self.prompt[0]))
        after = list(range(max(start, cut) + self.delta, end + self.delta))
        t, h, w = (list(c[start:cut]) + after for c in self.prompt)
        return t, h, w



@dataclass(frozen=True)
class PromptMedia:
    """A prompt's images and audio clips (MultimodalPrompt.engine_media): the spans their rows replace."""

    spans: tuple[MediaSpan, ...]  # in position order, disjoint
    # M-RoPE models (Qwen2-VL): where each prompt token rotates, given where the items lie (models/mrope.py); None:
    # each token at its position, three times over (as every prompt of other models)
    rope_positions: RopePositions | None = None

    def __post_init__(self) -> None:
        assert all(a.end <= b.start for a, b in zip(self.spans, self.spans[1:], strict=False)), "ordered, disjoint"

    def overlapping(self, lo: int, hi: int) -> list[tuple[int, MediaSpan]]:
        """(index, span) of the spans with positions in [lo, hi)."""
        return [(i, s) for i, s in enumerate(self.spans) if s.start < hi and s.end > lo]



@dataclass(frozen=True)
class ExpertsInfo:
    """A mixture-of-experts model's routing layout."""

    num_layers: int  # layers with experts
    num_experts: int  # experts per layer
    top_k: int  # experts per token per layer



@dataclass(frozen=True)
class ModelInfo:
    """What the service and clients need to know about the loaded model."""

    path: str  # where the weights came from (directory or GGUF file)
    served_model_name: str  # name reported to clients
    architecture: str  # HF architectures[0], e.g. "LlamaForCausalLM"
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_context_length: int  # prompt + output limit in tokens
    eos_token_ids: tuple[int, ...]  # the model's end-of-sequence ids
    generation_defaults: Mapping[str, float]  # temperature/top_p/top_k/min_p/repetition_penalty set by
    #   generation_config.json (only the keys it sets)
    dtype: str  # e.g. "bfloat16"
    device: str  # e.g. "cpu"
    quantization: str = "none"  # "none", "int8" or "int4": how the linear weights are stored
    weight_formats: tuple[str, ...] = ()  # storage formats among the linear weights, e.g. ("q4_1", "q8_0")
    hidden_size: int = 0  # width of the hidden state (and of input_embeds rows)
    accepts_embeddings: bool = False  # the model can take a prompt as embeddings (our native implementations)
    experts: ExpertsInfo | None = None  # None: a dense model
