"""Image and audio rows in a step's first-layer input (EngineRequest.prompt_media).

The executor asks here which chunk positions lie in media spans and writes the items' rows over the embedding
lookup's rows there. A span's rows are the request's own (Media.embedding, as given) or the model's encoder output,
computed on the engine thread the first time a chunk reaches a position of the span that is not in the KV cache (a
prefix-cache hit over the whole span never runs the encoder), one item per encoder call (so an item's bits never
depend on what else is in the step), and kept on the sequence (`Sequence.media_rows`) until it finishes or is
preempted."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from lmrpc.server.engine.sequence import ScheduledBatch, ScheduledChunk, Sequence
from lmrpc.server.engine.types import EngineRequest
from lmrpc.server.models.types import MediaSpan, ModelInfo


class MediaEncoder(Protocol):
    """What a multimodal model offers the executor (models.multimodal.base.MultimodalLM)."""

    def encode_media(self, span: MediaSpan) -> torch.Tensor: ...  # one item -> its rows [span.length, hidden] float32


def refusal(request: EngineRequest, model: object, info: ModelInfo) -> str | None:
    """Why the engine cannot run this request's media (an in-process caller's, not the model's processor's): no
    encoder for its items, rows of another width, or a span past the prompt; None when it can (or has none)."""
    media = request.prompt_media
    if media is None:
        return None
    if not info.accepts_embeddings or any(
            (s.encoder_input is not None and not hasattr(model, "encode_media"))
            or (s.rows is not None and len(s.rows) != s.length * info.hidden_size * 4)
            or s.end > len(request.prompt_ids) for s in media.spans):
        return "this model takes no such images or audio (no encoder, or rows of another width)"
    return None


def chunk_has_media(c: ScheduledChunk) -> bool:
    """Whether the chunk computes positions of an image or audio clip."""
    media = c.seq.request.prompt_media
    return media is not None and bool(media.overlapping(c.start, c.start + c.num_tokens))


def write_rows(encoder: MediaEncoder, batch: ScheduledBatch, x: torch.Tensor) -> None:
    """x [T, hidden] float32 (the step's flat first-layer rows, chunk after chunk): the rows at media positions
    replaced by their items' rows, in place."""
    row = 0
    for c in batch.chunks:
        media = c.seq.request.prompt_media
        if media is not None:
            end = c.start + c.num_tokens
            for index, span in media.overlapping(c.start, end):
                lo, hi = max(c.start, span.start), min(end, span.end)
                rows = span_rows(encoder, c.seq, index, span, x.shape[1], x.device)  # [span.length, hidden]
                x[row + lo - c.start : row + hi - c.start] = rows[lo - span.start : hi - span.start]
        row += c.num_tokens


def span_rows(encoder: MediaEncoder, seq: Sequence, index: int, span: MediaSpan, hidden: int,
              device: torch.device) -> torch.Tensor:
    """The rows [span.length, hidden] float32 of span `index` of seq's prompt: computed once, then kept."""
    rows = seq.media_rows.get(index)
    if rows is None:
        if span.rows is not None:
            given = np.frombuffer(span.rows, dtype="<f4")
            rows = torch.from_numpy(given.reshape(span.length, hidden).copy()).to(device)
        else:
            rows = encoder.encode_media(span).to(device=device, dtype=torch.float32)
        # The model's processor checked the counts when it placed the item; a mismatch here is a model bug.
        assert tuple(rows.shape) == (span.length, hidden), (span.wire_field, tuple(rows.shape), span.length)
        seq.media_rows[index] = rows
    assert isinstance(rows, torch.Tensor)
    return rows
