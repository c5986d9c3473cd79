"""Paged attention over a flat batch of tokens from many sequences (prefill chunks and decodes together).

The KV cache of one layer is two tensors [num_slots, kv_heads, head_dim] (num_slots = num_pages * page_size):
slot `page * page_size + offset` holds position `offset` of that page. `AttentionMetadata` is built once per
step by the runner and shared by every layer.

Backends: `torch_reference` (CPU, and the reference every other backend is tested against) and, on CUDA,
`FlashInferAttention` (flashinfer_attention.py), which reads the flashinfer page-table layout (`PagedLayout`) that
build_metadata adds when asked. select_backend picks one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


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


AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]


def torch_reference(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, heads, head_dim]
    # The cache may be stored in a narrower dtype than q/k/v are computed in (half-precision cache with float32
    # activations on CPU): write rounded, read back up-cast. Every query reads K/V from the cache, never the fresh
    # k/v, so a prompt sees the same values however it was chunked.
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    d = meta.num_decodes
    if d and not meta.prefills:
        return _decode_attention(q, k_cache, v_cache, meta, scale)  # the common all-decode step: no copy
    out = torch.empty_like(q)
    if d:
        out[:d] = _decode_attention(q[:d], k_cache, v_cache, meta, scale)
    for p in meta.prefills:
        qp = q[p.start : p.start + p.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        kp = _gather(k_cache, p.slots, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, context, head_dim]
        vp = _gather(v_cache, p.slots, q.dtype).transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
        )
        out[p.start : p.start + p.num_tokens] = op[0].transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [num_slots, kv_heads, head_dim], slots [n] -> [n, kv_heads, head_dim] in dtype (up-cast if stored
    narrower)."""
    return cache.index_select(0, slots).to(dtype)


def _decode_attention(
    q: torch.Tensor,  # [d, heads, head_dim]: one query per decoding sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [d, heads, head_dim]
    assert meta.decode_slots is not None
    d, width = meta.decode_slots.shape
    flat = meta.decode_slots.view(-1)
    # index_select, not k_cache[slots]: the same rows, about 6x faster on CPU for a [32, 256] slot table
    kd = _gather(k_cache, flat, q.dtype).view(d, width, *k_cache.shape[1:]).transpose(1, 2)  # [d, kv, ctx, hd]
    vd = _gather(v_cache, flat, q.dtype).view(d, width, *v_cache.shape[1:]).transpose(1, 2)
    od = F.scaled_dot_product_attention(
        q.unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
    )  # [d, heads, 1, head_dim]
    return od.squeeze(2)


_warned_no_flashinfer = False


def select_backend(device: torch.device) -> AttentionFn:
    """The attention implementation for this device.

    CUDA: flashinfer's paged kernels when flashinfer imports (the runner must then build the metadata with
    paged_layout=True), else the torch reference with a warning. Elsewhere: the torch reference.
    """
    global _warned_no_flashinfer
    if device.type != "cuda":
        return torch_reference
    try:
        import flashinfer  # noqa: F401  (probe only; FlashInferAttention imports it for use)
    except (ImportError, OSError) as e:  # OSError: installed but its CUDA libraries do not load
        if not _warned_no_flashinfer:
            _warned_no_flashinfer = True
            logger.warning("flashinfer is unavailable (%s): CUDA attention falls back to the slow torch reference", e)
        return torch_reference
    # Imported here: flashinfer_attention imports this module.
    from lmrpc.kernels.flashinfer_attention import FlashInferAttention

    return FlashInferAttention(device)
