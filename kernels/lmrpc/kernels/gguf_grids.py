"""GGUF's grid and ternary formats (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0) held exactly in
wider codes the kernels already multiply, instead of dequantized to bf16 or float32 at load.

These formats pick each group of 4 or 8 weights from a table (a grid) of small integers, with signs and a per-group
scale of the form d * (2 s + 1) * 2^-e. Every value is therefore an integer code times d' * sc, with d' = d * 2^-e per
super-block and sc = 2 s + 1 per group: the K-quant form (packing.KScales) of a wider code layout. d stays the file's
fp16 (d / 8 often would not be one); the power of two is KScales.d_scale, which the kernels apply to their results.

| ggml type | value (gguf's `dequantize`) | held as | d', sc | bits a weight (file) |
| --- | --- | --- | --- | --- |
| IQ2_XXS | d (0.5 + s) / 4 * grid * sign, grid: 8, 25, 43 | Q3, a table of the 6 values | d / 8, 2s + 1 | 3.31 (2.06) |
| IQ2_XS, IQ2_S | the same, sc per 16 weights | Q3, a table of the 6 values | d / 8, 2s + 1 | 3.56 (2.31-2.56) |
| IQ3_XXS | d (0.5 + s) / 2 * grid * sign, grid: 4, 12 .. 62 | Q4, a table of grid / 2 | d / 2, 2s + 1 | 4.31 (3.06) |
| IQ3_S | d (1 + 2s) * grid * sign, grid: 1, 3, ..., 15 | Q4, a table of 16 values | d, 2s + 1 | 4.31 (3.44) |
| IQ1_S | d (2s + 1) * (grid +- 1/8), grid: -1, 0, 1 | Q3, a table of 8 grid +- 1 | d / 8, 2s + 1 | 3.31 (1.56) |
| IQ1_M | the same, sc per 16 weights | Q3, a table of the 6 values | d / 8, 2s + 1 | 3.56 (1.75) |
| TQ1_0, TQ2_0 | d * q, q: -1, 0, 1 (TQ2_0: also 2) | Q3 | d, 1 | 3.31 (1.69-2.06) |

The IQ2 and IQ1 formats take 6 distinct codes: held as 3-bit indices into a table of them in Q3's layout
(packing.Q3_TABLES), which bfloat16 products look up as they do IQ4's (csrc's Q4Table). The IQ3 formats take 16:
4-bit indices in Q4's (packing.Q4_TABLES). (A 1.7B-shaped IQ2_XXS file's one-stream decode step, engine alone:
28 ms in 3 bits against 35-37 in 4; IQ2_XS's and IQ1_M's sc per 16 weights have no place in Q4's layout at all.)

The codes are read from the blocks' bits by csrc/grid_codes.cpp, with the gguf package's own grid tables scaled to code
units (no tables of ours): a few hundred byte operations a block, where gguf's float `dequantize` and a division took
seconds per large tensor. Where codes are held as table indices, it writes those (grid_q4_pairs: as Q4's code pairs;
grid_indices: a byte each, for Q3) and counts the codes the table lacks. Every value is code * d' * sc exactly (an fp16
times a power of two, a 5-bit integer and a grid value: exact in float32, as gguf computes it). A tensor is held this
way only if its d are finite, its codes are in its table (or, TQ, in Q3's range), and its first row gives gguf's
`dequantize` of it to the bit (a guard against a block layout grid_codes does not read; the tests compare every row);
else NotExact, and the loader serves it dense, as before. They take more bytes than the file (1.25-2.1x), a fifth to a
quarter of bf16's: exact products from the kernels the other formats use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from lmrpc.kernels import native, packing
from lmrpc.kernels.packing import PackedWeight, WeightFormat

# ggml type ids
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M, TQ1_0, TQ2_0 = 16, 17, 18, 19, 21, 22, 29, 34, 35
# the codes Q3 holds as themselves (TQ; the other grid formats are held as indices into a table of their values)
_Q3_RANGE = (-4, 3)


class NotExact(ValueError):
    """A tensor not held in its layout's codes: values that are not all integer codes times d' * sc (a d that is not
    finite, say), or no native decoder here to read the codes (DecoderUnavailable). The loader serves it dense."""


class DecoderUnavailable(NotExact):
    """The native kernels, whose grid_codes reads the codes, do not build here (a machine without a compiler)."""


@dataclass(frozen=True)
class Grid:
    """How one format's blocks give d' and sc (the codes come from gguf's dequantize)."""

    label: str  # the format's name as GetModelInfo lists it
    block_bytes: int  # bytes of a block of 256 weights
    held: WeightFormat  # the code layout the values are held in
    group: int  # weights per sc (16 or 32)
    exponent: int  # d' = d * 2^-exponent
    unit: float  # a grid value's code: IQ3_XXS's grid / 2, IQ1's 8 grid (+-1 for the delta, added by grid_codes)
    scales: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # blocks [..., bytes] -> d [...], s [..., groups]


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian fp16 bytes -> float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _u16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.uint16)


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.uint32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """[..., m] bytes -> [..., 2m]: each byte's low nibble, then its high one."""
    return np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)


