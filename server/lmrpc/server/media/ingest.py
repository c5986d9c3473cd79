"""A request's media items (GenerateRequest's image_data/audio_data, ChatComplete's image_url/input_audio parts) ->
per prompt the decoded `Media` a model's processor takes. Reads (fetches, files) run concurrently, at most
CONCURRENCY at once per call; decoding runs in worker threads, off the event loop. Every failure is a `MediaError`
naming the item's wire field (`sources.SourceError` where the status is not INVALID_ARGUMENT); of several, the first
item's in request order is raised."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

import httpx2

from lmrpc.server.config import MediaConfig
from lmrpc.server.media import decode, sources
from lmrpc.server.media.types import Media, MediaError, MediaOptions, Modality
from lmrpc.v1 import generate_pb2

CONCURRENCY = 8  # items of one call read and decoded at once


@dataclass(frozen=True)
class WireItem:
    """One media item as a request carries it, before anything is read."""

    modality: Modality  # image or audio: which of the model's placeholders it fills
    field: str  # its wire path, named in errors: "image_data[0].items[1]", "messages[0].content_parts[2]"
    item: generate_pb2.MediaItem  # where its bytes come from, and its options


@dataclass(frozen=True)
class ModelMedia:
    """What decoding needs to know of the model."""

    sampling_rate: int  # audio is resampled to this many samples per second (0: the model takes no audio)
    hidden_size: int  # the width of a precomputed embedding's rows
    # the model's own audio limits (MultimodalProcessor.min_audio_samples, .max_audio_seconds): a clip outside them is
    # refused when it decodes (too long: from its header), before the processor sees it
    min_audio_samples: int = 0
    max_audio_seconds: float | None = None


# A data: URI's media type -> the audio container it declares (ChatComplete's input_audio.format becomes
# "audio/<format>"); decode.decode_audio checks the bytes against it.
DECLARED_AUDIO = {"audio/wav": "WAV", "audio/wave": "WAV", "audio/x-wav": "WAV", "audio/vnd.wave": "WAV",
                  "audio/flac": "FLAC", "audio/x-flac": "FLAC",
                  "audio/mp3": "MP3", "audio/mpeg": "MP3", "audio/mpeg3": "MP3", "audio/x-mpeg-3": "MP3"}


def declared_audio(url: str) -> str | None:
    """The audio container a data: URI's media type names ("WAV", "FLAC", "MP3"), or None (another URL, no type, or
    one we do not check)."""
    if url[:5].lower() != "data:":
        return None
    media_type = url[5:].partition(",")[0].partition(";")[0]
    return DECLARED_AUDIO.get(media_type.strip().lower())


def generate_items(req: generate_pb2.GenerateRequest, num_prompts: int) -> list[list[WireItem]]:
    """image_data and audio_data (each none, one list for every prompt, or one per prompt; checked by validation)
    -> each prompt's items: its images in order, then its audio clips in order."""
    prompts: list[list[WireItem]] = [[] for _ in range(num_prompts)]
    for name, modality in (("image_data", Modality.IMAGE), ("audio_data", Modality.AUDIO)):
        lists = getattr(req, name)
        for p in range(num_prompts if lists else 0):
            index = 0 if len(lists) == 1 else p
            prompts[p] += [WireItem(modality, f"{name}[{index}].items[{j}]", item)
                           for j, item in enumerate(lists[index].items)]
    return prompts


def item_options(item: generate_pb2.MediaItem, field: str) -> MediaOptions:
    low = item.min_pixels if item.HasField("min_pixels") else None
    high = item.max_pixels if item.HasField("max_pixels") else None
    if low is not None and low < 1:
        raise MediaError(f"{field}.min_pixels", f"must be >= 1, got {low}")
    if high is not None and high < 1:
        raise MediaError(f"{field}.max_pixels", f"must be >= 1, got {high}")
    if low is not None and high is not None and low > high:
        raise MediaError(f"{field}.min_pixels", f"must be <= max_pixels ({high}), got {low}")
    return MediaOptions(min_pixels=low, max_pixels=high)


