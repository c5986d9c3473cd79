"""The boundary between media ingestion (the service: fetch, decode, limits) and a multimodal model (its processor
and encoder). No torch here: the service imports it.

The service turns each wire `MediaItem` into a `Media` (decoded, digested, its wire path kept for errors) and hands a
prompt's items to the model's `MultimodalProcessor`, which expands the placeholders and returns a
`MultimodalPrompt` the engine runs like any other prompt."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    from PIL.Image import Image


class Modality(enum.Enum):
    IMAGE = "image"
    AUDIO = "audio"


@dataclass(frozen=True)
class MediaOptions:
    """Per-item options, passed to the model's processor where it takes them."""

    min_pixels: int | None = None  # lower bound on the resized image's pixels (Qwen2-VL); None: the processor's
    max_pixels: int | None = None  # upper bound on the resized image's pixels (Qwen2-VL); None: the processor's


@dataclass(frozen=True)
class Media:
    """One image or audio clip of a prompt, decoded. Exactly one of image, audio, processor_output, embedding."""

    modality: Modality
    wire_field: str  # where it came from on the wire, for errors: "image_data[0].items[1]"
    # blake2b-128 of what the model will see: the decoded pixels (mode, size, bytes) or samples (rate, float32
    # bytes), or the processor tensors / embedding bytes. The same image sent as PNG bytes, a data: URI, a URL or a
    # path has the same digest; the prefix cache keys the item's positions on it.
    digest: bytes
    image: Image | None = None  # decoded, RGB
    audio: np.ndarray | None = None  # [samples] float32 mono, at sampling_rate
    sampling_rate: int | None = None  # the audio's samples per second (the decoder resamples to the model's rate)
    processor_output: Mapping[str, np.ndarray] | None = None  # the HF processor's tensors (pixel_values, ...)
    embedding: np.ndarray | None = None  # [tokens, hidden] float32: the item's rows as the language model reads them
    options: MediaOptions = field(default_factory=MediaOptions)

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.image, self.audio, self.processor_output, self.embedding)]
        assert sum(given) == 1, "a Media holds exactly one form"
        assert (self.audio is None) == (self.sampling_rate is None)


class MediaError(ValueError):
    """A user error in one item (undecodable, too large, too many for the placeholders, ...): INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field  # the wire path: "image_data[0].items[1]"
        self.message = message


@dataclass(frozen=True)
class MultimodalPrompt:
    """A prompt with its media placed: what the service puts in the engine request."""

    token_ids: tuple[int, ...]  # the prompt with each item's placeholder expanded to its positions
    # The engine's view of the items (their rows or what computes them, the positions they fill, their cache keys):
    # defined by the engine side, opaque to the service, carried in EngineRequest.
    engine_media: Any
    media_positions: int  # how many prompt positions the items fill


class MultimodalProcessor(Protocol):
    """What a multimodal model offers the service (models.multimodal)."""

    # which modalities the model takes; a request with another one is INVALID_ARGUMENT naming the field
    modalities: frozenset[Modality]
    sampling_rate: int  # audio models: the rate the decoder resamples clips to (0 for image-only models)
    # audio models: the fewest samples (at sampling_rate) that give the encoder one position (from its feature
    # extractor's hop and its convolutions' strides); a shorter clip is refused. 0 for models without audio.
    min_audio_samples: int
    # audio models: the longest clip the model takes, in seconds (its feature extractor's window); a longer one is
    # refused whatever --max-audio-seconds allows. None: no limit of the model's own (and models without audio).
    max_audio_seconds: float | None
    # what a prompt writes for one item of each modality (the placeholder token with the model's markers around it,
    # e.g. "<image>", "<|vision_start|><|image_pad|><|vision_end|>"): ChatComplete writes it for a media part where
    # the chat template renders text only
    placeholders: Mapping[Modality, str]

    def prepare(self, prompt: str | Sequence[int], media: Sequence[Media]) -> MultimodalPrompt:
        """Expand the prompt's image/audio placeholder tokens for the items (in order) and place them. Raises
        MediaError naming an item (too many for the placeholders, wrong tensor shapes, ...). Thread-safe, no torch
        work beyond the HF processor's: the encoder runs on the engine thread."""
        ...
