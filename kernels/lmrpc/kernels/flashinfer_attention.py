"""Paged attention on CUDA with flashinfer's batch kernels: the same contract as `torch_attention.torch_reference`.

One engine step = one `AttentionMetadata`, shared by every layer. The first layer call that sees a new metadata
object plans the step (flashinfer's plan(): host-side scheduling plus uploading the page table); every layer then
only runs the kernel. A step with prefills goes through `BatchPrefillWithPagedKVCacheWrapper` (ragged queries via
qo_indptr, so decodes and prefill chunks are one launch); an all-decode step, the common one, through
`BatchDecodeWithPagedKVCacheWrapper`.

API followed: flashinfer 0.2+ (plan/run wrappers), checked against the 0.7.0rc3 sources:
  BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD")
    .plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
          head_dim_qk, page_size, *, causal, sm_scale, q_data_type, kv_data_type)
    .run(q, (k_cache, v_cache)) with k_cache, v_cache [num_pages, page_size, kv_heads, head_dim] (NHD)
  BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD", use_tensor_cores=...)
    .plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
          q_data_type, kv_data_type, sm_scale)  (optional arguments by keyword: positional ones are deprecated)
    .run(q, (k_cache, v_cache))
The first 7/8 plan arguments are passed positionally because their names changed across versions (head_dim ->
head_dim_qk). With causal=True flashinfer masks key j for query i of a sequence iff j > kv_len - qo_len + i
(bottom-right aligned, prefill.cuh), which is exactly "query i sits at position start + i" for a chunk after a
cached prefix, and "sees everything" for a decode.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from lmrpc.kernels.paged import AttentionMetadata, PagedLayout
from lmrpc.kernels.torch_attention import torch_reference

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20  # flashinfer's float workspace (split-kv partial outputs); its documented default size
FLASHINFER_KV_DTYPES = (torch.float16, torch.bfloat16)  # the cache dtypes these kernels take (not float32)
# The head sizes flashinfer's paged prefill and decode kernels are built for (DISPATCH_HEAD_DIM; 512 only in some
# kernels): any other fails inside plan() or run() ("Unsupported head_dim: 16"), so such a model keeps the torch path.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
# The decode kernel on tensor cores folds the GQA group into the query tile; worth it from a group of 4 (what
# sglang and vLLM use), below that the CUDA-core decode kernel is faster.
TENSOR_CORE_DECODE_MIN_GROUP = 4


class FlashInferAttention:
    """Callable like `torch_reference`: (q, k, v, k_cache, v_cache, meta, scale) -> [T, heads, head_dim].

    meta must come from build_metadata(..., paged_layout=True); without it (or with a float32 cache, which
    flashinfer does not take) a call falls back to the torch reference, with a warning once.
    """

    def __init__(self, device: torch.device, workspace: torch.Tensor | None = None) -> None:
        # Imported here, not at module level: the module must import (and type-check) where flashinfer is absent.
        self._fi: Any = importlib.import_module("flashinfer")
        self.device = device
        self.workspace = (
            workspace if workspace is not None else torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        )
        # Both wrappers share the float workspace: a step plans and runs only one of them, in stream order.
        self._prefill: Any = self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._decode: Any = None  # built at the first all-decode step (use_tensor_cores depends on the GQA group)
        self._decode_tensor_cores = False
        self._planned: AttentionMetadata | None = None  # held, so its id cannot be reused by a later step's meta
        self._plan_key: tuple[int, int, int, float, torch.dtype] | None = None  # heads, kv_heads, head_dim, ...
        self._wrapper: Any = None  # the planned wrapper (prefill or decode)
        self._warned: set[str] = set()

    def __call__(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        paged = meta.paged
        if paged is None:
            self._warn_once("no-layout", "attention metadata has no paged layout (build_metadata(paged_layout="
                            "True) is needed for flashinfer): using the torch reference")
            return torch_reference(q, k, v, k_cache, v_cache, meta, scale)
        if k_cache.dtype not in FLASHINFER_KV_DTYPES:
            self._warn_once("dtype", f"flashinfer takes no {k_cache.dtype} KV cache: using the torch reference")
            return torch_reference(q, k, v, k_cache, v_cache, meta, scale)
        # New K/V first (rounded to the cache dtype, as the reference does): queries read their own keys from the
        # cache. A flat index_copy_ is one kernel and needs no extra layout arrays.
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[1]
        # flashinfer computes in the cache dtype (q and kv dtypes must match for fp16/bf16 kernels); a wider q is
        # rounded down and the output cast back, like the reference reading the cache up-cast.
        qc = q.to(k_cache.dtype).contiguous()  # [T, heads, head_dim]; q is a view into the fused qk projection
        key = (heads, kv_heads, head_dim, scale, k_cache.dtype)
        wrapper = meta.planned  # a CUDA graph replay: planned outside the graph, over its static buffers
        if wrapper is None:
            if meta is not self._planned or key != self._plan_key:
                self._plan(meta, paged, key)
            wrapper = self._wrapper
        pages_shape = (-1, paged.page_size, kv_heads, head_dim)
        out = wrapper.run(qc, (k_cache.view(pages_shape), v_cache.view(pages_shape)))  # [T, heads, head_dim]
        return out.to(q.dtype)

    def graph_decode_wrapper(self, batch: int, max_pages: int, group: int) -> Any:
        """A decode wrapper for CUDA graphs: its page-table buffers are fixed tensors sized for `batch` sequences
        of up to `max_pages` pages (flashinfer's use_cuda_graph mode; plan() refills them before each replay)."""
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=group >= TENSOR_CORE_DECODE_MIN_GROUP,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(batch * max_pages, dtype=torch.int32, device=self.device),
            paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=self.device),
        )

    @staticmethod
    def plan_decode(wrapper: Any, paged: PagedLayout, heads: int, kv_heads: int, head_dim: int, scale: float,
                    dtype: torch.dtype) -> None:
        """Plan one step of a graph decode wrapper (outside the graph)."""
        wrapper.plan(paged.kv_indptr, paged.kv_indices, paged.kv_last_page_len, heads, kv_heads, head_dim,
                     paged.page_size, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)

    def _plan(
        self, meta: AttentionMetadata, paged: PagedLayout, key: tuple[int, int, int, float, torch.dtype]
    ) -> None:
        """Once per step: flashinfer's plan() of the wrapper this step uses."""
        heads, kv_heads, head_dim, scale, dtype = key
        if meta.num_decodes and not meta.prefills:
            self._wrapper = self._decode_wrapper(heads // kv_heads >= TENSOR_CORE_DECODE_MIN_GROUP)
            self.plan_decode(self._wrapper, paged, heads, kv_heads, head_dim, scale, dtype)
        else:
            self._wrapper = self._prefill
            self._wrapper.plan(
                paged.qo_indptr, paged.kv_indptr, paged.kv_indices, paged.kv_last_page_len, heads, kv_heads,
                head_dim, paged.page_size, causal=True, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype,
            )
        self._planned = meta
        self._plan_key = key

    def _decode_wrapper(self, tensor_cores: bool) -> Any:
        if self._decode is None or self._decode_tensor_cores != tensor_cores:
            self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores
            )
            self._decode_tensor_cores = tensor_cores
        return self._decode

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message)
