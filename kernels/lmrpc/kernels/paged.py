"""What every attention backend shares: a step's chunks, the layer shapes and RoPE tables, the backend interface, and
the torch/flashinfer metadata of a step (`AttentionMetadata`, built by `build_metadata`).

A backend owns the KV cache of every layer in its own layout and runs a layer's attention: per-head q/k norms
(Qwen3), RoPE, the cache write of the new keys and values, and causal attention over each sequence's pages. The
engine's executor plans a step once (`plan`), then calls the backend once per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class ChunkSpec:
    """The tokens of one sequence computed in a step: positions [start, start + num_tokens)."""

    start: int  # first position computed (the tokens before it are in the cache)
    num_tokens: int  # >= 1
    pages: Sequence[int]  # the sequence's page table; covers positions 0 .. start + num_tokens - 1


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention geometry."""

    layers: int  # decoder layers (one cache each)
    heads: int  # query heads
    kv_heads: int  # key/value heads (heads is a multiple)
    head_dim: int  # per-head width
    scale: float  # softmax scale (usually head_dim ** -0.5)
    qk_norm_eps: float = 1e-6  # epsilon of per-head q/k RMSNorms, for models that have them

    def __post_init__(self) -> None:
        assert self.heads % self.kv_heads == 0, "query heads must be a multiple of kv heads"

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


@dataclass(frozen=True)
class Rope:
    """Rotary tables: position p rotates x into x * cos[p] + rotate_half(x) * sin[p] (sin stored signed).

    M-RoPE (Qwen2-VL): a token has three positions (temporal, height, width), and the rotary frequencies are split
    into `sections` (frequency pairs per part, in order; part i reads component i % 3, as in the first half so in the
    second). A token's row then takes each column from the table row of its component's position (`rows`): only
    copies of table values, so its bits depend on its three positions alone, whatever the step's route. A token with
    three equal positions p gets exactly row p: 1-D positions are the special case."""

    cos: torch.Tensor  # [max_positions, head_dim] float32
    sin: torch.Tensor  # [max_positions, head_dim] float32, first half negated (rotate_half folded in)
    sections: tuple[int, ...] = ()  # M-RoPE's frequency pairs per part (sum head_dim / 2); () for 1-D RoPE

    def __post_init__(self) -> None:
        assert not self.sections or 2 * sum(self.sections) == self.cos.shape[-1], "M-RoPE sections: head_dim / 2"

    def rows(self, positions: torch.Tensor) -> Rope:
        """positions [3, T] int64 (temporal, height, width) -> the tokens' own tables: cos, sin [T, head_dim]
        float32, row t for token t (already gathered, so no sections)."""
        assert self.sections, "3-component positions need an M-RoPE table"
        component = torch.tensor([i % 3 for i, n in enumerate(self.sections) for _ in range(n)] * 2,
                                 device=positions.device)  # [head_dim]: which position each column reads
        index = positions.index_select(0, component).T  # [T, head_dim]: the table row of each column
        cols = torch.arange(self.cos.shape[-1], device=positions.device)  # [head_dim]
        return Rope(self.cos[index, cols].contiguous(), self.sin[index, cols].contiguous())


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorm weights applied to q and k before RoPE (Qwen3)."""

    q: torch.Tensor  # [head_dim] float32
    k: torch.Tensor  # [head_dim] float32


class AttentionBackend(Protocol):
    """Owns every layer's KV cache; runs one layer's attention for a planned step."""

    num_pages: int  # pages in the pool
    page_size: int  # positions per page
    dtype: torch.dtype  # what the cache stores

    def plan(self, chunks: Sequence[ChunkSpec], positions: torch.Tensor,
             rope_positions: torch.Tensor | None = None) -> Any:
        """Per-step metadata from the step's chunks (decodes first) and the flat positions [T] int64 (the cache's).
        rope_positions [3, T] int64: the M-RoPE positions tokens rotate by (models whose Rope has sections, when a
        request in the step has them); None: each token rotates by its position."""
        ...

    def __call__(self, layer: int, qkv: torch.Tensor, plan: Any, qk_norm: QKNorm | None) -> torch.Tensor:
        """qkv [T, (heads + 2 kv_heads) * head_dim] float32 -> attention output [T, heads * head_dim]."""
        ...

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        """Copy the first num_tokens positions of page src into page dst, in every layer."""
        ...


# ---- the torch and flashinfer backends' metadata ------------------------------------------------------------


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence that computes more than one token this step."""

    start: int  # first row of its tokens in the flat batch
    num_tokens: int  # its new tokens (queries)
    slots: torch.Tensor  # [context] int64: cache slots of positions 0..context-1 (context includes the new tokens)
    mask: torch.Tensor | None  # [num_tokens, context] bool causal mask offset by the cached prefix; None if none


