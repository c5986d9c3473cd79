"""GGUF's Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q3_K, Q2_K, IQ4_NL and IQ4_XS blocks served as blocks: repacked by the loader's
path (kernels/gguf_blocks.py), the weight they stand for is gguf's `dequantize` to the bit, and every product equals,
bit for bit, a reference built from gguf's `dequantize` alone (gguf_blocks_ref.py) and computed in the kernels' order
of operations, for every row count and however rows are split between threads.

The kernels' order, per row and output (csrc/linear_kernels.h): for each group in order, its inputs' products in
one running sum (float32 products: even and odd inputs in two sums, added at the group's end; bfloat16 products, the
portable loops: one sum over the inputs in order, each a fused multiply-add), then Y = fma(sum, scale, Y) and, with
offsets, Y = fma(the group's sum of inputs, offset, Y). Fused multiply-adds are emulated exactly in float64 (round
to odd, then to float32)."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks_ref import FORMATS, KParts, Reference, fma, random_blocks, reference
from gguf_blocks_ref import stacked as stacked_reference

from lmrpc.kernels import gguf_blocks, native, packed_rows, packing
from lmrpc.kernels.packing import Compute, PackedWeight

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels do not build here")

ROWS = [*range(1, 41), 48, 64, 97]


def reference_product(ref: Reference, x: np.ndarray, bf16: bool) -> np.ndarray:
    """y [m, n] as the kernels compute x @ W.T over the codes, scales and offsets gguf's dequantize gave."""
    m, k = x.shape
    n, group = ref.codes.shape[0], ref.group
    w = ref.codes.astype(np.float32)  # [n, k]
    y = np.zeros((m, n), np.float32)
    s = np.zeros((m, n), np.float32)  # K-quants: the super-block's sums times sc
    for g in range(k // group):
        cols = range(g * group, (g + 1) * group)
        if bf16:
            acc = np.zeros((m, n), np.float32)
            for j in cols:
                acc = fma(x[:, j : j + 1], w[None, :, j], acc)
        else:
            even, odd = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)
            for j in cols:
                if j % 2 == 0:
                    even = fma(w[None, :, j], x[:, j : j + 1], even)
                else:
                    odd = fma(w[None, :, j], x[:, j : j + 1], odd)
            acc = even + odd
        if ref.parts is not None:
            s = fma(acc, ref.parts.sc[None, :, g], s)
            if (g + 1) % ref.parts.super_groups == 0:
                y = _fold_super_block(ref.parts, x, group, g, s, y)
                s = np.zeros((m, n), np.float32)
            continue
        y = fma(acc, ref.scale[None, :, g], y)
        if ref.offset is not None:
            y = fma(np.broadcast_to(_group_sum(x, group, g), (m, n)), ref.offset[None, :, g], y)
    return y


def _group_sum(x: np.ndarray, group: int, g: int) -> np.ndarray:
    """[m, 1] float32: group g's inputs summed in order."""
    total = np.zeros((x.shape[0], 1), np.float32)
    for j in range(g * group, (g + 1) * group):
        total = total + x[:, j : j + 1]
    return total


def _fold_super_block(parts: KParts, x: np.ndarray, group: int, g: int, s: np.ndarray, y: np.ndarray) -> np.ndarray:
    """y after the K-scaled super-block whose last group is g: y = fma(s, d, y), then y = -(M * dmin) + y with
    M = fma(group sum, m, M) over its groups in order."""
    sb = g // parts.super_groups
    y = fma(s, parts.d[None, :, sb], y)
    if parts.dmin is None or parts.m is None:
        return y
    total = np.zeros_like(y)
    for j in range(g + 1 - parts.super_groups, g + 1):
        total = fma(np.broadcast_to(_group_sum(x, group, j), y.shape), parts.m[None, :, j], total)
    return fma(-total, parts.dmin[None, :, sb], y)


