"""lmrpc's native CPU kernels: products in every weight format against their dequantized reference, row invariance
(a row's bits never depend on the other rows), the fused prologues and epilogue, GGUF blocks repacked code for code,
and paged attention against naive attention and invariant to how queries are batched or chunked. The portable build
(no AVX512, no AVX2) is checked too, in a subprocess, and the native build's products against its bits."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import test_int16_activations
import torch
import torch.nn.functional as F

from lmrpc.kernels import gguf_blocks, native, packed_rows, packing, quantize
from lmrpc.kernels.native_attention import NativeAttention
from lmrpc.kernels.packing import Compute, PackedWeight
from lmrpc.kernels.paged import AttentionShape, ChunkSpec, QKNorm, Rope
from lmrpc.kernels.torch_attention import apply_rope, rms_norm

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels do not build here")


def op(p: PackedWeight, compute: Compute, bias: torch.Tensor | None = None, expand_codes: bool = False,
       int8_activations: bool = False) -> object:
    return native.load().PackedLinear(int(p.format), int(compute), p.n, p.k, p.group, p.q4_signed, p.data, p.scale,
                                      p.offset, bias, expand_codes=expand_codes, int8_activations=int8_activations)


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def gguf_q4_1_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    """GGUF Q4_1 bytes of codes [n, k] (block j: fp16 d, fp16 m, 16 bytes: element i low nibble, i + 16 high)."""
    n, k = codes.shape
    blocks = codes.view(n, k // 32, 32).to(torch.uint8)
    qs = (blocks[..., :16] | (blocks[..., 16:] << 4)).numpy()
    out = np.concatenate([d.half().numpy().view(np.uint8).reshape(n, k // 32, 2),
                          m.half().numpy().view(np.uint8).reshape(n, k // 32, 2), qs], axis=-1)
    return out.reshape(n, -1)


def q8_0(w: torch.Tensor) -> PackedWeight:
    """GGUF Q8_0's scheme: int8 codes in groups of 32, scale max|w| / 127 (the bundled model's output head)."""
    n, k = w.shape
    k_pad = -(-k // 32) * 32
    groups = torch.cat([w, torch.zeros(n, k_pad - k)], dim=1).view(n, k_pad // 32, 32)
    scale = (groups.abs().amax(dim=2) / 127).clamp(min=1e-8).half().float()
    codes = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8).view(n, k_pad)[:, :k]
    return packing.pack_q8(codes, scale, 32)


FORMATS = {
    "f32": (lambda w: packing.pack_dense(w), Compute.F32),
    "bf16": (lambda w: packing.pack_dense(w.bfloat16()), Compute.BF16),
    "int4-bf16": (quantize.quantize_int4, Compute.BF16),
    "int4-f32": (quantize.quantize_int4, Compute.F32),
    "int8-bf16": (quantize.quantize_int8, Compute.BF16),
    "int8-f32": (quantize.quantize_int8, Compute.F32),
    "q8_0-bf16": (q8_0, Compute.BF16),
    "q8_0-f32": (q8_0, Compute.F32),
}


def test_the_build_key_reads_every_source_file() -> None:
    # A file the kernels' build key does not read could change without a rebuild: a stale module served old code.
    assert set(native.SOURCES) == {p.name for p in native.CSRC.glob("*.cpp")}
    assert set(native.HEADERS) == {p.name for p in native.CSRC.glob("*.h")}


def test_no_route_is_switched_off_in_the_sources() -> None:
    # An A/B's old build left `if (false && ...)` in attention.cpp for two sessions: the route it guarded never ran
    # and its bitwise test compared the other route with itself. Conditions fixed by a literal have no place here.
    switched = re.compile(r"\bfalse\s*&&|&&\s*false\b|\btrue\s*\|\||\|\|\s*true\b"
                          r"|#\s*if\s+[01]\b|\bif\s*\(\s*[01]\s*\)")
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(native.CSRC.iterdir()) if p.suffix in (".cpp", ".h")
             for i, line in enumerate(p.read_text().splitlines(), 1) if switched.search(line)]
    assert not found, found


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("shape", [(200, 96), (64, 576), (1000, 60)], ids=str)
@pytest.mark.parametrize("expand_codes", [False, True], ids=["codes", "expanded"])
def test_products_equal_the_dequantized_weight_and_rows_are_independent(fmt: str, shape: tuple[int, int],
                                                                         expand_codes: bool) -> None:
    make, compute = FORMATS[fmt]
    n, k = shape
    p = make(weight(n, k))
    lin = op(p, compute, expand_codes=expand_codes)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1))
    # The reference: float64 products of the dequantized weight with the inputs as the kernel sees them.
    xin = x.bfloat16().float() if compute == Compute.BF16 else x
    expected = xin.double() @ packing.dequantize(p).double().T
    y = lin.forward(x)
    torch.testing.assert_close(y.double(), expected, atol=2e-5, rtol=1e-4)
    # Every row alone, and every leading block of rows, gives exactly the rows of the full product. These shapes
    # have few blocks of output tiles, so with two threads the 37 rows are split between work items in uneven row
    # chunks (linear_products.cpp's job_items), while a row alone is one item.
    for i in range(37):
        assert torch.equal(lin.forward(x[i : i + 1]), y[i : i + 1]), i
    for rows in (2, 3, 4, 5, 8, 9, 17, 33):
        assert torch.equal(lin.forward(x[:rows]), y[:rows]), rows
    if expand_codes:  # the codes expanded once give the bits of the codes expanded on every call
        assert torch.equal(y, op(p, compute).forward(x))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_call_writes_its_own_input_padding(fmt: str) -> None:
    # Inputs are padded to whole groups in buffers that are reused between calls and not cleared first: a call with
    # 60 inputs must zero columns 60-63 itself, or whatever an earlier, wider call left there (here inf) reaches the
    # products (inf times a zero weight is nan) and the group sums.
    make, compute = FORMATS[fmt]
    wide, narrow = op(make(weight(64, 64)), compute), op(make(weight(64, 60, seed=3)), compute)
    x = torch.randn(9, 60, generator=torch.Generator().manual_seed(4))
    before = narrow.forward(x)
    wide.forward(torch.full((9, 64), float("inf")))
    after = narrow.forward(x)
    assert torch.isfinite(after).all()
    assert torch.equal(after, before)


# 13 rows: from 8 rows on, the products write their outputs (and the prologue its rounded inputs) with streaming
# stores; the fused terms must come out the same.
@pytest.mark.parametrize("rows", [7, 13])
@pytest.mark.parametrize("compute", [Compute.BF16, Compute.F32])
def test_fused_norm_silu_bias_and_residual(compute: Compute, rows: int) -> None:
    n, k = 96, 64
    p = quantize.quantize_int4(weight(n, k))
    bias = torch.randn(n)
    lin, plain = op(p, compute, bias), op(p, compute)
    g = torch.Generator().manual_seed(2)
    x, norm = torch.randn(rows, k, generator=g), torch.randn(k, generator=g)
    residual = torch.randn(rows, n, generator=g)
    rounded = (lambda t: t.bfloat16().float()) if compute == Compute.BF16 else (lambda t: t)
    w = packing.dequantize(p).double()
    normed = lin.forward(x, norm_weight=norm, eps=1e-5)
    ref = rounded(rms_norm(x, norm, 1e-5)).double() @ w.T + bias.double()
    torch.testing.assert_close(normed.double(), ref, atol=2e-5, rtol=1e-4)
    gate_up = torch.randn(rows, 2 * k, generator=g)
    silu = plain.forward(gate_up, silu=True)
    ref = rounded(F.silu(gate_up[:, :k]) * gate_up[:, k:]).double() @ w.T
    torch.testing.assert_close(silu.double(), ref, atol=2e-5, rtol=1e-4)
    # The residual is added after the bias, to the same product.
    assert torch.equal(lin.forward(x, residual=residual), (plain.forward(x) + bias) + residual)


def int8_reference(x: torch.Tensor, p: PackedWeight) -> torch.Tensor:
    """What the int8 path computes, in float64: each row quantized per group of 32 to round(x / d), d = max|x| / 127,
    times the dequantized weight."""
    groups = x.view(x.shape[0], -1, 32).double()
    d = groups.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(groups / torch.where(d > 0, d, 1)), 0)
    return (q * d).view_as(x) @ packing.dequantize(p).double().T


@pytest.mark.skipif(not native.available() or not native.load().native_vnni(), reason="no AVX512-VNNI here")
@pytest.mark.parametrize("signed", [False, True], ids=["q4_1", "q4_0"])
def test_int4_products_with_int8_activations_are_row_invariant_and_exact_in_integers(signed: bool) -> None:
    n, k = 200, 576
    w = weight(n, k)
    p = quantize.quantize_int4(w)
    if signed:  # Q4_0: value (q - 8) * scale, no offsets
        scale = p.scale.float().abs() + 1e-3
        p = PackedWeight(p.format, p.n, p.k, p.group, True, p.data, scale.half(), None)
    lin = op(p, Compute.BF16, int8_activations=True)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(3))
    y = lin.forward(x)
    # Integer sums are exact: only the float fold (a few roundings per group) separates y from the reference.
    torch.testing.assert_close(y.double(), int8_reference(x, p), atol=1e-4, rtol=1e-4)
    # And it is not the bfloat16-activation path: int8 rounding is coarser.
    assert not torch.equal(y, op(p, Compute.BF16).forward(x))
    for i in range(37):
        assert torch.equal(lin.forward(x[i : i + 1]), y[i : i + 1]), i
    for rows in (2, 3, 5, 6, 7, 12, 13, 33):
        assert torch.equal(lin.forward(x[:rows]), y[:rows]), rows


@pytest.mark.skipif(not native.available() or not native.load().native_vnni(), reason="no AVX512-VNNI here")
def test_products_after_silu_keep_bfloat16_activations() -> None:
    # The MLP's gated activations have outliers that int8 per 32 inputs rounds away: that call site stays bf16.
    n, k = 96, 64
    p = quantize.quantize_int4(weight(n, k))
    gate_up = torch.randn(9, 2 * k, generator=torch.Generator().manual_seed(4))
    int8, bf16 = op(p, Compute.BF16, int8_activations=True), op(p, Compute.BF16, expand_codes=True)
    assert torch.equal(int8.forward(gate_up, silu=True), bf16.forward(gate_up, silu=True))
    x = gate_up[:, :k].contiguous()
    assert not torch.equal(int8.forward(x), bf16.forward(x))


def test_gguf_blocks_are_repacked_code_for_code() -> None:
    n, k = 64, 128
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d, m = torch.rand(n, k // 32, generator=g).half().float(), -torch.rand(n, k // 32, generator=g).half().float()
    p = gguf_blocks.pack_gguf(gguf_blocks.Q4_1, gguf_q4_1_blocks(codes, d, m), n, k)
    assert p.label == "q4_1"
    expected = torch.addcmul(m.repeat_interleave(32, 1), codes.float(), d.repeat_interleave(32, 1))
    assert torch.equal(packing.dequantize(p), expected)
    # Rows read back for embedding lookups are the same values.
    assert torch.equal(op(p, Compute.F32).rows(torch.tensor([0, 17, 63])), expected[[0, 17, 63]])
    # Q8_0 blocks: fp16 scale then 32 int8 codes.
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    raw = np.concatenate([d.half().numpy().view(np.uint8).reshape(n, k // 32, 2),
                          q8.numpy().view(np.uint8).reshape(n, k // 32, 32)], axis=-1).reshape(n, -1)
    p8 = gguf_blocks.pack_gguf(gguf_blocks.Q8_0, raw, n, k)
    assert p8.label == "q8_0"
    assert torch.equal(packing.dequantize(p8), q8.float() * d.repeat_interleave(32, 1))


@pytest.mark.parametrize(("n", "k"), [(40, 64), (70, 72), (33, 1000)])
def test_int4_quantization_in_row_blocks_is_pack_q4_of_its_codes(monkeypatch: pytest.MonkeyPatch, n: int, k: int
                                                                 ) -> None:
    """quantize_int4 in blocks of QUANT_ROWS rows, straight into the layout: the weight pack_q4 makes of the codes
    computed the plain way over the whole matrix (padding inputs included in each group's range, as zeros)."""
    monkeypatch.setattr(quantize, "QUANT_ROWS", 16)
    w = weight(n, k, seed=n)
    k_pad = -(-k // 32) * 32
    groups = torch.cat([w, torch.zeros(n, k_pad - k)], dim=1).view(n, k_pad // 32, 32)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    lo, scale = lo.half().float(), ((hi - lo) / 15.0).clamp(min=packing.MIN_SCALE).half().float()
    codes = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    plain = packing.pack_q4(codes.view(n, k_pad)[:, :k], scale, lo)
    fast = quantize.quantize_int4(w)
    for name in ("n", "k", "group", "q4_signed"):
        assert getattr(fast, name) == getattr(plain, name)
    assert fast.offset is not None and plain.offset is not None and fast.scale is not None and plain.scale is not None
    assert torch.equal(fast.data, plain.data) and torch.equal(fast.scale, plain.scale)
    assert torch.equal(fast.offset, plain.offset)


def test_stacking_and_row_permutation_keep_the_codes() -> None:
    parts = [quantize.quantize_int4(weight(n, 64, seed)) for seed, n in enumerate((40, 24, 24))]
    stacked = packed_rows.concat_rows(parts)
    assert torch.equal(packing.dequantize(stacked), torch.cat([packing.dequantize(p) for p in parts]))
    order = torch.randperm(88, generator=torch.Generator().manual_seed(4))
    assert torch.equal(packing.dequantize(packed_rows.permute_rows(stacked, order)), packing.dequantize(stacked)[order])


# ---- attention ---------------------------------------------------------------------------------------------------

SHAPE = AttentionShape(layers=1, heads=6, kv_heads=2, head_dim=64, scale=64**-0.5, qk_norm_eps=1e-6)


def rope(positions: int, head_dim: int) -> Rope:
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, head_dim, 2)
                                                                                       / head_dim))
    angles = torch.cat([angles, angles], dim=-1)
    sin = angles.sin()
    half = head_dim // 2
    return Rope(angles.cos().contiguous(), torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).contiguous())


