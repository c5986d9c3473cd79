"""Paged attention: build_metadata's layouts, the torch reference against naive dense attention, the flashinfer
backend's plumbing (planning, page views, dtypes, fallbacks) against a stand-in for flashinfer, and the choice of
backend. The native CPU kernels have their own tests (test_native_kernels.py)."""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lmrpc.kernels import attention, flashinfer_attention, native
from lmrpc.kernels.attention import PagedTorchAttention, select_backend
from lmrpc.kernels.flashinfer_attention import FlashInferAttention
from lmrpc.kernels.native_attention import NativeAttention
from lmrpc.kernels.paged import AttentionMetadata, AttentionShape, Rope, build_metadata
from lmrpc.kernels.torch_attention import torch_reference

CPU = torch.device("cpu")


def test_paged_layout_of_a_hand_made_step() -> None:
    page_size = 4
    chunks = [
        (5, 1, torch.tensor([7, 2, 9])),  # decode, context 6: pages 7, 2 (9 is reserved, unused yet); last 2
        (3, 1, torch.tensor([4])),  # decode, context 4: one full page
        (0, 6, torch.tensor([1, 3])),  # prefill from 0, context 6
        (8, 3, torch.tensor([0, 5, 6, 8])),  # chunked prefill after an 8-token prefix, context 11
    ]
    meta = build_metadata(chunks, page_size, CPU, paged_layout=True)
    p = meta.paged
    assert p is not None
    assert p.page_size == page_size
    assert p.qo_indptr.tolist() == [0, 1, 2, 8, 11]
    assert p.kv_indptr.tolist() == [0, 2, 3, 5, 8]
    assert p.kv_indices.tolist() == [7, 2, 4, 1, 3, 0, 5, 6]
    assert p.kv_last_page_len.tolist() == [2, 4, 2, 3]
    for t in (p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len):
        assert t.dtype == torch.int32
    # The other fields do not depend on the flag, and the CPU path builds no layout by default.
    plain = build_metadata(chunks, page_size, CPU)
    assert plain.paged is None
    assert torch.equal(plain.slot_mapping, meta.slot_mapping)
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 4 * 4 + 3, 4, 5, 6, 7, 12, 13, 6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2]


@dataclass
class Step:
    """A random step over a random paged cache, and the dense per-sequence tensors it was made from."""

    chunks: list[tuple[int, int, torch.Tensor]]
    q: torch.Tensor  # [T, heads, head_dim]
    k: torch.Tensor  # [T, kv_heads, head_dim]
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_slots, kv_heads, head_dim], prefixes written, the rest garbage
    v_cache: torch.Tensor
    dense: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per sequence: q [n], K, V [context]