def _decode_bytes(w: WireItem, data: bytes, options: MediaOptions, config: MediaConfig, model: ModelMedia) -> Media:
    sources.check_size(len(data), w.field, config)
    if w.modality is Modality.IMAGE:
        image, digest = decode.decode_image(data, w.field, config.max_image_pixels)
        return Media(Modality.IMAGE, w.field, digest, image=image, options=options)
    if model.sampling_rate <= 0:
        raise MediaError(w.field, "this model takes no audio")
    declared = declared_audio(w.item.url) if w.item.WhichOneof("source") == "url" else None
    samples, digest = decode.decode_audio(data, w.field, model.sampling_rate, config.max_audio_seconds,
                                          model_max_seconds=model.max_audio_seconds,
                                          min_samples=model.min_audio_samples, declared=declared)
    return Media(Modality.AUDIO, w.field, digest, audio=samples, sampling_rate=model.sampling_rate, options=options)


def _decode_tensors(w: WireItem, options: MediaOptions, config: MediaConfig, model: ModelMedia) -> Media:
    source = w.item.WhichOneof("source")
    if source == "embedding":
        t = w.item.embedding
        sources.check_size(len(t.data), w.field, config)
        rows, digest = decode.embedding_array(t.dtype, tuple(t.shape), t.data, f"{w.field}.embedding",
                                              model.hidden_size)
        return Media(w.modality, w.field, digest, embedding=rows, options=options)
    tensors = w.item.processor_output.tensors
    if not tensors:
        raise MediaError(f"{w.field}.processor_output.tensors", "must hold at least one tensor")
    sources.check_size(sum(len(t.data) for t in tensors.values()), w.field, config)
    arrays = {}
    for name in sorted(tensors):
        if not name:
            raise MediaError(f"{w.field}.processor_output.tensors", "tensor names must not be empty")
        t = tensors[name]
        at = f"{w.field}.processor_output.tensors[{name!r}]"
        arrays[name] = (t.dtype, decode.tensor_array(t.dtype, tuple(t.shape), t.data, at))
    return Media(w.modality, w.field, decode.tensors_digest(arrays),
                 processor_output={name: array for name, (_, array) in arrays.items()}, options=options)


async def _one(w: WireItem, config: MediaConfig, model: ModelMedia, client: httpx2.AsyncClient | None,
               slots: asyncio.Semaphore) -> Media:
    async with slots:
        source = w.item.WhichOneof("source")
        if source is None:
            raise MediaError(w.field, "has no source: set url, data, processor_output or embedding")
        options = item_options(w.item, w.field)
        if source in ("embedding", "processor_output"):
            return await asyncio.to_thread(_decode_tensors, w, options, config, model)
        if source == "data":
            data = w.item.data
        else:
            url = w.item.url
            if not url:
                raise MediaError(f"{w.field}.url", "must not be empty")
            data = await sources.read_url(url, w.field, config, client)
        return await asyncio.to_thread(_decode_bytes, w, data, options, config, model)


def _fetches(prompts: Sequence[Sequence[WireItem]]) -> bool:
    return any(w.item.WhichOneof("source") == "url" and w.item.url.lower().startswith(("http:", "https:"))
               for items in prompts for w in items)


async def ingest(prompts: Sequence[Sequence[WireItem]], config: MediaConfig, model: ModelMedia) -> list[list[Media]]:
    """Each prompt's items read and decoded, in order. An item several prompts share (one list for every prompt) is
    read once. Raises the MediaError of the first failing item in request order."""
    unique = {w.field: w for items in prompts for w in items}
    slots = asyncio.Semaphore(CONCURRENCY)
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(sources.new_client(config)) if _fetches(prompts) else None
        results = await asyncio.gather(*(_one(w, config, model, client, slots) for w in unique.values()),
                                       return_exceptions=True)
    decoded: dict[str, Media] = {}
    for w, result in zip(unique.values(), results, strict=True):
        if isinstance(result, BaseException):
            raise result
        decoded[w.field] = result
    return [[decoded[w.field] for w in items] for items in prompts]