def _iq1_m_d(b: np.ndarray) -> np.ndarray:
    """IQ1_M's d: the top nibbles of its four scale words, lowest first, are the bits of an fp16."""
    w = _u16(b[..., 48:56]) >> 12  # [..., 4]
    bits = (w[..., 0] | (w[..., 1] << 4) | (w[..., 2] << 8) | (w[..., 3] << 12)).astype(np.uint16)
    return bits.view(np.float16).astype(np.float32)


def _shifted(words: np.ndarray, shifts: tuple[int, ...], mask: int) -> np.ndarray:
    """[..., w] words -> [..., w * len(shifts)]: (word >> shift) & mask, each word's shifts in order."""
    return ((words[..., None] >> np.array(shifts, dtype=words.dtype)) & mask).reshape(*words.shape[:-1], -1)


GRIDS = {
    IQ2_XXS: Grid("iq2_xxs", 66, WeightFormat.Q3, 32, 3, 1,
                  lambda b: (_f16(b[..., 0:2]), _u32(b[..., 2:66]).reshape(*b.shape[:-1], 8, 2)[..., 1] >> 28)),
    IQ2_XS: Grid("iq2_xs", 74, WeightFormat.Q3, 16, 3, 1, lambda b: (_f16(b[..., 0:2]), _nibbles(b[..., 66:74]))),
    IQ2_S: Grid("iq2_s", 82, WeightFormat.Q3, 16, 3, 1, lambda b: (_f16(b[..., 0:2]), _nibbles(b[..., 74:82]))),
    IQ3_XXS: Grid("iq3_xxs", 98, WeightFormat.Q4, 32, 1, 0.5, lambda b: (_f16(b[..., 0:2]), _u32(b[..., 66:98]) >> 28)),
    IQ3_S: Grid("iq3_s", 110, WeightFormat.Q4, 32, 0, 1, lambda b: (_f16(b[..., 0:2]), _nibbles(b[..., 106:110]))),
    IQ1_S: Grid("iq1_s", 50, WeightFormat.Q3, 32, 3, 8,
                lambda b: (_f16(b[..., 0:2]), (_u16(b[..., 34:50]) >> 12) & 7)),
    IQ1_M: Grid("iq1_m", 56, WeightFormat.Q3, 16, 3, 8,
                lambda b: (_iq1_m_d(b), _shifted(_u16(b[..., 48:56]), (0, 3, 6, 9), 7))),
    # (no scale of their own: s = 0, so sc = 2s + 1 = 1)
    TQ1_0: Grid("tq1_0", 54, WeightFormat.Q3, 32, 0, 1,
                lambda b: (_f16(b[..., 52:54]), np.zeros((*b.shape[:-1], 8), np.uint8))),
    TQ2_0: Grid("tq2_0", 66, WeightFormat.Q3, 32, 0, 1,
                lambda b: (_f16(b[..., 64:66]), np.zeros((*b.shape[:-1], 8), np.uint8))),
}
BLOCK = {t: (256, g.block_bytes) for t, g in GRIDS.items()}  # per ggml type: (elements, bytes) of a block


