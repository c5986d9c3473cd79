"""CUDA graphs for decode steps: one graph per batch-size bucket, captured while the server warms up (before health
says SERVING) and replayed with each step's inputs copied into the graph's static buffers.

Only decode-only steps of at most the largest bucket take this path (prefill chunks have shapes that vary step to
step); a step of B decodes is padded to the smallest bucket >= B. Padding rows decode token 0 at position 0 into a
scratch page that the KV-cache manager never hands out, and their logits are dropped. Attention runs flashinfer's
decode kernel in its CUDA-graph mode: its page-table buffers are fixed tensors that plan() refills, outside the
graph, before each replay. Without flashinfer there are no graphs (torch's decode attention gathers a context whose
width changes every step).

On CUDA the products are cuBLAS's, whose kernels change with the row count, so padding to a bucket can change a
row's bits: CUDA makes no route-invariance promise (docs/architecture.md).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmrpc.kernels.attention import PagedTorchAttention, TorchPlan
from lmrpc.kernels.flashinfer_attention import FlashInferAttention
from lmrpc.kernels.paged import AttentionMetadata, ChunkSpec, PagedLayout
from lmrpc.server.models import CausalLM, ForwardContext

logger = logging.getLogger(__name__)


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes captured: powers of two up to 8, then steps of 8 to 32, of 16 beyond; max_batch included."""
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, max_batch + 1, 16)]
    return tuple(sorted({s for s in sizes if s <= max_batch} | {max_batch}))


@dataclass(frozen=True)
class DecodeRows:
    """A decode step's rows, padded to its bucket (host tensors, ready to copy into a graph's buffers)."""

    bucket: int  # graph batch size
    real: int  # leading rows that are real sequences
    ids: torch.Tensor  # [bucket] int64 token ids
    positions: torch.Tensor  # [bucket] int64
    slots: torch.Tensor  # [bucket] int64 cache slot of each row's new key/value
    paged: PagedLayout  # flashinfer's page table of the padded rows


def pad_decode_rows(ids: Sequence[int], chunks: Sequence[ChunkSpec], bucket: int, page_size: int,
                    scratch_page: int) -> DecodeRows:
    """Decode rows (one token each) padded to `bucket` with rows that write only to `scratch_page`."""
    assert all(c.num_tokens == 1 for c in chunks) and len(chunks) == len(ids) <= bucket
    pad = bucket - len(chunks)
    positions = [c.start for c in chunks] + [0] * pad
    tables = [list(c.pages[: c.start // page_size + 1]) for c in chunks] + [[scratch_page]] * pad
    slots = [t[p // page_size] * page_size + p % page_size for t, p in zip(tables, positions, strict=True)]
    lengths = [len(t) for t in tables]
    indptr = torch.zeros(bucket + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    paged = PagedLayout(
        page_size=page_size,
        qo_indptr=torch.arange(bucket + 1, dtype=torch.int32),
        kv_indptr=indptr,
        kv_indices=torch.tensor([p for t in tables for p in t], dtype=torch.int32),
        kv_last_page_len=torch.tensor([p % page_size + 1 for p in positions], dtype=torch.int32),
    )
    return DecodeRows(bucket, len(chunks), torch.tensor([*ids, *([0] * pad)], dtype=torch.int64),
                      torch.tensor(positions, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64), paged)


@dataclass
class _Graph:
    """One captured bucket: the graph and the static tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    slots: torch.Tensor  # [bucket] int64
    cos: torch.Tensor  # [bucket, 1, head_dim]
    sin: torch.Tensor  # [bucket, 1, head_dim]
    wrapper: Any  # flashinfer decode wrapper over static page-table buffers
    logits: torch.Tensor  # [bucket, vocab] float32 output


class CudaGraphRunner:
    """Captures and replays decode graphs for one model (see the module doc)."""

    def __init__(self, model: CausalLM, attention: PagedTorchAttention, buckets: tuple[int, ...],
                 scratch_page: int, max_pages_per_seq: int) -> None:
        if not isinstance(attention.kernel, FlashInferAttention):
            raise ValueError("CUDA graphs need flashinfer's decode kernel")
        self.model = model
        self.attention = attention
        self.kernel: FlashInferAttention = attention.kernel
        self.buckets = buckets
        self.scratch_page = scratch_page
        self.max_pages = max_pages_per_seq
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None  # one memory pool shared by every graph (captured largest first)

    def bucket_for(self, batch: int) -> int | None:
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[i] if i < len(self.buckets) else None

    @torch.inference_mode()
    def capture(self) -> None:
        for bucket in sorted(self.buckets, reverse=True):
            self._graphs[bucket] = self._capture(bucket)
        logger.info("captured CUDA graphs for decode batches of %s", ", ".join(map(str, self.buckets)))

    def _capture(self, bucket: int) -> _Graph:
        device = self.attention.device
        s = self.attention.shape
        rows = pad_decode_rows([], [], bucket, self.attention.page_size, self.scratch_page)
        g = _Graph(
            graph=torch.cuda.CUDAGraph(), ids=rows.ids.to(device), positions=rows.positions.to(device),
            slots=rows.slots.to(device),
            cos=torch.zeros(bucket, 1, s.head_dim, device=device),
            sin=torch.zeros(bucket, 1, s.head_dim, device=device),
            wrapper=self.kernel.graph_decode_wrapper(bucket, self.max_pages, s.heads // s.kv_heads),
            logits=torch.empty(0, device=device),
        )
        self._load(g, rows)
        ctx = self._context(g, rows.paged)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up launches (cuBLAS handles, allocator) off the capture
            for _ in range(2):
                self.model.compute_logits(self.model.forward(g.ids, ctx))
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(g.graph, pool=self._pool):
            g.logits = self.model.compute_logits(self.model.forward(g.ids, ctx))  # [bucket, vocab]
        self._pool = g.graph.pool()
        return g

    def _context(self, g: _Graph, paged: PagedLayout) -> ForwardContext:
        meta = AttentionMetadata(slot_mapping=g.slots, num_decodes=g.ids.shape[0], decode_slots=None,
                                 decode_mask=None, decode_lengths=(), prefills=(), paged=paged, planned=g.wrapper)
        return ForwardContext(self.attention, TorchPlan(meta, g.cos, g.sin))

    def _load(self, g: _Graph, rows: DecodeRows) -> None:
        """Copy a step's rows into the graph's buffers and plan its decode wrapper (outside the graph)."""
        g.ids.copy_(rows.ids, non_blocking=True)
        g.positions.copy_(rows.positions, non_blocking=True)
        g.slots.copy_(rows.slots, non_blocking=True)
        rope = self.attention.rope
        torch.index_select(rope.cos, 0, g.positions, out=g.cos.view(rows.bucket, -1))
        torch.index_select(rope.sin, 0, g.positions, out=g.sin.view(rows.bucket, -1))
        s = self.attention.shape
        self.kernel.plan_decode(g.wrapper, rows.paged, s.heads, s.kv_heads, s.head_dim, s.scale,
                                self.attention.dtype)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], chunks: Sequence[ChunkSpec]) -> torch.Tensor:
        """Logits [len(ids), vocab] float32 of a decode-only step that fits a bucket."""
        bucket = self.bucket_for(len(ids))
        assert bucket is not None, "the caller checks that the step fits a bucket"
        g = self._graphs[bucket]
        self._load(g, pad_decode_rows(ids, chunks, bucket, self.attention.page_size, self.scratch_page))
        g.graph.replay()
        return g.logits[: len(ids)]
