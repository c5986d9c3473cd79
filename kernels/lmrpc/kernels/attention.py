"""Attention backends (the AttentionBackend of paged.py) and the choice between them.

- `NativeAttention` (native_attention.py): CPUs where lmrpc's kernels build; route-invariant.
- `PagedTorchAttention` (here): the cache as [layers, 2, slots, kv_heads, head_dim], RoPE in torch, and a kernel
  with torch_reference's contract: torch_reference itself, or flashinfer's paged kernels on CUDA
  (flashinfer_attention.py), which read the flashinfer page layout build_metadata adds when asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lmrpc.kernels import native
from lmrpc.kernels.native_attention import PAGE_MULTIPLE, NativeAttention
from lmrpc.kernels.paged import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    ChunkSpec,
    QKNorm,
    Rope,
    build_metadata,
)
from lmrpc.kernels.torch_attention import apply_rope, rms_norm, torch_reference

logger = logging.getLogger(__name__)

# (q, k, v, k_cache, v_cache, meta, scale) -> [T, heads, head_dim]: torch_reference or FlashInferAttention
AttentionKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]


@dataclass(frozen=True)
class TorchPlan:
    """One step's metadata for PagedTorchAttention."""

    meta: AttentionMetadata  # slots, decode rows, prefill sequences (and flashinfer's layout on CUDA)
    cos: torch.Tensor  # [T, 1, head_dim] RoPE tables at each token's position
    sin: torch.Tensor  # [T, 1, head_dim] (signed)


class PagedTorchAttention:
    """RoPE and cache writes in torch, attention by `kernel` (see the module doc)."""

    def __init__(self, shape: AttentionShape, rope: Rope, dtype: torch.dtype, device: torch.device, num_pages: int,
                 page_size: int, kernel: AttentionKernel = torch_reference, paged_layout: bool = False) -> None:
        self.shape = shape
        self.rope = Rope(rope.cos.to(device), rope.sin.to(device), rope.sections)
        self.dtype = dtype
        self.device = device
        self.num_pages = num_pages
        self.page_size = page_size
        self.kernel = kernel
        self.paged_layout = paged_layout  # build flashinfer's page layout with each plan
        s = shape
        # [layers, k/v, slots, kv_heads, head_dim]; slot = page * page_size + offset
        self.cache = torch.zeros(s.layers, 2, num_pages * page_size, s.kv_heads, s.head_dim, dtype=dtype,
                                 device=device)

    def plan(self, chunks: Sequence[ChunkSpec], positions: torch.Tensor,
             rope_positions: torch.Tensor | None = None) -> TorchPlan:
        meta = build_metadata(
            [(c.start, c.num_tokens, torch.tensor(c.pages, dtype=torch.int64)) for c in chunks], self.page_size,
            self.device, paged_layout=self.paged_layout,
        )
        if rope_positions is not None:  # M-RoPE: each token's own rows
            rows = self.rope.rows(rope_positions.to(self.device))
            return TorchPlan(meta, rows.cos.unsqueeze(1), rows.sin.unsqueeze(1))
        positions = positions.to(self.device)
        return TorchPlan(meta, self.rope.cos[positions].unsqueeze(1), self.rope.sin[positions].unsqueeze(1))

    def __call__(self, layer: int, qkv: torch.Tensor, plan: TorchPlan, qk_norm: QKNorm | None) -> torch.Tensor:
        s = self.shape
        t = qkv.shape[0]
        qk, v = qkv.split([(s.heads + s.kv_heads) * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
        qk = qk.reshape(t, s.heads + s.kv_heads, s.head_dim)  # [T, heads + kv_heads, head_dim]
        if qk_norm is not None:
            qk = torch.cat([rms_norm(qk[:, : s.heads], qk_norm.q, s.qk_norm_eps),
                            rms_norm(qk[:, s.heads :], qk_norm.k, s.qk_norm_eps)], dim=1)
        qk = apply_rope(qk, plan.cos.to(qk.dtype), plan.sin.to(qk.dtype))  # q and k rotated together
        q, k = qk[:, : s.heads], qk[:, s.heads :]
        out = self.kernel(q, k, v.reshape(t, s.kv_heads, s.head_dim), self.cache[layer, 0], self.cache[layer, 1],
                          plan.meta, s.scale)  # [T, heads, head_dim]
        return out.reshape(t, s.heads * s.head_dim)

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        src, dst = src_page * self.page_size, dst_page * self.page_size
        self.cache[:, :, dst : dst + num_tokens] = self.cache[:, :, src : src + num_tokens]


_warned_no_flashinfer = False


def select_backend(shape: AttentionShape, rope: Rope, dtype: torch.dtype, device: torch.device, num_pages: int,
                   page_size: int) -> AttentionBackend:
    """The attention backend for this device.

    CPU: the native kernels where they build and the cache geometry suits them, else the torch reference (which is
    not route-invariant: a warning says so). CUDA: flashinfer's paged kernels when flashinfer imports and has kernels
    for the model's head size, else the torch reference with a warning.
    """
    global _warned_no_flashinfer
    if device.type == "cpu":
        reason = _native_unsuitable(dtype, page_size)
        if reason is None:
            return NativeAttention(shape, rope, dtype, num_pages, page_size)
        logger.warning("CPU attention runs on the torch reference (%s): outputs may then depend on batching", reason)
        return PagedTorchAttention(shape, rope, dtype, device, num_pages, page_size)
    if device.type != "cuda":
        return PagedTorchAttention(shape, rope, dtype, device, num_pages, page_size)
    try:
        import flashinfer  # noqa: F401  (probe only; FlashInferAttention imports it for use)
    except (ImportError, OSError) as e:  # OSError: installed but its CUDA libraries do not load
        if not _warned_no_flashinfer:
            _warned_no_flashinfer = True
            logger.warning("flashinfer is unavailable (%s): CUDA attention falls back to the slow torch reference", e)
        return PagedTorchAttention(shape, rope, dtype, device, num_pages, page_size)
    from lmrpc.kernels.flashinfer_attention import FLASHINFER_HEAD_DIMS, FlashInferAttention

    if shape.head_dim not in FLASHINFER_HEAD_DIMS:
        logger.warning("flashinfer has no kernels for head_dim %d (only %s): CUDA attention runs on the slow torch "
                       "reference, without CUDA graphs", shape.head_dim, ", ".join(map(str, FLASHINFER_HEAD_DIMS)))
        return PagedTorchAttention(shape, rope, dtype, device, num_pages, page_size)
    return PagedTorchAttention(shape, rope, dtype, device, num_pages, page_size, kernel=FlashInferAttention(device),
                               paged_layout=True)


def _native_unsuitable(dtype: torch.dtype, page_size: int) -> str | None:
    """Why the native kernels can't serve this cache, or None."""
    if page_size % PAGE_MULTIPLE:
        return f"page size {page_size} is not a multiple of {PAGE_MULTIPLE}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the native kernels store float32 or bfloat16, not {dtype}"
    try:
        native.load()
    except native.NativeKernelsUnavailable as e:
        return str(e)
    return None
