"""Paged attention in plain torch: the reference every other backend is tested against, and the route where no
native kernel serves (CUDA without flashinfer, a CPU build without a C++ compiler, unusual page sizes).

The cache of one layer is two tensors [num_slots, kv_heads, head_dim] (num_slots = num_pages * page_size): slot
`page * page_size + offset` holds position `offset` of that page.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmrpc.kernels.paged import AttentionMetadata


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim], sin signed (its first half negated).

    rotate_half(x) * sin == roll(x, half) * signed sin: the same products in three ops instead of six."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension [..., width] (the torch route's RMSNorm)."""
    # Spelled out: on CPU, F.rms_norm of one 576-wide row costs ~25 us, these few ops ~10 us. sum * (1 / n), not
    # mean: mean is a sum and a division, one more op.
    inv_rms = x.square().sum(-1, keepdim=True).mul_(1.0 / x.shape[-1]).add_(eps).rsqrt_()
    return x * inv_rms * weight


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