@dataclass(frozen=True)
class PagedLayout:
    """The step's sequences in flashinfer's page-table layout (CSR over pages), every sequence in batch order.

    The tensors stay on the host: flashinfer's plan() needs the indptrs and last-page lengths there (it would copy
    device tensors back, a sync) and uploads what its kernels read itself, once per step.
    """

    page_size: int  # positions per page (the cache views as [num_slots // page_size, page_size, kv_heads, head_dim])
    qo_indptr: torch.Tensor  # [num_seqs + 1] int32: sequence i's queries are flat rows qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [num_seqs + 1] int32: sequence i's pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32: page ids covering positions 0..context-1, in position order
    kv_last_page_len: torch.Tensor  # [num_seqs] int32 in 1..page_size: positions used in each sequence's last page


@dataclass(frozen=True)
class AttentionMetadata:
    """How the flat batch maps onto sequences and cache slots (decodes first, then prefills)."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decodes: int  # rows 0..num_decodes-1 are single-token decodes
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] int64 cache slots (padding points at slot 0)
    # [num_decodes, 1, 1, max_context] bool: True where a real position; None when no row is padded (one decode,
    # or equal contexts), which spares attention applying a mask
    decode_mask: torch.Tensor | None
    decode_lengths: tuple[int, ...]  # context length of each decode row, its new token included
    prefills: tuple[PrefillSeq, ...]  # the other sequences
    paged: PagedLayout | None = None  # flashinfer's layout of the same step; only built when asked (CUDA)
    # a flashinfer decode wrapper already planned for this step over static buffers (CUDA graph replays): used as is
    planned: Any = None


def build_metadata(
    chunks: list[tuple[int, int, torch.Tensor]], page_size: int, device: torch.device, paged_layout: bool = False
) -> AttentionMetadata:
    """chunks: (start position, num new tokens, page table [pages] int64) per sequence, decodes first.

    paged_layout: also build `PagedLayout` (for FlashInferAttention); the torch reference does not read it.
    """
    offsets = torch.arange(page_size, dtype=torch.int64)
    slot_lists: list[torch.Tensor] = []
    all_slots: list[torch.Tensor] = []
    for start, n, pages in chunks:
        slots = (pages[:, None] * page_size + offsets).reshape(-1)[: start + n]  # [context]
        all_slots.append(slots)
        slot_lists.append(slots[start:])
    slot_mapping = torch.cat(slot_lists).to(device)
    num_decodes = 0
    while num_decodes < len(chunks) and chunks[num_decodes][1] == 1:
        num_decodes += 1
    decode_slots = decode_mask = None
    decode_lengths = tuple(chunks[i][0] + 1 for i in range(num_decodes))
    if num_decodes:
        width = max(decode_lengths)
        decode_slots = torch.zeros(num_decodes, width, dtype=torch.int64)
        for i, length in enumerate(decode_lengths):
            decode_slots[i, :length] = all_slots[i]
        decode_slots = decode_slots.to(device)
        if min(decode_lengths) < width:
            lengths = torch.tensor(decode_lengths)
            decode_mask = (torch.arange(width)[None, :] < lengths[:, None]).view(num_decodes, 1, 1, width).to(device)
    prefills = []
    row = num_decodes
    for (start, n, _), slots in zip(chunks[num_decodes:], all_slots[num_decodes:], strict=True):
        mask = None
        if start > 0:  # query i sits at position start + i and sees keys 0..start+i
            mask = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
            mask = mask.to(device)
        prefills.append(PrefillSeq(row, n, slots.to(device), mask))
        row += n
    paged = _paged_layout(chunks, page_size) if paged_layout else None
    return AttentionMetadata(slot_mapping, num_decodes, decode_slots, decode_mask, decode_lengths, tuple(prefills),
                             paged)


def _paged_layout(chunks: list[tuple[int, int, torch.Tensor]], page_size: int) -> PagedLayout:
    qo_lens = [n for _, n, _ in chunks]
    contexts = [start + n for start, n, _ in chunks]  # kv length of each sequence, its new tokens included
    num_pages = [-(-c // page_size) for c in contexts]  # ceil: a page table may hold more pages than are used yet
    kv_indices = torch.cat([pages[:p] for (_, _, pages), p in zip(chunks, num_pages, strict=True)])
    return PagedLayout(
        page_size=page_size,
        qo_indptr=_indptr(qo_lens),
        kv_indptr=_indptr(num_pages),
        kv_indices=kv_indices.to(torch.int32),
        kv_last_page_len=torch.tensor(
            [c - (p - 1) * page_size for c, p in zip(contexts, num_pages, strict=True)], dtype=torch.int32
        ),
    )


def _indptr(lengths: list[int]) -> torch.Tensor:
    """[len(lengths) + 1] int32 exclusive prefix sums: 0, l0, l0 + l1, ..."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out