def kernel(p: PackedWeight, compute: Compute) -> Any:
    p = gguf_blocks.held_for(p, compute == Compute.BF16)  # as the server holds it (IQ4: Q8 for float32 compute)
    ks = p.kscales
    extra = {} if ks is None else {"kd": ks.d, "kdmin": ks.dmin, "ksc": ks.sc, "km": ks.m,
                                   "super_groups": ks.super_groups, "sc_signed": ks.sc.dtype == torch.int8,
                                   "d_scale": ks.d_scale}
    return native.load().PackedLinear(int(p.format), int(compute), p.n, p.k, p.group, p.q4_signed, p.data, p.scale,
                                      p.offset, None, code_values=list(p.code_values or ()), **extra)


def load(fmt: str, n: int, k: int, seed: int = 0) -> tuple[PackedWeight, Reference]:
    raw = random_blocks(fmt, n, k, seed)
    return gguf_blocks.pack_gguf(int(FORMATS[fmt]), raw, n, k), reference(fmt, raw, n, k)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_loaded_weight_is_ggufs_dequantize_to_the_bit(fmt: str) -> None:
    n, k = 72, 512
    p, ref = load(fmt, n, k)
    assert p.label == fmt
    assert np.array_equal(packing.dequantize(p).numpy(), ref.values)
    # Rows read back for embedding lookups (a tied weight) are the same values.
    ids = torch.tensor([0, 31, 32, 71])
    for compute in Compute:
        assert np.array_equal(kernel(p, compute).rows(ids).numpy(), ref.values[ids.numpy()]), compute
    # Stacked with another weight (fused qkv) and rows permuted (llama.cpp's q/k order): the same codes and scales.
    other, other_ref = load(fmt, 40, k, seed=1)
    stacked = packed_rows.concat_rows([p, other])
    assert stacked.label == fmt
    assert np.array_equal(packing.dequantize(stacked).numpy(), np.concatenate([ref.values, other_ref.values]))
    order = torch.randperm(112, generator=torch.Generator().manual_seed(2))
    permuted = packed_rows.permute_rows(stacked, order)
    assert torch.equal(packing.dequantize(permuted), packing.dequantize(stacked)[order])


def same_weight(a: PackedWeight, b: PackedWeight) -> bool:
    """Bit for bit the same packed weight: shape, format and every stored tensor."""
    def tensors(p: PackedWeight) -> list[torch.Tensor | None]:
        ks = p.kscales
        return [p.data, p.scale, p.offset, *([ks.d, ks.dmin, ks.sc, ks.m] if ks else [])]

    return (a.n, a.k, a.group, a.label, a.q4_signed) == (b.n, b.k, b.group, b.label, b.q4_signed) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(tensors(a), tensors(b), strict=True))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_load_shortcuts_give_the_weight_the_long_way_gives(fmt: str) -> None:
    """At load, parts of whole tile pairs are stacked tile for tile and q/k rows are permuted in the file's bytes
    before packing: the same weights as unpacking and packing the codes again."""
    k = 256
    q, _ = load(fmt, 64, k)
    kv, _ = load(fmt, 32, k, seed=1)
    last, _ = load(fmt, 40, k, seed=2)  # the last part may end in a partial tile pair
    parts = [q, kv, last]
    assert same_weight(packed_rows.concat_rows(parts), packed_rows.concat_repacked(parts))
    assert not same_weight(packed_rows.concat_rows(parts), packed_rows.concat_repacked([q, last, kv]))
    raw = random_blocks(fmt, 64, k, 3)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(4))
    ggml = int(FORMATS[fmt])
    assert same_weight(gguf_blocks.pack_gguf(ggml, raw.reshape(64, -1)[order.numpy()], 64, k),
                       packed_rows.permute_rows(gguf_blocks.pack_gguf(ggml, raw, 64, k), order))


