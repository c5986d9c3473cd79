"""`MediaPromptProcessor`: a multimodal model's `MultimodalProcessor` (media/types.py), over its HF processor.

`prepare` tokenizes a text prompt (or takes token ids), finds the placeholder tokens, runs the HF processor on each
item alone (its placeholder expanded by the HF processor itself, so the count is the model's own), checks given
processor tensors and embeddings, and places the items: the expanded token ids and a `PromptMedia` whose spans the
engine fills with the items' rows. No torch model work: the encoder runs on the engine thread."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from transformers import PretrainedConfig

from lmrpc.server.media import decode
from lmrpc.server.media.types import Media, MediaError, Modality, MultimodalPrompt
from lmrpc.server.models.multimodal.base import EncoderInput, Placeholder, span_key
from lmrpc.server.models.types import MediaSpan, PromptMedia

if TYPE_CHECKING:
    from lmrpc.server.models.multimodal.base import MultimodalLM

# The HF processor's outputs that are the prompt's, not the item's
TEXT_OUTPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids"})


class MediaPromptProcessor:
    """Places a prompt's media for one model (thread-safe: the HF processor runs under a lock)."""

    def __init__(self, family: type[MultimodalLM], config: PretrainedConfig, hf_processor: Any, hidden: int) -> None:
        self._family = family
        self._config = config
        self._hf = hf_processor
        self._hidden = hidden  # the language model's width: an embedding item's rows must have it
        self._lock = threading.Lock()  # HF processors keep state (tokenizer truncation settings) while they run
        self._placeholders = {p.modality: p for p in family.placeholders(config, hf_processor)}
        self.modalities: frozenset[Modality] = frozenset(self._placeholders)
        self.placeholders: Mapping[Modality, str] = {m: p.text for m, p in self._placeholders.items()}
        self.sampling_rate: int = family.sampling_rate(hf_processor)
        self.min_audio_samples: int
        self.max_audio_seconds: float | None
        self.min_audio_samples, self.max_audio_seconds = family.audio_limits(hf_processor)

    def prepare(self, prompt: str | Sequence[int], media: Sequence[Media]) -> MultimodalPrompt:
        for given in media:
            if given.modality not in self._placeholders:
                raise MediaError(given.wire_field, f"this model takes no {given.modality.value}")
        if isinstance(prompt, str):
            with self._lock:
                ids = list(self._hf.tokenizer.encode(prompt))
        else:
            ids = list(prompt)
        out: list[int] = []
        spans: list[MediaSpan] = []
        items = iter(media)
        by_id = {p.token_id: p for p in self._placeholders.values()}
        i = 0
        while i < len(ids):
            holder = by_id.get(ids[i])
            if holder is None:
                out.append(ids[i])
                i += 1
                continue
            item = next(items, None)
            if item is None:
                raise MediaError(_list_field(media, holder.modality),
                                 f"the prompt has more {holder.token} placeholders than {holder.modality.value} items")
            if item.modality is not holder.modality:
                raise MediaError(item.wire_field,
                                 f"a {holder.token} placeholder stands here, not {item.modality.value}")
            span = self._place(item, holder, len(out))
            # A placeholder already expanded (a prompt tokenized by the HF processor) is taken as it is.
            run = _run_length(ids, i, holder.token_id)
            i += span.length if run >= span.length > 1 else 1
            out.extend([holder.token_id] * span.length)
            spans.append(span)
        extra = next(items, None)
        if extra is not None:
            raise MediaError(extra.wire_field, f"the prompt has no {self._token_of(extra)} placeholder left for it")
        return MultimodalPrompt(tuple(out), PromptMedia(tuple(spans)), sum(s.length for s in spans))

    def _token_of(self, item: Media) -> str:
        return self._placeholders[item.modality].token

    def _place(self, item: Media, holder: Placeholder, start: int) -> MediaSpan:
        if item.embedding is not None:
            return self._embedding_span(item, holder, start)
        if item.processor_output is not None:
            inputs: EncoderInput = {k: np.asarray(v) for k, v in item.processor_output.items()}
        else:
            inputs = self._run_processor(item, holder)
        try:
            count = self._family.count_positions(self._config, item.modality, inputs)
        except ValueError as e:
            raise MediaError(item.wire_field, str(e)) from None
        return MediaSpan(start, count, span_key(item, count, inputs), item.wire_field, encoder_input=inputs)

    def _run_processor(self, item: Media, holder: Placeholder) -> EncoderInput:
        """The HF processor on the placeholder alone with this one item: its tensors, checked against its own
        expansion of the placeholder."""
        data = item.image if item.modality is Modality.IMAGE else item.audio
        keyword = self._family.PROCESSOR_KEYWORD[item.modality]
        kwargs: dict[str, Any] = {"text": [holder.token], keyword: [data], "return_tensors": "np",
                                  **self._family.processor_kwargs(item)}
        if item.modality is Modality.AUDIO:
            if item.sampling_rate != self.sampling_rate:
                raise MediaError(item.wire_field, f"the clip is at {item.sampling_rate} Hz; this model takes "
                                                  f"{self.sampling_rate} Hz")
            kwargs["sampling_rate"] = self.sampling_rate
            assert item.audio is not None
            # Too short: the encoder gives it no position (an empty span); too long: the processor would cut it.
            decode.check_audio_length(len(item.audio), self.sampling_rate, item.wire_field,
                                      min_samples=self.min_audio_samples, model_max_seconds=self.max_audio_seconds)
        with self._lock:
            result = self._hf(**kwargs)
        inputs = {k: np.asarray(v) for k, v in result.items() if k not in TEXT_OUTPUTS}
        expanded = int((np.asarray(result["input_ids"]) == holder.token_id).sum())
        count = self._family.count_positions(self._config, item.modality, inputs)
        assert count == expanded, (count, expanded)  # the family's count is the HF processor's
        return inputs

    def _embedding_span(self, item: Media, holder: Placeholder, start: int) -> MediaSpan:
        rows = item.embedding
        assert rows is not None
        if rows.ndim != 2 or rows.shape[1] != self._hidden or rows.shape[0] < 1:
            raise MediaError(item.wire_field, f"an embedding must be [positions, {self._hidden}], not "
                                              f"{list(rows.shape)}")
        expected = self._family.fixed_positions(self._config, item.modality)
        if expected is not None and rows.shape[0] != expected:
            raise MediaError(item.wire_field, f"a {holder.token} fills {expected} positions; the embedding has "
                                              f"{rows.shape[0]} rows")
        if not np.isfinite(rows).all():
            raise MediaError(item.wire_field, "the embedding has non-finite values")
        data = np.ascontiguousarray(rows, dtype="<f4").tobytes()
        count = rows.shape[0]
        return MediaSpan(start, count, span_key(item, count, None), item.wire_field, rows=data)


def _run_length(ids: list[int], i: int, token_id: int) -> int:
    n = 0
    while i + n < len(ids) and ids[i + n] == token_id:
        n += 1
    return n


def _list_field(media: Sequence[Media], modality: Modality) -> str:
    """The wire field to name when items are missing: the last item's list, else the modality's list."""
    return media[-1].wire_field if media else f"{modality.value}_data"
