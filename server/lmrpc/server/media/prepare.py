"""A call's media items, prepared once for every front door: checked against what the model takes (its modalities,
--max-media-items) before anything is read, read and decoded (`ingest`), then placed in their prompts by the model's
processor in a worker thread. A front door gets one `MultimodalPrompt` per prompt, or an error naming the items:
`MediaRefused` (refused before any was read, every one named) or `MediaError` (the first failing item)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from lmrpc.server.config import MediaConfig
from lmrpc.server.media import ingest
from lmrpc.server.media.types import MediaError, Modality, MultimodalProcessor, MultimodalPrompt

_NOUNS = {Modality.IMAGE: "images", Modality.AUDIO: "audio"}


class MediaRefused(ValueError):
    """Items a model cannot take at all (a modality it lacks, more than --max-media-items): each one named."""

    def __init__(self, errors: Sequence[MediaError]) -> None:
        assert errors, "a refusal names at least one item"
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = tuple(errors)


@dataclass(frozen=True)
class MediaTarget:
    """The loaded model as media preparation sees it."""

    processor: MultimodalProcessor | None  # the model's processor; None for a text-only model
    architecture: str  # named in refusals: "this model (LlavaForConditionalGeneration) takes no audio"
    hidden_size: int  # the width of a precomputed embedding's rows


def check_items(prompts: Sequence[Sequence[ingest.WireItem]], target: MediaTarget, max_items: int) -> None:
    """Each prompt's items are of modalities the model takes (a text-only model takes none), at most `max_items` of
    them: refused before anything is fetched, decoded or rendered. Raises MediaRefused naming each item at fault."""
    modalities = target.processor.modalities if target.processor is not None else frozenset()
    errors: list[MediaError] = []
    named: set[str] = set()
    for items in prompts:
        for w in items:
            if w.modality not in modalities and w.field not in named:
                named.add(w.field)
                takes = (" and ".join(sorted(_NOUNS[m] for m in modalities)) + " only") if modalities else "text only"
                errors.append(MediaError(w.field, f"this model ({target.architecture}) takes no "
                                                  f"{_NOUNS[w.modality]} ({takes})"))
        if len(items) > max_items and items[max_items].field not in named:
            first_over = items[max_items].field
            named.add(first_over)
            errors.append(MediaError(first_over, f"the prompt has {len(items)} media items; the server takes at most "
                                                 f"{max_items} per prompt (--max-media-items)"))
    if errors:
        raise MediaRefused(errors)


async def prepare(prompts: Sequence[Sequence[int]], items: Sequence[Sequence[ingest.WireItem]], target: MediaTarget,
                  config: MediaConfig) -> list[MultimodalPrompt | None]:
    """Each prompt with its items placed by the model's processor (None for a prompt without items): checked
    (check_items), read and decoded (ingest), then handed to the processor off the event loop."""
    if not any(items):
        return [None] * len(prompts)
    check_items(items, target, config.max_media_items)
    processor = target.processor
    assert processor is not None, "check_items refuses media on a model without a processor"
    model = ingest.ModelMedia(sampling_rate=processor.sampling_rate, hidden_size=target.hidden_size,
                              min_audio_samples=processor.min_audio_samples,
                              max_audio_seconds=processor.max_audio_seconds)
    media = await ingest.ingest(items, config, model)
    return await asyncio.to_thread(
        lambda: [processor.prepare(list(p), m) if m else None for p, m in zip(prompts, media, strict=True)])
