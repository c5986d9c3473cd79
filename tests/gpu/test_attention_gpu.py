"""The flashinfer attention backend on CUDA agrees with the torch reference (outputs and cache writes)."""

from __future__ import annotations

import pytest
import torch

from lmrpc.kernels.attention import PagedTorchAttention, select_backend
from lmrpc.kernels.flashinfer_attention import FlashInferAttention
from lmrpc.kernels.paged import AttentionMetadata, AttentionShape, Rope, build_metadata
from lmrpc.kernels.torch_attention import torch_reference

try:
    import flashinfer  # noqa: F401

    HAVE_FLASHINFER = True
except ImportError:
    HAVE_FLASHINFER = False

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAVE_FLASHINFER, reason="needs flashinfer"),
]

CUDA = torch.device("cuda")
# bf16 keeps 8 mantissa bits (fp16 11); flashinfer also rounds the softmax weights to q's dtype before P @ V.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2}

# (start, new tokens), decodes first: decodes with contexts 1, 17, 70, 300; a prefill from 0; a chunked prefill
# after a 50-token prefix (both cross page boundaries at page size 16).
MIXED = [(0, 1), (16, 1), (69, 1), (299, 1), (0, 45), (50, 31)]
DECODES = [(3, 1), (15, 1), (16, 1), (127, 1), (500, 1)]
PREFILLS = [(0, 7), (33, 64)]


class Paged:
    """One random layer cache with sequences scattered over shuffled pages (tables longer than needed)."""

    def __init__(self, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> None:
        self.page_size, self.kv_heads, self.head_dim, self.dtype = page_size, kv_heads, head_dim, dtype
        self.g = torch.Generator().manual_seed(seed)
        self.num_pages = 2048 // page_size + 64
        self.free = torch.randperm(self.num_pages, generator=self.g).tolist()
        slots = self.num_pages * page_size
        # [num_slots, kv_heads, head_dim]; unwritten slots hold garbage no query may see
        self.k_cache = torch.randn(slots, kv_heads, head_dim, generator=self.g).to(dtype).to(CUDA)
        self.v_cache = torch.randn(slots, kv_heads, head_dim, generator=self.g).to(dtype).to(CUDA)

    def step(
        self, seqs: list[tuple[int, int]], heads: int
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pages and prefixes for new sequences; (meta, q, k, v) of the step."""
        chunks = []
        for start, n in seqs:
            table = torch.tensor([self.free.pop() for _ in range(-(-(start + n) // self.page_size) + 1)])
            positions = torch.arange(start)
            prefix = (table[positions // self.page_size] * self.page_size + positions % self.page_size).to(CUDA)
            self.k_cache[prefix] = self._randn(start, self.kv_heads)
            self.v_cache[prefix] = self._randn(start, self.kv_heads)
            chunks.append((start, n, table))
        t = sum(n for _, n in seqs)
        meta = build_metadata(chunks, self.page_size, CUDA, paged_layout=True)
        return meta, self._randn(t, heads), self._randn(t, self.kv_heads), self._randn(t, self.kv_heads)

    def _randn(self, rows: int, heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, self.head_dim, generator=self.g).to(self.dtype).to(CUDA)


def check_step(
    backend: FlashInferAttention, cache: Paged, seqs: list[tuple[int, int]], heads: int, layers: int = 2
) -> None:
    meta, q, k, v = cache.step(seqs, heads)
    scale = cache.head_dim**-0.5
    # The reference in float32 over the same rounded cache: writes round k/v to the cache dtype, reads up-cast.
    ref_k, ref_v = cache.k_cache.clone(), cache.v_cache.clone()
    expected = torch_reference(q.float(), k.float(), v.float(), ref_k, ref_v, meta, scale)  # [T, heads, head_dim]
    for _ in range(layers):  # every layer of a step shares its meta: planned once, run per layer
        k_cache, v_cache = cache.k_cache.clone(), cache.v_cache.clone()
        out = backend(q, k, v, k_cache, v_cache, meta, scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        tol = TOLERANCE[cache.dtype]
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference_gqa(head_dim: int, page_size: int, dtype: torch.dtype) -> None:
    backend = FlashInferAttention(CUDA)
    cache = Paged(page_size, kv_heads=2, head_dim=head_dim, dtype=dtype, seed=head_dim + page_size)
    check_step(backend, cache, MIXED, heads=8)  # prefill wrapper: decodes and prefills in one ragged batch
    check_step(backend, cache, DECODES, heads=8)  # decode wrapper (tensor cores: group of 4)
    check_step(backend, cache, PREFILLS, heads=8)  # prefill wrapper again, re-planned


def test_matches_reference_mha_decode() -> None:
    """Without GQA the decode wrapper runs on CUDA cores: a different kernel."""
    backend = FlashInferAttention(CUDA)
    cache = Paged(16, kv_heads=8, head_dim=128, dtype=torch.bfloat16, seed=1)
    check_step(backend, cache, DECODES, heads=8)
    check_step(backend, cache, MIXED, heads=8)


def test_float32_activations_over_a_bf16_cache() -> None:
    backend = FlashInferAttention(CUDA)
    cache = Paged(16, kv_heads=2, head_dim=64, dtype=torch.bfloat16, seed=2)
    meta, q, k, v = cache.step(MIXED, heads=8)
    q32, k32, v32 = q.float(), k.float(), v.float()
    ref_k, ref_v = cache.k_cache.clone(), cache.v_cache.clone()
    expected = torch_reference(q32, k32, v32, ref_k, ref_v, meta, 0.125)
    out = backend(q32, k32, v32, cache.k_cache, cache.v_cache, meta, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(cache.k_cache, ref_k) and torch.equal(cache.v_cache, ref_v)


def test_select_backend_picks_flashinfer_on_cuda() -> None:
    shape = AttentionShape(layers=1, heads=8, kv_heads=2, head_dim=64, scale=0.125)
    backend = select_backend(shape, Rope(torch.ones(16, 64), torch.zeros(16, 64)), torch.bfloat16, CUDA, 4, 16)
    assert isinstance(backend, PagedTorchAttention) and isinstance(backend.kernel, FlashInferAttention)