def naive(qkv: torch.Tensor, positions: torch.Tensor, rot: Rope, norm: QKNorm | None, stored: torch.dtype,
          shape: AttentionShape) -> torch.Tensor:
    """Causal attention of one sequence whose tokens are all in qkv [T, width] (positions 0..T-1), keys and values
    rounded to the cache dtype as the cache stores them."""
    s = shape
    t = qkv.shape[0]
    q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
    q, k, v = q.reshape(t, s.heads, -1), k.reshape(t, s.kv_heads, -1), v.reshape(t, s.kv_heads, -1)
    if norm is not None:
        q, k = rms_norm(q, norm.q, s.qk_norm_eps), rms_norm(k, norm.k, s.qk_norm_eps)
    cos, sin = rot.cos[positions].unsqueeze(1), rot.sin[positions].unsqueeze(1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = k.to(stored).float(), v.to(stored).float()
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                         scale=s.scale, enable_gqa=True)  # [heads, T, head_dim]
    return out.transpose(0, 1).reshape(t, -1)


def attention_rows(shape: AttentionShape, rot: Rope, dtype: torch.dtype, seqs: list[torch.Tensor],
                   tables: list[list[int]], steps: list[list[tuple[int, int, int]]], norm: QKNorm | None,
                   num_pages: int) -> dict[tuple[int, int], torch.Tensor]:
    """A fresh cache of 16-token pages run through steps of chunks (sequence, start, count), in order: the output row of
    each (sequence, position). seqs [i]: sequence i's qkv rows; tables [i]: its pages."""
    backend = NativeAttention(shape, rot, dtype, num_pages=num_pages, page_size=16)
    rows: dict[tuple[int, int], torch.Tensor] = {}
    for step in steps:
        chunks = [ChunkSpec(start, count, tables[i]) for i, start, count in step]
        positions = torch.cat([torch.arange(start, start + count) for _, start, count in step])
        qkv = torch.cat([seqs[i][start : start + count] for i, start, count in step])
        out = backend(0, qkv, backend.plan(chunks, positions), norm)
        flat = [(i, p) for i, start, count in step for p in range(start, start + count)]
        rows.update({key: out[j] for j, key in enumerate(flat)})
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_equals_naive_and_ignores_how_queries_are_grouped(dtype: torch.dtype, qk_norm: bool) -> None:
    g = torch.Generator().manual_seed(5)
    lengths = (1, 15, 16, 17, 50, 70)  # inside one page, exactly one, across pages
    rot = rope(128, SHAPE.head_dim)
    norm = QKNorm(torch.rand(64, generator=g) + 0.5, torch.rand(64, generator=g) + 0.5) if qk_norm else None
    seqs = [torch.randn(n, SHAPE.qkv_width, generator=g) for n in lengths]
    pages = torch.randperm(64, generator=g).tolist()
    tables = [pages[8 * i : 8 * i + 8] for i in range(len(lengths))]  # scrambled, non-contiguous page tables

    def run(steps: list[list[tuple[int, int, int]]]) -> dict[tuple[int, int], torch.Tensor]:
        return attention_rows(SHAPE, rot, dtype, seqs, tables, steps, norm, num_pages=64)

    # One prefill step with every whole sequence; then each sequence alone, token by token (as decodes).
    together = run([[(i, 0, n) for i, n in enumerate(lengths)]])
    decoded = run([[(i, p, 1)] for i, n in enumerate(lengths) for p in range(n)])
    # Uneven chunks, sequences interleaved in different steps.
    chunked = run([[(5, 0, 33), (3, 0, 16)], [(0, 0, 1), (5, 33, 37), (3, 16, 1)], [(1, 0, 15), (2, 0, 16),
                   (4, 0, 49)], [(4, 49, 1)]])
    for i, n in enumerate(lengths):
        ours = torch.stack([together[(i, p)] for p in range(n)])
        expected = naive(seqs[i], torch.arange(n), rot, norm, dtype, SHAPE)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
        for p in range(n):
            assert torch.equal(decoded[(i, p)], together[(i, p)]), (i, p)
            assert torch.equal(chunked[(i, p)], together[(i, p)]), (i, p)


