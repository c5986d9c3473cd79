"""Runs a ScheduledBatch through the model: builds the flat input tensors and attention metadata, runs the
forward pass over the paged KV cache, and returns the logits the sampler and prompt logprobs need."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmrpc.kernels.attention import build_metadata, select_backend
from lmrpc.server.config import CacheConfig, SchedulerConfig
from lmrpc.server.engine.sequence import ScheduledBatch, ScheduledChunk, Sequence
from lmrpc.server.models.loader import LoadedModel

MAX_AUTO_PAGES_TOKENS = 1 << 18  # cap of an automatically sized pool, in tokens


@dataclass(frozen=True)
class PromptLogits:
    """Logits of one chunk's positions that predict prompt tokens asked for as prompt logprobs."""

    seq: Sequence  # whose prompt
    first_position: int  # position of row 0
    logits: torch.Tensor  # [k, vocab] float32: row j predicts the prompt token at first_position + j + 1


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [num_sampling_chunks, vocab] float32, one row per chunk with `samples`, batch order
    prompt_logits: tuple[PromptLogits, ...]  # for chunks of sequences asking for prompt logprobs


def _host_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


class ModelRunner:
    def __init__(self, loaded: LoadedModel, cache: CacheConfig, scheduler: SchedulerConfig) -> None:
        self.model = loaded.model
        first = next(iter(loaded.model.parameters()))  # type: ignore[call-overload]
        self.device: torch.device = first.device
        self.dtype: torch.dtype = self.model.kv_dtype
        self.vocab_size = loaded.info.vocab_size
        self.page_size = cache.page_size
        # The backend first: on CUDA it allocates its workspace, which the pool sizing below must see as used.
        self.attention = select_backend(self.device)
        layers, kv_heads, head_dim = self.model.kv_shape
        bytes_per_token = layers * 2 * kv_heads * head_dim * self.dtype.itemsize
        if cache.num_tokens is not None:
            tokens = cache.num_tokens
        else:
            free = (torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda"
                    else _host_available_bytes())
            tokens = min(int(free * cache.memory_fraction) // bytes_per_token, MAX_AUTO_PAGES_TOKENS)
        self.num_pages = max(1, tokens // self.page_size)
        # [layers, k/v, slots, kv_heads, head_dim]; slot = page * page_size + offset
        self.kv_cache = torch.zeros(layers, 2, self.num_pages * self.page_size, kv_heads, head_dim,
                                    dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> ForwardOutput:
        self._copy_pages(batch)
        ids: list[int] = []
        positions: list[int] = []
        for c in batch.chunks:
            ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            positions.extend(range(c.start, c.start + c.num_tokens))
        meta = build_metadata(
            [(c.start, c.num_tokens, torch.tensor(c.seq.page_table, dtype=torch.int64)) for c in batch.chunks],
            self.page_size, self.device, paged_layout=self.device.type == "cuda",  # flashinfer's page layout
        )
        hidden = self.model(
            torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), meta,
            self.kv_cache, self.attention,
        )  # [T, hidden]
        rows, prompt_spans = self._rows(batch)
        logits = self.model.compute_logits(hidden[rows])  # [len(rows), vocab]
        sampling = logits[: sum(c.samples for c in batch.chunks)]
        prompt = tuple(
            PromptLogits(seq, first, logits[offset : offset + n]) for seq, first, offset, n in prompt_spans
        )
        return ForwardOutput(sampling, prompt)

    def _copy_pages(self, batch: ScheduledBatch) -> None:
        """Partial prefix-cache hits: copy the matched head of a cached page into the sequence's own page."""
        p = self.page_size
        for c in batch.copies:
            # [layers, k/v, num_tokens, kv_heads, head_dim]
            src, dst = c.src * p, c.dst * p
            self.kv_cache[:, :, dst : dst + c.num_tokens] = self.kv_cache[:, :, src : src + c.num_tokens]

    def _rows(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[tuple[Sequence, int, int, int]]]:
        """Hidden rows to project: the last row of each sampling chunk, then prompt-logprob rows."""
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        spans: list[tuple[ScheduledChunk, int, int]] = []  # (chunk, first position, count)
        row = 0
        for c in batch.chunks:
            if c.samples:
                sample_rows.append(row + c.num_tokens - 1)
            first, count = _prompt_logprob_span(c)
            if count:
                spans.append((c, first, count))
                prompt_rows.extend(range(row + first - c.start, row + first - c.start + count))
            row += c.num_tokens
        offset = len(sample_rows)
        out: list[tuple[Sequence, int, int, int]] = []
        for c, first, count in spans:
            out.append((c.seq, first, offset, count))
            offset += count
        return torch.tensor(sample_rows + prompt_rows, dtype=torch.int64, device=self.device), out


def _prompt_logprob_span(c: ScheduledChunk) -> tuple[int, int]:
    """(first position, count) of this chunk's positions whose logits predict requested prompt tokens."""
    options = c.seq.request.logprobs
    if options is None or options.start_len < 0:
        return 0, 0
    lo = max(max(options.start_len, 1) - 1, c.start)
    hi = min(c.seq.num_prompt_tokens - 1, c.start + c.num_tokens)
    return lo, max(0, hi - lo)