def pack(ggml_type: int, b: np.ndarray, n: int, k: int) -> PackedWeight:
    """Blocks [n, k / 256, bytes] of a grid format -> its weight in the held layout with K-scales d (times
    2^-exponent: KScales.d_scale) and sc."""
    grid = GRIDS[ggml_type]
    d, s = grid.scales(b)  # [n, supers] (fp16 values), [n, supers, groups a super-block]
    if not np.isfinite(d).all():
        raise NotExact(f"{grid.label}: a d that is not finite")
    sc = (2 * s.astype(np.int32) + 1).reshape(n, -1)  # [n, groups]
    d_scale = 2.0 ** -grid.exponent
    if not native.available():
        raise DecoderUnavailable(f"{grid.label}: the native kernels that read its codes are unavailable here")
    table, ksigns = _tables(ggml_type)
    # (a copy: the chunk may be a read-only view of the mapped file, which torch will not wrap)
    blocks = torch.from_numpy(b.reshape(-1, grid.block_bytes).copy())  # [n * k / 256, bytes]
    ks = packing.pack_kscales(torch.from_numpy(d), None, torch.from_numpy(sc.astype(np.uint8)), None,
                              256 // grid.group, d_scale)
    if grid.held == WeightFormat.Q4:  # 4-bit indices into the format's table of values (packing.Q4_TABLES)
        pairs, missing = native.load().grid_q4_pairs(blocks, ggml_type, table, ksigns, _lookup(grid.label))
        if missing:
            raise NotExact(f"{grid.label}: codes outside its table")
        first = pairs[: k // 256].reshape(-1, 8, 1, 2)  # row 0's bytes [groups, c, 1, e]
        first_index = torch.cat([first & 15, first >> 4], dim=2).reshape(1, k)  # code 4c + 2 nibble + e
        first_codes = packing.table_values(first_index, packing.Q4_TABLES[grid.label])
        _check_first_row(ggml_type, b, first_codes, d * np.float32(d_scale), sc)
        data = packing.q4_tiles(pairs.reshape(n, -1, 8, 2), signed=False)
        return packing.pack_k_tiled(WeightFormat.Q4, data, n, k, grid.group, ks, grid.label)
    assert grid.held == WeightFormat.Q3
    values = packing.Q3_TABLES.get(grid.label)
    if values is not None:  # 3-bit indices into the format's table of values (packing.Q3_TABLES), stored as q + 4
        codes, missing = native.load().grid_indices(blocks, ggml_type, table, ksigns, _lookup(grid.label), 4)
        if missing:
            raise NotExact(f"{grid.label}: codes outside its table")
        codes = codes.reshape(n, k)  # int8 [n, k]: index - 4
        first_codes = packing.table_values(codes[:1] + 4, values)
    else:
        codes = first_codes = native.load().grid_codes(blocks, ggml_type, table, ksigns).reshape(n, k)  # int8 [n, k]
        if int(codes.min()) < _Q3_RANGE[0] or int(codes.max()) > _Q3_RANGE[1]:
            raise NotExact(f"{grid.label}: codes outside Q3's range")
    _check_first_row(ggml_type, b, first_codes[:1], d * np.float32(d_scale), sc)
    return packing.pack_k(grid.held, codes, grid.group, ks, grid.label)


@functools.cache
def _lookup(label: str) -> torch.Tensor:
    """A code's byte -> its first index in the format's table of values (packing.Q4_TABLES or Q3_TABLES), or 255."""
    lookup = torch.full((256,), 255, dtype=torch.uint8)
    values = packing.Q4_TABLES.get(label) or packing.Q3_TABLES[label]
    for i, v in reversed(list(enumerate(values))):
        lookup[v & 255] = i
    return lookup


@functools.cache
def _tables(ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A format's grid in code units (int8 [entries * width], from the gguf package's own table; empty for TQ) and
    the 128 sign bytes by 7-bit index that IQ2_XXS, IQ2_XS and IQ3_XXS use."""
    quant = getattr(gguf.quants, gguf.GGMLQuantizationType(ggml_type).name)
    ksigns = torch.frombuffer(bytearray(gguf.quants.IQ2_XXS.ksigns), dtype=torch.uint8)
    if quant.grid_hex is None:
        return torch.empty(0, dtype=torch.int8), ksigns
    quant.init_grid()
    values = np.asarray(quant.grid, dtype=np.float32).reshape(-1) * np.float32(GRIDS[ggml_type].unit)
    codes = values.astype(np.int8)
    assert np.array_equal(codes, values), "a grid value that is not an integer in code units"
    return torch.from_numpy(codes), ksigns


def _check_first_row(ggml_type: int, b: np.ndarray, codes: torch.Tensor, d: np.ndarray, sc: np.ndarray) -> None:
    """The first row's codes ([1, k]) times d' * sc must give gguf's own dequantize of it to the bit: a guard against a
    block layout that differs from the one grid_codes reads (the tests compare every row)."""
    grid = GRIDS[ggml_type]
    values = np.asarray(gguf.quants.dequantize(b[0].reshape(-1), gguf.GGMLQuantizationType(ggml_type)),
                        dtype=np.float32)  # [k]
    factor = np.repeat(np.repeat(d[0], 256 // grid.group) * sc[0].astype(np.float32), grid.group)  # [k]
    if not np.array_equal(codes[0].numpy().astype(np.float32) * factor, values):
        raise NotExact(f"{grid.label}: codes that do not give gguf's values")