def test_prefix_copy_moves_keys_and_values_of_every_layer() -> None:
    shape = AttentionShape(layers=2, heads=2, kv_heads=1, head_dim=16, scale=0.25)
    backend = NativeAttention(shape, rope(64, 16), torch.float32, num_pages=4, page_size=16)
    backend.keys.normal_()
    backend.values.normal_()
    backend.copy_prefix(1, 3, 5)
    assert torch.equal(backend.keys[:, 3, :, :, :5], backend.keys[:, 1, :, :, :5])
    assert torch.equal(backend.values[:, 3, :, :5], backend.values[:, 1, :, :5])


HAS_AVX2 = all(f in native._cpu_flags().split() for f in ("avx2", "fma", "f16c"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["generic", pytest.param("avx2", marks=pytest.mark.skipif(
    not HAS_AVX2, reason="the AVX2 build needs a CPU with AVX2, FMA and F16C"))])
def test_other_builds_give_the_same_guarantees(arch: str, tmp_path: os.PathLike[str]) -> None:
    """The kernels built without -march=native, as the portable loops (what a CPU without AVX2 runs) or the AVX2 + FMA
    paths (what a CPU without AVX512-BF16 runs), pass the same reference and invariance checks, GGUF's block and grid
    formats' bitwise references among them; the AVX2 build also its int16 activations' (on by default on such CPUs,
    test_int16_activations.py, which skips itself under an AVX512 build)."""
    if arch == "avx2" and native.load().native_avx2():
        # The paths a build takes are chosen by common.h's LMRPC_AVX512 / LMRPC_AVX2 alone: here the native build
        # takes the AVX2 ones already, and this file's own tests check them (a minute of compiling saved).
        pytest.skip("the native build is the AVX2 + FMA one on this CPU: the tests in this file check its paths")
    env = {**os.environ, "LMRPC_KERNEL_ARCH": arch}
    here = os.path.abspath(__file__)
    files = [here, *(os.path.join(os.path.dirname(here), name) for name in ("test_gguf_formats.py",
                                                                          "test_gguf_grids.py"))]
    if arch == "avx2":
        files.append(os.path.join(os.path.dirname(here), "test_int16_activations.py"))
    expect = {"generic": "not k.native_bf16() and not k.native_avx2()", "avx2": "k.native_avx2()"}[arch]
    script = (
        "import sys, pytest\n"
        "from lmrpc.kernels import native\n"
        f"k = native.load(); assert {expect}, 'expected the {arch} build'\n"
        f"sys.exit(pytest.main(['-q', '-x', '-rs', '-p', 'no:cacheprovider', *{files!r}, '-k', "
        "'not portable and not builds and (f32 or int4-bf16 or int8-bf16 or fused or attention or reference "
        "or int16_activations)']))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " error" not in result.stdout, result.stdout[-3000:]
    if arch == "avx2":  # the int16 module ran here, not skipped as it is under an AVX512 build (-rs lists skips)
        assert test_int16_activations.NOT_AVX2 not in result.stdout, result.stdout[-3000:]


def products_of_every_format(bf16: bool) -> dict[str, torch.Tensor]:
    """Outputs of every weight format (and GGUF's Q4_0, whose codes are signed) at row counts that take each path
    (one row, a register block's tail, many rows), plain and with the fused prologues and residual: float32
    products, and bfloat16 ones when `bf16`."""
    import gguf

    k = 576
    w = weight(200, k, seed=7)
    formats = {name: (make(w), compute) for name, (make, compute) in FORMATS.items() if bf16 or compute == Compute.F32}
    q4_0 = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0)
    formats["q4_0-f32"] = (gguf_blocks.pack_gguf(int(gguf.GGMLQuantizationType.Q4_0), q4_0, 200, k), Compute.F32)
    x = torch.randn(40, 2 * k, generator=torch.Generator().manual_seed(8))
    norm = torch.rand(k, generator=torch.Generator().manual_seed(9)) + 0.5
    residual = torch.randn(40, 200, generator=torch.Generator().manual_seed(10))
    out = {}
    for name, (p, compute) in formats.items():
        lin = op(p, compute)
        for m in (1, 2, 5, 7, 13, 40):
            out[f"{name}/{m}"] = lin.forward(x[:m, :k].contiguous())
            out[f"{name}/{m}/norm"] = lin.forward(x[:m, :k].contiguous(), norm_weight=norm, eps=1e-5)
            out[f"{name}/{m}/silu"] = lin.forward(x[:m].contiguous(), silu=True, residual=residual[:m].clone())
    return out


def attention_outputs() -> dict[str, torch.Tensor]:
    """Attention of a prefill step (sequences inside a page, across pages) and a decode step, float32 and bf16
    caches, heads of 64 (3 query heads per kv head) and of 128 dimensions (8 per kv head)."""
    out = {}
    wide = AttentionShape(layers=1, heads=16, kv_heads=2, head_dim=128, scale=128**-0.5)
    for shape in (SHAPE, wide):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(11)
            lengths = (1, 17, 70)
            seqs = [torch.randn(n + 1, shape.qkv_width, generator=g) for n in lengths]
            tables = [[8 * i + p for p in range(8)] for i in range(len(lengths))]
            backend = NativeAttention(shape, rope(128, shape.head_dim), dtype, num_pages=32, page_size=16)
            for step, (start, counts) in enumerate([(0, lengths), (None, (1, 1, 1))]):
                starts = [0] * len(lengths) if start is not None else list(lengths)
                chunks = [ChunkSpec(s0, n, tables[i]) for i, (s0, n) in enumerate(zip(starts, counts, strict=True))]
                positions = torch.cat([torch.arange(s0, s0 + n) for s0, n in zip(starts, counts, strict=True)])
                qkv = torch.cat([seqs[i][s0 : s0 + n] for i, (s0, n) in enumerate(zip(starts, counts, strict=True))])
                out[f"{shape.head_dim}/{dtype}/{step}"] = backend(0, qkv, backend.plan(chunks, positions), None)
    return out


def outputs_of_build(arch: str, bf16: bool, attention: bool, tmp_path: os.PathLike[str]) -> dict[str, torch.Tensor]:
    """products_of_every_format (and attention_outputs) from the kernels built with LMRPC_KERNEL_ARCH=arch, in a
    process of their own."""
    saved = os.path.join(tmp_path, f"{arch}.pt")
    here = os.path.dirname(os.path.abspath(__file__))
    expect = {"generic": "not k.native_bf16() and not k.native_avx2()", "avx2": "k.native_avx2()"}[arch]
    script = (
        f"import sys, torch; sys.path.insert(0, {here!r})\n"
        "from lmrpc.kernels import native\n"
        f"k = native.load(); assert {expect}, 'expected the {arch} build'\n"
        "import test_native_kernels as t\n"
        f"torch.save({{**t.products_of_every_format({bf16!r}), **(t.attention_outputs() if {attention!r} else {{}})}}, "
        f"{saved!r})\n"
    )
    env = {**os.environ, "LMRPC_KERNEL_ARCH": arch}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(saved)


def differing(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[str]:
    assert ours.keys() == theirs.keys()
    return [key for key in ours if not torch.equal(ours[key], theirs[key])]


@pytest.mark.slow
def test_the_native_products_give_the_portable_loops_bits(tmp_path: os.PathLike[str]) -> None:
    """What -march=native builds here runs the portable loops' operations: float32 products give the portable
    build's bits; where the build is AVX2 (no AVX512-BF16, whose dot products round their own way), bfloat16
    products and attention do too."""
    avx2 = bool(native.load().native_avx2())
    portable = outputs_of_build("generic", avx2, avx2, tmp_path)
    ours = {**products_of_every_format(avx2), **(attention_outputs() if avx2 else {})}
    assert not differing(ours, portable)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_AVX2, reason="the AVX2 build needs a CPU with AVX2, FMA and F16C")
def test_the_avx2_build_gives_the_portable_loops_bits(tmp_path: os.PathLike[str]) -> None:
    """The AVX2 + FMA paths (what a CPU without AVX512-BF16 runs), built here whatever this CPU has beyond them:
    float32 and bfloat16 products of every format and attention give the portable build's bits."""
    if native.load().native_avx2():
        # As in test_other_builds_give_the_same_guarantees: the native build here is this one.
        pytest.skip("the native build is the AVX2 + FMA one on this CPU: "
                    "test_the_native_products_give_the_portable_loops_bits checks its bits")
    avx2 = outputs_of_build("avx2", True, True, tmp_path)
    assert not differing(avx2, outputs_of_build("generic", True, True, tmp_path))


def test_a_build_lock_left_by_a_killed_process_does_not_block_the_next_start(tmp_path: os.PathLike[str]) -> None:
    """torch's build lock is a file: a server killed while compiling leaves it, and the next start used to wait for
    it forever. A copy of this machine's built kernels with such a file beside them must still load."""
    import shutil
    from pathlib import Path

    native.load()  # built (or found) in this process's cache first
    key = native.build_key(native._arch())
    built = native.cache_dir() / key
    cache = Path(tmp_path) / "cache"
    copy = cache / "kernels" / key
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "build.flock"))
    (copy / "lock").touch()  # what a process killed mid-build leaves
    script = "from lmrpc.kernels import native; assert native.load().native_bf16() in (True, False)"
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "LMRPC_CACHE": str(cache)},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (copy / "lock").exists()
