"""GGUF's grid and ternary formats (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0) held exactly in
wider codes (kernels/gguf_grids.py): the weight is gguf's `dequantize` to the bit, and every product equals, bit for
bit, the reference product of test_gguf_formats over that weight's codes and K-scales, for every row count and
however rows are split between threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks_ref import GRID_FORMATS, KParts, Reference, random_grid_blocks
from test_gguf_formats import assert_products_match, kernel

from lmrpc.kernels import gguf_blocks, gguf_grids, native, packed_rows, packing
from lmrpc.kernels.packing import Compute, PackedWeight, WeightFormat

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels do not build here")


def load(fmt: str, n: int, k: int, seed: int = 0) -> tuple[PackedWeight, np.ndarray]:
    """The packed weight and gguf's dequantize of the same random blocks."""
    qtype = GRID_FORMATS[fmt][0]
    raw = random_grid_blocks(fmt, n, k, seed)
    values = np.asarray(gguf_grids.gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(n, k)
    return gguf_blocks.pack_gguf(int(qtype), raw, n, k), values


def reference_of(p: PackedWeight, values: np.ndarray) -> Reference:
    """The codes (values) and K-scales p holds, once they are shown to give gguf's values to the bit."""
    assert p.kscales is not None
    d, _, sc, _ = packing.kscale_rows(p.kscales, p.n)
    d32 = d.float().numpy() * np.float32(p.kscales.d_scale)  # [n, supers] (a power of two: exact)
    sc32 = sc.float().numpy()  # [n, groups]
    scale = np.repeat(d32, p.kscales.super_groups, axis=1) * sc32
    codes = packing.values_of(p).float().numpy()  # [n, k]: the codes, or the values of a table they index
    assert np.array_equal(codes * np.repeat(scale, p.group, axis=1), values)
    return Reference(values, codes, scale, None, p.group, KParts(d32, sc32, None, None, p.kscales.super_groups))


@pytest.mark.parametrize("fmt", sorted(GRID_FORMATS))
def test_the_loaded_weight_is_ggufs_dequantize_to_the_bit(fmt: str) -> None:
    n, k = 72, 512
    p, values = load(fmt, n, k)
    assert p.label == fmt
    # indices into a table of the values (as IQ4's): 4-bit with a scale per 32 weights, 3-bit per 16; TQ: the codes
    assert (p.code_values is not None) == (fmt not in ("tq1_0", "tq2_0"))
    # 16 values (IQ3) need 4 bits; 6 values (IQ2, IQ1) and TQ's codes fit 3
    assert p.format == (WeightFormat.Q4 if fmt in ("iq3_xxs", "iq3_s") else WeightFormat.Q3)
    # bits a weight held (codes, d per 256, sc per group): Q4 4 + 1/16 + 1/4, Q3 3 + 1/16 + 8 / group
    assert 8 * p.nbytes / (p.n_pad * p.k_pad) == (4.3125 if p.format == WeightFormat.Q4 else 3.0625 + 8 / p.group)
    assert np.array_equal(packing.dequantize(p).numpy(), values)
    reference_of(p, values)
    ids = torch.tensor([0, 31, 32, 71])  # rows read back for embedding lookups (a tied weight)
    for compute in Compute:
        assert np.array_equal(kernel(p, compute).rows(ids).numpy(), values[ids.numpy()]), compute
    other, other_values = load(fmt, 40, k, seed=1)  # stacked (fused qkv) and rows permuted (llama.cpp's q/k order)
    stacked = packed_rows.concat_rows([p, other])
    assert np.array_equal(packing.dequantize(stacked).numpy(), np.concatenate([values, other_values]))
    order = torch.randperm(112, generator=torch.Generator().manual_seed(2))
    assert torch.equal(packing.dequantize(packed_rows.permute_rows(stacked, order)),
                       packing.dequantize(stacked)[order])


@pytest.mark.parametrize("fmt", sorted(GRID_FORMATS))
@pytest.mark.parametrize("compute", [Compute.F32, Compute.BF16], ids=["f32", "bf16"])
def test_products_equal_the_reference_bitwise_for_every_row_count_and_split(fmt: str, compute: Compute) -> None:
    for n, k in ((64, 512), (100, 256)):  # (as test_gguf_formats: uneven row splits, padded tiles)
        p, values = load(fmt, n, k, seed=n)
        assert_products_match(kernel(p, compute), reference_of(p, values), k, compute == Compute.BF16)


def test_a_scale_no_code_layout_gives_exactly_is_refused_and_the_weight_served_dense() -> None:
    raw = random_grid_blocks("iq2_xxs", 32, 256, seed=3).reshape(32, 1, 66).copy()
    raw[5, 0, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # d = inf: inf * 0 is not a code times d
    with pytest.raises(gguf_grids.NotExact, match="iq2_xxs"):
        gguf_blocks.pack_gguf(int(GRID_FORMATS["iq2_xxs"][0]), raw.reshape(32, -1), 32, 256)


def test_codes_that_do_not_give_ggufs_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first row of every tensor is checked against gguf's dequantize: a grid read in another order than the
    file's (as a block layout grid_codes does not know would be) is refused, not served wrong."""
    table, ksigns = gguf_grids._tables(int(GRID_FORMATS["iq3_s"][0]))
    shuffled = table.reshape(-1, 4).flip(0).reshape(-1).contiguous()
    monkeypatch.setattr(gguf_grids, "_tables", lambda ggml_type: (shuffled, ksigns))
    raw = random_grid_blocks("iq3_s", 32, 256, seed=4)
    with pytest.raises(gguf_grids.NotExact, match="iq3_s: codes that do not give gguf's values"):
        gguf_blocks.pack_gguf(int(GRID_FORMATS["iq3_s"][0]), raw, 32, 256)


def test_the_decoder_refuses_arguments_it_cannot_read() -> None:
    """csrc/grid_codes.cpp reads blocks of the type's width and a grid of the type's size: anything else is an error
    at the binding, before a byte is read."""
    ops = native.load()
    qtype = int(GRID_FORMATS["iq3_s"][0])
    table, ksigns = gguf_grids._tables(qtype)
    blocks = torch.from_numpy(random_grid_blocks("iq3_s", 2, 256, seed=5).copy())  # [2, 110]
    assert ops.grid_codes(blocks, qtype, table, ksigns).shape == (2, 256)
    with pytest.raises(RuntimeError, match="not a grid or ternary ggml type: 12"):
        ops.grid_codes(blocks, 12, table, ksigns)  # Q4_K
    with pytest.raises(RuntimeError, match=r"blocks must be contiguous uint8 \[blocks, 110\]"):
        ops.grid_codes(blocks[:, :100].contiguous(), qtype, table, ksigns)
    with pytest.raises(RuntimeError, match="the grid must be 2048 contiguous int8"):
        ops.grid_codes(blocks, qtype, table[:100], ksigns)
    with pytest.raises(RuntimeError, match="lookup must be 256 contiguous uint8"):
        ops.grid_q4_pairs(blocks, qtype, table, ksigns, torch.zeros(16, dtype=torch.uint8))
    lookup = gguf_grids._lookup("iq3_s")
    with pytest.raises(RuntimeError, match="grid_indices: lookup must be 256 contiguous uint8"):
        ops.grid_indices(blocks, qtype, table, ksigns, lookup[:16].contiguous(), 4)
    with pytest.raises(RuntimeError, match=r"grid_indices: bias must be 0\.\.15"):
        ops.grid_indices(blocks, qtype, table, ksigns, lookup, 16)
    # the indices a byte each (less the bias) pick the codes back out of the table; a code it lacks is counted
    codes = ops.grid_codes(blocks, qtype, table, ksigns)
    index, missing = ops.grid_indices(blocks, qtype, table, ksigns, lookup, 4)
    assert missing == 0 and torch.equal(packing.table_values(index + 4, packing.Q4_TABLES["iq3_s"]), codes)
    lacking = lookup.clone()
    lacking[int(codes[0, 0]) & 255] = 255
    assert ops.grid_indices(blocks, qtype, table, ksigns, lacking, 4)[1] == int((codes == codes[0, 0]).sum())


def test_without_the_native_decoder_a_grid_tensor_is_left_to_be_served_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native kernels do not build, pack refuses with DecoderUnavailable (a NotExact: the loader reads
    the tensor through gguf's dequantize instead), never a half-built weight."""
    monkeypatch.setattr(gguf_grids.native, "available", lambda: False)
    raw = random_grid_blocks("iq2_xxs", 32, 256, seed=6)
    with pytest.raises(gguf_grids.DecoderUnavailable, match="iq2_xxs: the native kernels that read its codes"):
        gguf_blocks.pack_gguf(int(GRID_FORMATS["iq2_xxs"][0]), raw, 32, 256)
    assert issubclass(gguf_grids.DecoderUnavailable, gguf_grids.NotExact)