def make_step(
    seqs: list[tuple[int, int]],  # (start, num new tokens), decodes first
    page_size: int,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    seed: int = 0,
) -> Step:
    g = torch.Generator().manual_seed(seed)
    pages_needed = [-(-(s + n) // page_size) + 1 for s, n in seqs]  # one spare page each: tables may run ahead
    num_pages = sum(pages_needed) + 3  # a few pages nobody owns
    order = torch.randperm(num_pages, generator=g)
    num_slots = num_pages * page_size
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    chunks, qs, ks, vs, dense = [], [], [], [], []
    used = 0
    for (start, n), p in zip(seqs, pages_needed, strict=True):
        table = order[used : used + p].to(torch.int64)
        used += p
        context = start + n
        kd = torch.randn(context, kv_heads, head_dim, generator=g).to(dtype)  # [context, kv_heads, head_dim]
        vd = torch.randn(context, kv_heads, head_dim, generator=g).to(dtype)
        qd = torch.randn(n, heads, head_dim, generator=g).to(dtype)  # [n, heads, head_dim]
        positions = torch.arange(start)
        prefix_slots = table[positions // page_size] * page_size + positions % page_size
        k_cache[prefix_slots] = kd[:start]  # the cached prefix, as earlier steps left it
        v_cache[prefix_slots] = vd[:start]
        chunks.append((start, n, table))
        qs.append(qd)
        ks.append(kd[start:])
        vs.append(vd[start:])
        dense.append((qd, kd, vd))
    return Step(
        chunks, torch.cat(qs).to(device), torch.cat(ks).to(device), torch.cat(vs).to(device), k_cache.to(device),
        v_cache.to(device), dense,
    )


def naive_attention(step: Step, scale: float) -> torch.Tensor:
    """Causal GQA attention per sequence and head from the dense tensors, with explicit loops."""
    rows = []
    for (start, n, _), (qd, kd, vd) in zip(step.chunks, step.dense, strict=True):
        heads, kv_heads = qd.shape[1], kd.shape[1]
        out = torch.empty_like(qd)
        for i in range(n):
            visible = start + i + 1  # query i sits at position start + i
            for h in range(heads):
                hk = h // (heads // kv_heads)  # GQA: consecutive query heads share a kv head
                scores = (kd[:visible, hk] @ qd[i, h]) * scale  # [visible]
                out[i, h] = torch.softmax(scores, dim=0) @ vd[:visible, hk]
        rows.append(out)
    return torch.cat(rows)


MIXED = [(0, 1), (6, 1), (40, 1), (0, 7), (13, 9)]  # decodes (context 1, 7, 41), prefill from 0, chunked prefill


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(
    "seqs", [MIXED, [(3, 1), (30, 1)], [(0, 5)], [(21, 4), (0, 3)], [(17, 1)], [(9, 1), (9, 1), (0, 4)]], ids=str
)
def test_torch_reference_matches_naive_attention(page_size: int, seqs: list[tuple[int, int]]) -> None:
    step = make_step(seqs, page_size, seed=page_size)
    scale = 16**-0.5
    meta = build_metadata(step.chunks, page_size, CPU)
    decodes = [start + 1 for start, n in seqs if n == 1]
    assert meta.decode_lengths == tuple(decodes)
    # Decode rows of equal contexts need no padding mask; mixed contexts get one.
    assert (meta.decode_mask is None) == (len(set(decodes)) <= 1)
    expected = naive_attention(step, scale)
    out = torch_reference(step.q, step.k, step.v, step.k_cache, step.v_cache, meta, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The new K/V landed at each sequence's positions start..start+n-1 of its page table.
    for (start, n, table), (_, kd, vd) in zip(step.chunks, step.dense, strict=True):
        positions = torch.arange(start, start + n)
        slots = table[positions // page_size] * page_size + positions % page_size
        assert torch.equal(step.k_cache[slots], kd[start:])
        assert torch.equal(step.v_cache[slots], vd[start:])


# --- FlashInferAttention against a stand-in for flashinfer -------------------------------------------------------


class _FakeWrapper:
    """Dense torch implementation of what flashinfer's paged wrappers are documented to compute."""

    def __init__(self, log: list[str], kind: str, workspace: torch.Tensor, kv_layout: str, **kw: Any) -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.log, self.kind, self.kw = log, kind, kw
        self.planned: dict[str, Any] | None = None

    def plan(self, *args: Any, **kw: Any) -> None:
        if self.kind == "decode":
            kv_indptr, kv_indices, last, heads, kv_heads, head_dim, page_size = args
            qo_indptr = torch.arange(len(last) + 1, dtype=torch.int32)
            assert "causal" not in kw
        else:
            qo_indptr, kv_indptr, kv_indices, last, heads, kv_heads, head_dim, page_size = args
            assert kw["causal"] is True
        for t in (qo_indptr, kv_indptr, kv_indices, last):
            assert t.dtype == torch.int32
        assert set(kw) <= {"causal", "sm_scale", "q_data_type", "kv_data_type"}
        self.log.append(f"plan {self.kind}")
        self.planned = dict(qo=qo_indptr, kv=kv_indptr, idx=kv_indices, last=last, heads=heads, kv_heads=kv_heads,
                            head_dim=head_dim, page_size=page_size, **kw)

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        p = self.planned
        assert p is not None, "run before plan"
        kc, vc = paged_kv_cache  # [num_pages, page_size, kv_heads, head_dim]
        assert kc.shape[1:] == (p["page_size"], p["kv_heads"], p["head_dim"]) and vc.shape == kc.shape
        assert q.dtype == p["q_data_type"] and kc.dtype == p["kv_data_type"]
        assert q.shape == (int(p["qo"][-1]), p["heads"], p["head_dim"]) and q.is_contiguous()
        self.log.append(f"run {self.kind}")
        out = torch.empty_like(q)
        group = p["heads"] // p["kv_heads"]
        for b in range(len(p["last"])):
            pages = p["idx"][p["kv"][b] : p["kv"][b + 1]].long()
            kv_len = (len(pages) - 1) * p["page_size"] + int(p["last"][b])
            kb = kc[pages].flatten(0, 1)[:kv_len].float().repeat_interleave(group, 1)  # [kv_len, heads, head_dim]
            vb = vc[pages].flatten(0, 1)[:kv_len].float().repeat_interleave(group, 1)
            qb = q[p["qo"][b] : p["qo"][b + 1]].float()  # [qo_len, heads, head_dim]
            qo_len = qb.shape[0]
            scores = torch.einsum("qhd,khd->hqk", qb, kb) * p["sm_scale"]
            # Bottom-right aligned causal mask: key j is hidden from query i iff j > kv_len - qo_len + i.
            hidden = torch.arange(kv_len)[None, :] > (kv_len - qo_len + torch.arange(qo_len))[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
            out[p["qo"][b] : p["qo"][b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vb).to(q.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []
    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = (  # type: ignore[attr-defined]
        lambda ws, layout, **kw: _FakeWrapper(log, "prefill", ws, layout, **kw)
    )
    fi.BatchDecodeWithPagedKVCacheWrapper = (  # type: ignore[attr-defined]
        lambda ws, layout, **kw: _FakeWrapper(log, "decode", ws, layout, **kw)
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    return log


def _layers(
    backend: Any, step: Step, meta: AttentionMetadata, scale: float, layers: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layers` calls with one meta, each on its own copy of the cache (as each model layer has its own cache);
    the last call's output and caches."""
    assert layers >= 1
    for _ in range(layers):
        k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
        out = backend(step.q, step.k, step.v, k_cache, v_cache, meta, scale)
    return out, k_cache, v_cache


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_backend_plans_once_per_step_and_matches_reference(
    fake_flashinfer: list[str], page_size: int
) -> None:
    log = fake_flashinfer
    backend = FlashInferAttention(CPU, workspace=torch.empty(16, dtype=torch.uint8))
    scale = 16**-0.5
    for seqs, kind in [(MIXED, "prefill"), ([(5, 1), (33, 1)], "decode"), ([(0, 4), (9, 2)], "prefill")]:
        step = make_step(seqs, page_size, dtype=torch.bfloat16)
        meta = build_metadata(step.chunks, page_size, CPU, paged_layout=True)
        log.clear()
        out, k_cache, v_cache = _layers(backend, step, meta, scale, layers=3)
        assert log == [f"plan {kind}", f"run {kind}", f"run {kind}", f"run {kind}"]
        ref_k, ref_v = step.k_cache.clone(), step.v_cache.clone()
        ref = torch_reference(step.q.float(), step.k.float(), step.v.float(), ref_k, ref_v, meta, scale)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
        # A new meta object is a new step, even with equal contents.
        again = build_metadata(step.chunks, page_size, CPU, paged_layout=True)
        log.clear()
        backend(step.q, step.k, step.v, step.k_cache.clone(), step.v_cache.clone(), again, scale)
        assert log == [f"plan {kind}", f"run {kind}"]


def test_flashinfer_backend_casts_a_wider_q_and_picks_tensor_core_decode(fake_flashinfer: list[str]) -> None:
    backend = FlashInferAttention(CPU, workspace=torch.empty(16, dtype=torch.uint8))
    step = make_step([(7, 1), (2, 1)], 4, heads=8, kv_heads=2, dtype=torch.float16)
    meta = build_metadata(step.chunks, 4, CPU, paged_layout=True)
    q = step.q.float()  # float32 activations over a float16 cache: computed in float16, returned in float32
    out = backend(q, step.k.float(), step.v.float(), step.k_cache, step.v_cache, meta, 0.25)
    assert out.dtype == torch.float32
    assert backend._decode.kw == {"use_tensor_cores": True}  # group of 4
    ref = torch_reference(q, step.k.float(), step.v.float(), step.k_cache.clone(), step.v_cache.clone(), meta, 0.25)
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)


def test_flashinfer_backend_falls_back_without_layout_or_for_float32(
    fake_flashinfer: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    backend = FlashInferAttention(CPU, workspace=torch.empty(16, dtype=torch.uint8))
    step = make_step(MIXED, 4)
    scale = 0.25
    expected = naive_attention(step, scale)
    for meta in (build_metadata(step.chunks, 4, CPU), build_metadata(step.chunks, 4, CPU, paged_layout=True)):
        for _ in range(2):
            with caplog.at_level(logging.WARNING):
                out = backend(step.q, step.k, step.v, step.k_cache.clone(), step.v_cache.clone(), meta, scale)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert fake_flashinfer == []  # float32 cache / no layout: flashinfer never planned
    assert len(caplog.records) == 2  # one warning per reason, not per call


SHAPE = AttentionShape(layers=2, heads=4, kv_heads=2, head_dim=16, scale=0.25)
ROPE = Rope(torch.ones(64, 16), torch.zeros(64, 16))


def test_select_backend(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cpu = select_backend(SHAPE, ROPE, torch.float32, CPU, num_pages=8, page_size=16)
    assert isinstance(cpu, NativeAttention) == native.available()
    # Page sizes the native kernels can't read, or a cache dtype they don't store: the torch reference, said so.
    with caplog.at_level(logging.WARNING):
        for page_size, dtype in ((4, torch.float32), (16, torch.float16)):
            other = select_backend(SHAPE, ROPE, dtype, CPU, num_pages=8, page_size=page_size)
            assert isinstance(other, PagedTorchAttention) and other.kernel is torch_reference
    assert "torch reference" in caplog.text
    caplog.clear()
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    monkeypatch.setattr(attention, "_warned_no_flashinfer", False)
    # No CUDA here: record what would be built instead of allocating a cache on it.
    monkeypatch.setattr(attention, "PagedTorchAttention", lambda *a, **kw: kw.get("kernel", torch_reference))
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            cuda = select_backend(SHAPE, ROPE, torch.bfloat16, torch.device("cuda"), num_pages=8, page_size=16)
            assert cuda is torch_reference  # type: ignore[comparison-overlap]
    assert len(caplog.records) == 1 and "flashinfer" in caplog.text


def test_flashinfer_is_chosen_only_for_head_sizes_it_has_kernels_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """flashinfer fails inside its kernels for a head_dim of 16 ("Unsupported head_dim", seen on an H200): such a
    model gets the torch reference on CUDA, and no CUDA graphs (they need flashinfer's kernel)."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(flashinfer_attention, "FlashInferAttention", lambda device: "flashinfer")
    monkeypatch.setattr(attention, "PagedTorchAttention", lambda *a, **kw: kw.get("kernel", torch_reference))
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING):
        for head_dim in (64, 128, 256):
            shape = AttentionShape(layers=2, heads=4, kv_heads=2, head_dim=head_dim, scale=head_dim**-0.5)
            assert select_backend(shape, ROPE, torch.bfloat16, cuda, num_pages=8, page_size=16) == "flashinfer"
        assert not caplog.records
        small = select_backend(SHAPE, ROPE, torch.bfloat16, cuda, num_pages=8, page_size=16)  # head_dim 16
    assert small is torch_reference  # type: ignore[comparison-overlap]
    assert "head_dim 16" in caplog.text and "torch reference" in caplog.text