@pytest.mark.parametrize("ggml_type", [gguf_blocks.Q4_0, gguf_blocks.Q4_1, gguf_blocks.Q4_K])
def test_4_bit_blocks_go_straight_into_the_layout_pack_q4_makes_of_their_codes(ggml_type: int) -> None:
    """The loader shuffles 4-bit blocks' bytes into the kernels' layout without a byte per code; the same weight as
    packing the codes (read the plain way, a nibble at a time), padding rows included (n = 40 of 64)."""
    n, k = 40, 256
    rng = np.random.default_rng(ggml_type)
    elements, nbytes = gguf_blocks.BLOCK[ggml_type]
    b = rng.integers(0, 256, (n, k // elements, nbytes), dtype=np.uint8)
    b[..., 0:4] = rng.uniform(1e-4, 2e-3, (n, k // elements, 2)).astype(np.float16).view(np.uint8)
    fast = gguf_blocks.pack_gguf(ggml_type, b.reshape(n, -1), n, k)
    if ggml_type == gguf_blocks.Q4_K:  # group 2j: the low nibbles of the j-th 32 code bytes, 2j + 1 the high ones
        qs = b[..., 16:144].reshape(n, -1, 4, 1, 32)
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)
        assert fast.kscales is not None
        slow = packing.pack_k(packing.WeightFormat.Q4, torch.from_numpy(codes), 32, fast.kscales, "q4_k")
    else:  # element i: the low nibble of byte i, element i + 16 its high nibble
        at = 4 if ggml_type == gguf_blocks.Q4_1 else 2
        qs = b[..., at:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        halves = b[..., 0:4].copy().view(np.float16).astype(np.float32)  # [n, groups, 2]: d, m
        d, m = torch.from_numpy(halves[..., 0]), torch.from_numpy(halves[..., 1])
        slow = packing.pack_q4(torch.from_numpy(codes), d, m if ggml_type == gguf_blocks.Q4_1 else None)
    assert same_weight(fast, slow)


def test_bits_per_weight_stay_near_the_files() -> None:
    # Q4_K, the bulk of a Q4_K_M file, keeps 4-bit codes and its scales as stored: 4.625 bits a weight (file 4.5);
    # Q6_K 6-bit codes (Q6) and its scales as stored (the file's 6.5625); the 5-bit formats 5-bit codes (Q5), the 2-
    # and 3-bit K-quants 3-bit codes (Q3), both 6-bit ones for float32 compute; the IQ4s keep their 4-bit codes (Q4,
    # a table turning them into values), and their table's int8 values (Q8) for float32 compute.
    n, k = 64, 1024
    q3, q4, q5, q6, q8 = (packing.WeightFormat.Q3, packing.WeightFormat.Q4, packing.WeightFormat.Q5,
                          packing.WeightFormat.Q6, packing.WeightFormat.Q8)
    for fmt, (most, layout) in {"q4_k": (4.625, q4), "q6_k": (6.5625, q6), "q5_k": (5.625, q5), "q5_0": (5.5, q5),
                                "q5_1": (6.0, q5), "q3_k": (3.5625, q3), "q2_k": (4.125, q3), "iq4_nl": (4.5, q4),
                                "iq4_xs": (4.3125, q4)}.items():
        p, _ = load(fmt, n, k)
        assert p.nbytes * 8 / (n * k) <= most, fmt
        assert p.format == layout, fmt
        assert gguf_blocks.held_for(p, bf16=True) is p, fmt
        wide = gguf_blocks.held_for(p, bf16=False)
        widened = {"q3_k": (q6, 3), "q2_k": (q6, 3), "q5_k": (q6, 1), "q5_0": (q6, 1), "q5_1": (q6, 1),
                   "iq4_nl": (q8, 4), "iq4_xs": (q8, 4)}
        if fmt in widened:
            assert wide.format == widened[fmt][0], fmt
            assert wide.nbytes * 8 / (n * k) <= most + widened[fmt][1], fmt
            assert torch.equal(packing.dequantize(wide), packing.dequantize(p)), fmt
        else:
            assert wide is p, fmt


def test_the_6_bit_layout_holds_every_code_and_refuses_wider_ones() -> None:
    # Every code -32..31 at every position of a few units survives the 6-bit layout; the kernels read the same
    # values from it as from the 8-bit layout (products of one and many rows, bit for bit)
    codes = torch.arange(64 * 256, dtype=torch.int64).remainder(64).sub(32).view(64, 256)
    codes = codes[torch.randperm(64, generator=torch.Generator().manual_seed(0))].to(torch.int8)
    scale = torch.rand(64, 256 // 32, generator=torch.Generator().manual_seed(1)) + 0.5
    q8 = packing.pack_q8(codes, scale, 32)
    q6 = packing.narrow(q8, packing.WeightFormat.Q6)
    assert q6.data.numel() * 8 == 6 * q8.data.numel()
    assert torch.equal(packing.codes_of(q6), codes)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2))
    for m in (1, 2, 9):
        assert torch.equal(kernel(q6, Compute.F32).forward(x[:m]), kernel(q8, Compute.F32).forward(x[:m])), m
    ids = torch.tensor([0, 31, 63])
    assert torch.equal(kernel(q6, Compute.F32).rows(ids), kernel(q8, Compute.F32).rows(ids))
    with pytest.raises(ValueError, match=r"-32\.\.31"):
        packing.narrow(packing.pack_q8(codes.clamp(-32, 31).index_fill(1, torch.tensor([5]), 32), scale, 32),
                       packing.WeightFormat.Q6)


NARROW = {"q3": (-4, 3, lambda p: packing.narrow(p, packing.WeightFormat.Q3)),
          "q5": (0, 31, lambda p: packing.narrow(p, packing.WeightFormat.Q5)),
          "q5_signed": (-16, 15, lambda p: packing.narrow(p, packing.WeightFormat.Q5, signed=True))}


@pytest.mark.parametrize("layout", sorted(NARROW))
def test_the_3_and_5_bit_layouts_hold_every_code_and_give_the_6_bit_layouts_products(layout: str) -> None:
    # Every code of the layout's range at every position of a few blocks survives it and its widening to 6 bits; the
    # bfloat16 products over it (one row and blocks of many, one and two threads: each route the kernels take) equal
    # those over the same codes in 6 bits, bit for bit, with and without offsets; float32 compute refuses it (the
    # loader widens it, held_for).
    lo, hi, narrow = NARROW[layout]
    bits = 3 if layout == "q3" else 5
    # (random, not a pattern along k: a block's vectors are two tiles' rows of the same inputs, and codes that depend
    # on the input alone would hide a vector decoded from another's bits)
    codes = torch.randint(lo, hi + 1, (64, 256), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    assert torch.equal(codes.unique(), torch.arange(lo, hi + 1, dtype=torch.int8))
    scale = torch.rand(64, 256 // 16, generator=torch.Generator().manual_seed(1)) + 0.5
    offset = torch.rand(64, 256 // 16, generator=torch.Generator().manual_seed(4)) - 0.5
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    for off in (None, offset):
        q8 = packing.pack_q8(codes, scale, 16, off)
        small, q6 = narrow(q8), packing.narrow(q8, packing.WeightFormat.Q6)  # (every range here lies in Q6's -32..31)
        assert small.data.numel() * 8 == bits * q8.data.numel()
        assert torch.equal(packing.codes_of(small), codes)
        assert torch.equal(packing.as_q6(small).data, q6.data)
        a, b = kernel(small, Compute.BF16), kernel(q6, Compute.BF16)
        try:
            for count in (1, threads):
                torch.set_num_threads(count)
                for m in (1, 2, 5, 6, 7, 13, 40):
                    assert torch.equal(a.forward(x[:m]), b.forward(x[:m])), (m, count)
        finally:
            torch.set_num_threads(threads)
        ids = torch.tensor([0, 31, 63])
        assert torch.equal(a.rows(ids), b.rows(ids))
        with pytest.raises(RuntimeError, match="take bfloat16 products"):
            native.load().PackedLinear(int(small.format), int(Compute.F32), small.n, small.k, small.group,
                                       small.q4_signed, small.data, small.scale, small.offset, None)
    with pytest.raises(ValueError, match=rf"{lo}\.\.{hi}"):
        narrow(packing.pack_q8(codes.index_fill(1, torch.tensor([5]), hi + 1), scale, 16))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("compute", [Compute.F32, Compute.BF16], ids=["f32", "bf16"])
def test_products_equal_the_reference_bitwise_for_every_row_count_and_split(fmt: str, compute: Compute) -> None:
    # 64 outputs (2 tile pairs): one block of pairs, so with two threads the rows are split between work items in
    # uneven chunks; 100 outputs: padded tiles and blocks of different sizes.
    for n, k in ((64, 512), (100, 256)):
        p, ref = load(fmt, n, k, seed=n)
        assert_products_match(kernel(p, compute), ref, k, compute == Compute.BF16)


def assert_products_match(lin: Any, ref: Reference, k: int, bf16: bool) -> None:
    """lin's products of the first m of 97 random rows equal reference_product's bit for bit for every m in ROWS
    (and rows alone), on one thread and on all. AVX512-BF16 dot products round differently from the reference's
    fused multiply-adds: there the reference is met within 1e-4 and the bits must agree across row counts and
    splits."""
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k))
    xin = x.bfloat16().float() if bf16 else x
    expected = reference_product(ref, xin.numpy(), bf16)
    if bf16 and native.load().native_bf16():
        torch.testing.assert_close(lin.forward(x), torch.from_numpy(expected), atol=1e-4, rtol=1e-4)
        expected = lin.forward(x).numpy()
    threads = torch.get_num_threads()
    try:
        for count in (1, threads):
            torch.set_num_threads(count)
            for m in ROWS:
                assert np.array_equal(lin.forward(x[:m]).numpy(), expected[:m]), (m, count)
            for i in (0, 13, 96):  # a row alone
                assert np.array_equal(lin.forward(x[i : i + 1]).numpy(), expected[i : i + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("small", ["q4_k", "q5_k"])
def test_parts_of_different_formats_stack_into_one_product_each_part_as_alone(small: str) -> None:
    # Q4_K_M stores some layers' v projection in Q6_K beside q and k in Q4_K: the fused qkv product keeps q and k
    # (stacked, one Q4_K part) and v (a Q6_K part) in their own formats and computes each part's columns exactly as
    # that part alone does, which is its reference's product, for every row count and thread count.
    from lmrpc.server.models.quantized import LinearBuilder, Quantization, StackedLinear
    from lmrpc.server.models.weights import RowParts, stack_rows

    k = 512
    parts = [load(small, 64, k, seed=5), load(small, 32, k, seed=6), load("q6_k", 32, k, seed=7)]
    stacked = stack_rows([p for p, _ in parts])
    assert isinstance(stacked, RowParts) and [p.label for p in stacked.parts] == [small, "q6_k"]
    assert [p.n for p in stacked.parts] == [96, 32] and stacked.n == 128
    values = np.concatenate([r.values for _, r in parts])
    assert np.array_equal(stacked.dense().numpy(), values)

    first = stacked_reference([r for _, r in parts[:2]])
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(8))
    residual = torch.randn(40, 128, generator=torch.Generator().manual_seed(9))
    bias = torch.randn(128, generator=torch.Generator().manual_seed(10))
    expected = np.concatenate([reference_product(first, x.numpy(), bf16=False),
                               reference_product(parts[2][1], x.numpy(), bf16=False)], axis=1)
    builder = LinearBuilder(Quantization.AUTO, torch.float32, torch.device("cpu"), native=True)
    lin = builder.build(stacked)
    assert isinstance(lin, StackedLinear) and lin.labels == (small, "q6_k") and lin.out_features == 128
    with_bias = builder.build(stacked, bias)
    alone = [builder.build(p, bias[a:b]) for p, (a, b) in zip(stacked.parts, ((0, 96), (96, 128)), strict=True)]
    threads = torch.get_num_threads()
    try:
        for count in (1, threads):
            torch.set_num_threads(count)
            for m in (1, 2, 7, 9, 40):
                assert np.array_equal(lin(x[:m]).numpy(), expected[:m]), (m, count)
                # a bias and a residual: each part's columns as that part alone gives them
                y = with_bias(x[:m], residual=residual[:m])
                assert torch.equal(y[:, :96], alone[0](x[:m], residual=residual[:m, :96])), (m, count)
                assert torch.equal(y[:, 96:], alone[1](x[:m], residual=residual[:m, 96:])), (m, count)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(TypeError, match="embedding"):
        lin.rows(torch.tensor([0]))


def test_dense_builders_serve_stacked_parts_as_their_values() -> None:
    from lmrpc.server.models.quantized import LinearBuilder, Quantization
    from lmrpc.server.models.weights import stack_rows

    parts = [load("q4_k", 32, 256, seed=1), load("q6_k", 32, 256, seed=2)]
    stacked = stack_rows([p for p, _ in parts])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    values = torch.from_numpy(np.concatenate([r.values for _, r in parts]))
    for quantization in (Quantization.NONE, Quantization.AUTO):
        lin = LinearBuilder(quantization, torch.float32, torch.device("cpu"), native=False).build(stacked)
        torch.testing.assert_close(lin(x), x @ values.T)


def test_super_blocks_of_other_than_a_power_of_two_groups_are_refused() -> None:
    # The kernels find a group's super-block by a shift (KScales::super_shift), so a count they would misread is
    # refused where the weight is made. 768 inputs: 24 groups of 32, whole super-blocks of 8 or of 3.
    p, _ = load("q4_k", 64, 768)
    ks = p.kscales
    assert ks is not None and ks.super_groups == 8
    kernel(p, Compute.BF16)
    with pytest.raises(RuntimeError, match="power of two"):
        native.load().PackedLinear(int(p.format), int(Compute.BF16), p.n, p.k, p.group, p.q4_signed, p.data, p.scale,
                                   p.offset, None, kd=ks.d, kdmin=ks.dmin, ksc=ks.sc, km=ks.m, super_groups=3)


def _bytes(t: torch.Tensor | None) -> bytes | None:
    return None if t is None else t.contiguous().view(torch.uint8).numpy().tobytes()


def _all_bytes(p: PackedWeight) -> list[bytes | None]:
    ks = p.kscales
    return [_bytes(p.data), _bytes(p.scale), _bytes(p.offset),
            *([None] * 4 if ks is None else [_bytes(ks.d), _bytes(ks.dmin), _bytes(ks.sc), _bytes(ks.m)])]


@pytest.mark.parametrize("fmt", [*sorted(FORMATS), "q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("n", [64, 65, 100, 130])
def test_a_weight_packed_in_row_chunks_is_the_weight_packed_whole(fmt: str, n: int) -> None:
    """The loader packs a large tensor 2048 rows at a time (its decoding temporaries bounded by a chunk); chunks of
    32 rows here, the last partial or whole: every packed byte equals packing the tensor at once."""
    k = 512
    if fmt in FORMATS:
        raw = random_blocks(fmt, n, k, seed=3)
        kind = int(FORMATS[fmt])
    else:
        kind = int(getattr(gguf.GGMLQuantizationType, fmt.upper()))
        values = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32)
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType(kind))
    whole = gguf_blocks.pack_gguf(kind, raw, n, k, chunk_rows=4096)
    chunked = gguf_blocks.pack_gguf(kind, raw, n, k, chunk_rows=32)
    assert (chunked.n, chunked.k, chunked.format, chunked.label) == (whole.n, whole.k, whole.format, whole.label)
    assert _all_bytes(chunked) == _all_bytes(whole)
