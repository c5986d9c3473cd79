"""The CPU attention backend over lmrpc's native kernels (csrc/attention.cpp): RoPE fused with the cache write, and
paged attention that computes each query alone, in one fixed order, so a token's output never depends on the
chunk, the batch or the thread that computed it.

Cache layout per layer (page size P, a multiple of 16): keys [pages, kv_heads, head_dim, P] (transposed within a
page, so 16 keys' scores are one vector product), values [pages, kv_heads, P, head_dim].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmrpc.kernels import hugepages, native
from lmrpc.kernels.paged import AttentionShape, ChunkSpec, QKNorm, Rope

PAGE_MULTIPLE = 16  # the kernels read keys 16 at a time


@dataclass(frozen=True)
class NativePlan:
    """One step's metadata for the native kernels."""

    positions: torch.Tensor  # [T] int64 position of each token
    # [T] int64 row of the rope tables each token rotates by: its position, or its own row of `rope` (M-RoPE)
    rope_index: torch.Tensor
    rope: Rope | None  # M-RoPE steps: per-token rows cos/sin [T, head_dim]; None: the backend's tables
    slots: torch.Tensor  # [T] int64 page * page_size + offset where each token's key and value go
    block_table: torch.Tensor  # [sequences, width] int32 page ids (rows padded with page 0)
    token_seq: torch.Tensor  # [T] int32 row of block_table of each token
    token_ctx: torch.Tensor  # [T] int32 keys each token sees (its position + 1)


class NativeAttention:
    """The AttentionBackend of CPUs with the native kernels (see the module doc)."""

    def __init__(self, shape: AttentionShape, rope: Rope, dtype: torch.dtype, num_pages: int, page_size: int) -> None:
        if page_size % PAGE_MULTIPLE:
            raise ValueError(f"the native attention kernels need a page size that is a multiple of {PAGE_MULTIPLE}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the native attention kernels store float32 or bfloat16, not {dtype}")
        self._ops = native.load()
        self.shape = shape
        self.rope = rope
        self.dtype = dtype
        self.num_pages = num_pages
        self.page_size = page_size
        s = shape
        # In huge pages (hugepages.py): a step reads every running sequence's keys and values from DRAM.
        self.keys = hugepages.zeros((s.layers, num_pages, s.kv_heads, s.head_dim, page_size), dtype)
        self.values = hugepages.zeros((s.layers, num_pages, s.kv_heads, page_size, s.head_dim), dtype)

    def plan(self, chunks: Sequence[ChunkSpec], positions: torch.Tensor,
             rope_positions: torch.Tensor | None = None) -> NativePlan:
        # Python lists, one tensor each: a step runs this between two forwards that have evicted the caches, where
        # every torch call costs tens of microseconds (a quarter of a one-stream decode step's Python).
        p = self.page_size
        width = max(len(c.pages) for c in chunks)
        table = [[*c.pages, *[0] * (width - len(c.pages))] for c in chunks]  # rows padded with page 0
        slots = [c.pages[q // p] * p + q % p for c in chunks for q in range(c.start, c.start + c.num_tokens)]
        token_seq = [i for i, c in enumerate(chunks) for _ in range(c.num_tokens)]
        token_ctx = [q + 1 for c in chunks for q in range(c.start, c.start + c.num_tokens)]  # each token's position + 1
        # M-RoPE: each token's rows gathered once per step (every layer reads them), indexed by token
        rope = None if rope_positions is None else self.rope.rows(rope_positions)
        return NativePlan(
            positions=positions,
            rope_index=positions if rope is None else torch.arange(len(positions), dtype=torch.int64),
            rope=rope,
            slots=torch.tensor(slots, dtype=torch.int64),
            block_table=torch.tensor(table, dtype=torch.int32),
            token_seq=torch.tensor(token_seq, dtype=torch.int32),
            token_ctx=torch.tensor(token_ctx, dtype=torch.int32),
        )

    def __call__(self, layer: int, qkv: torch.Tensor, plan: NativePlan, qk_norm: QKNorm | None) -> torch.Tensor:
        s = self.shape
        t = qkv.shape[0]
        q = torch.empty(t, s.heads, s.head_dim)  # [T, heads, head_dim] rotated queries
        keys, values = self.keys[layer], self.values[layer]
        rope = plan.rope or self.rope
        self._ops.rope_store(qkv, s.heads, plan.rope_index, rope.cos, rope.sin,
                             None if qk_norm is None else qk_norm.q, None if qk_norm is None else qk_norm.k,
                             s.qk_norm_eps, plan.slots, keys, values, q)
        out = torch.empty(t, s.heads * s.head_dim)  # [T, heads * head_dim]
        self._ops.paged_attention(q, keys, values, plan.block_table, plan.token_seq, plan.token_ctx, s.scale, out)
        return out

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        self.keys[:, dst_page, :, :, :num_tokens] = self.keys[:, src_page, :, :, :num_tokens]
        self.values[:, dst_page, :, :num_tokens] = self.values[:, src_page, :, :num_tokens]
