"""A GGUF tensor's blocks in the native kernels' layouts (packing.py), code for code, never dequantized.

Each format's values are exactly those of gguf's `dequantize` (the reference; the tests compare bit for bit):

| ggml type | block | held as | value | bits per weight (file) |
| --- | --- | --- | --- | --- |
| Q4_0 | 32: fp16 d, 4-bit q | Q4, fp16 scale | (q - 8) * d | 4.5 (4.5) |
| Q4_1 | 32: fp16 d, m, 4-bit q | Q4, fp16 scale and offset | q * d + m | 5 (5) |
| Q8_0 | 32: fp16 d, int8 q | Q8, fp16 scale | q * d | 8.5 (8.5) |
| Q5_0 | 32: fp16 d, 5-bit q | Q5 (q, signed: q - 16), fp16 scale | (q - 16) * d | 5.5 (5.5) |
| Q5_1 | 32: fp16 d, m, 5-bit q | Q5 (q), fp16 scale and offset | q * d + m | 6 (6) |
| Q4_K | 256: fp16 d, dmin; 8 x (6-bit sc, m, 32 x 4-bit q) | Q4, KScales | q * (d * sc) - dmin * m | 4.625 (4.5) |
| Q5_K | 256: as Q4_K with 5-bit q | Q5 (q), KScales | q * (d * sc) - dmin * m | 5.625 (5.5) |
| Q6_K | 256: fp16 d; 16 x (int8 sc, 16 x 6-bit q) | Q6 (q - 32), KScales (16s) | (q - 32) * (d * sc) | 6.56 (6.56) |
| Q3_K | 256: fp16 d; 16 x (6-bit sc, 3-bit q) | Q3 (q - 4), KScales (16s) | (q - 4) * (d * (sc-32)) | 3.56 (3.44) |
| Q2_K | 256: fp16 d, dmin; 16 x (4-bit sc, m; q) | Q3 (q), KScales (16s) | q * (d * sc) - dmin * m | 4.13 (2.63) |
| IQ4_NL | 32: fp16 d, 4-bit index i | Q4 (i: table T), fp16 scale | T[i] * d | 4.5 (4.5) |
| IQ4_XS | 256: fp16 d; 8 x (6-bit sc, 32 x 4-bit i) | Q4 (i: table T), KScales | T[i] * (d * (sc - 32)) | 4.31 (4.25) |

The grid and ternary formats (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0) are held exactly in
wider codes with K-scales: gguf_grids.py.

Q6_K holds its codes in 6 bits (packing.py's Q6: the products decode them into Q8's vectors), so Q4_K_M's Q6_K
tensors (the output projection, some v and down projections) take their own size; Q5_0, Q5_1 and Q5_K hold theirs in
5 bits (Q5) and Q3_K and Q2_K in 3 (Q3), decoded like Q6's into the same products, for bfloat16 products; for
float32 compute (`held_for`) in Q6's 6 bits, whose float32 and int16 kernels they then share. IQ4_NL and IQ4_XS
index a table T of 16 int8 values (gguf's `IQ4_NL.kvalues`): held as their 4-bit codes in the Q4 layout, which
bfloat16 products turn into values through that table (csrc's Q4Table) as they do Q4_0's q - 8; for float32 compute
(`held_for`) as the table's int8 values in the Q8 layout, value for value the same weight.

Everything here is numpy/torch on the host, run once per tensor at load, 2048 rows at a time (CHUNK_ROWS). The 4-bit
formats (Q4_0, Q4_1, Q4_K: the bulk of most files) go from their blocks' bytes to the kernels' layout by 32-bit word
operations (`_q4_chunks`), never a byte per code: a 1.7B Q4_0 file packs in about 4 s here instead of 15.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from lmrpc.kernels import gguf_grids, packed_rows, packing
from lmrpc.kernels.packing import PackedWeight, WeightFormat

# ggml type ids
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23
BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), Q2_K: (256, 84),
         Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), IQ4_NL: (32, 18),
         IQ4_XS: (256, 136), **gguf_grids.BLOCK}  # per ggml type: (elements, bytes) of a block
SUPPORTED = frozenset(BLOCK)


def _halves(raw: np.ndarray) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> float32 [...] (exact)."""
    return _fp16(raw).float()


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., b] bytes -> [..., 2, b]: low nibbles, then high nibbles."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[..., b] bytes -> [..., count, b]: bit i of each byte in row i."""
    return (qh[..., None, :] >> np.arange(count, dtype=np.uint8)[:, None]) & 1


def _fp16(raw: np.ndarray) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> float16 [...] as stored."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0])


def _q4_chunks(qs: np.ndarray, high_nibbles: bool) -> np.ndarray:
    """packing.q4_tiles' bytes, two codes a byte, from the bytes holding a group's codes in their low or high nibbles:
    qs [..., 8 c, 4] with byte 2h + e holding code 4c + 2h + e (after 16 when high). Read as little-endian words
    (lo0 | lo1 << 8 | hi0 << 16 | hi1 << 24), a chunk c is the 16-bit word (code 4c) | (code 4c + 2) << 4 over its
    two bytes e: one pass of word operations over the block's bytes, never a byte per code."""
    w = np.ascontiguousarray(qs).view(np.uint32)[..., 0]  # [..., 8]
    out = ((w >> 4) & 0x0F0F) | ((w >> 16) & 0xF0F0) if high_nibbles else (w & 0x0F0F) | ((w >> 12) & 0xF0F0)
    return out.astype(np.uint16)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes [..., 12] -> 6-bit sc and m [..., 8]: sub-blocks 0-3 in the low 6 bits of bytes
    0-3 (sc) and 4-7 (m); sub-blocks 4-7 in the nibbles of bytes 8-11, their top 2 bits in the top bits of 0-7."""
    lo_sc, lo_m, mix = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (mix & 0x0F) | ((lo_sc >> 2) & 0x30)], axis=-1)
    m = np.concatenate([lo_m & 0x3F, (mix >> 4) | ((lo_m >> 2) & 0x30)], axis=-1)
    return sc, m


def _tensor(a: np.ndarray, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).reshape(n, k).to(dtype)


# Rows packed at once: a large tensor (a 49152-row embedding) is packed in chunks of this many rows, so the
# temporaries of decoding its blocks (several bytes per weight) never exist for the whole tensor at once.
CHUNK_ROWS = 2048  # a whole number of tile pairs (packing.PAIR_TILES)


def pack_gguf(ggml_type: int, raw: np.ndarray, n: int, k: int, chunk_rows: int = CHUNK_ROWS) -> PackedWeight:
    """A GGUF tensor's blocks (uint8, n rows of k / block elements * block bytes) in the kernels' layout. A grid
    format whose values the held layout cannot give exactly raises gguf_grids.NotExact."""
    if ggml_type not in BLOCK:
        raise ValueError(f"no kernel for ggml type {ggml_type}")
    elements, nbytes = BLOCK[ggml_type]
    if k % elements:
        raise ValueError(f"ggml type {ggml_type} needs k divisible by {elements}, got {k}")
    assert chunk_rows % packing.PAIR_TILES == 0
    b = raw.reshape(n, k // elements, nbytes)  # a view of the mapped file: each chunk is copied once, below
    pack = _pack_32 if elements == 32 else gguf_grids.pack if ggml_type in gguf_grids.GRIDS else _pack_k
    chunks = [pack(ggml_type, np.ascontiguousarray(b[r : r + chunk_rows]), min(chunk_rows, n - r), k)
              for r in range(0, n, chunk_rows)]
    return chunks[0] if len(chunks) == 1 else packed_rows.concat_tiled_rows(chunks)


def _pack_32(ggml_type: int, b: np.ndarray, n: int, k: int) -> PackedWeight:
    """Blocks of 32 with an fp16 scale (and offset) each."""
    with_min = ggml_type in (Q4_1, Q5_1)
    at = 4 if with_min else 2
    if ggml_type in (Q4_0, Q4_1, IQ4_NL):  # element i: low nibble of byte i, element i + 16: its high nibble
        data = _q4_group_tiles(b[..., at:], n, signed=ggml_type == Q4_0)
        if ggml_type == IQ4_NL:  # codes index the table, never offset by 8
            return replace(packing.pack_q4_tiled(data, n, k, _fp16(b[..., 0:2]), None, name="iq4_nl"), q4_signed=False)
        return packing.pack_q4_tiled(data, n, k, _fp16(b[..., 0:2]), _fp16(b[..., 2:4]) if with_min else None)
    d = _halves(b[..., 0:2])  # [n, groups]
    if ggml_type == Q8_0:
        return packing.pack_q8(_tensor(b[..., 2:].view(np.int8), n, k, torch.int8), d, 32)
    m = _halves(b[..., 2:4]) if with_min else None
    high = _bits(b[..., at : at + 4], 8).transpose(0, 1, 3, 2).reshape(n, -1, 32)  # bit i of the LE word: element i
    q = _nibbles(b[..., at + 4 :]).reshape(n, -1, 32) | (high << 4)  # 0..31
    if ggml_type == Q5_0:
        q8 = packing.pack_q8(_tensor(q.astype(np.int8) - 16, n, k, torch.int8), d, 32, name="q5_0")
        return packing.narrow(q8, WeightFormat.Q5, signed=True)
    q8 = packing.pack_q8(_tensor(q.astype(np.int8), n, k, torch.int8), d, 32, m, name="q5_1")
    return packing.narrow(q8, WeightFormat.Q5)


def _q4_group_tiles(qs: np.ndarray, n: int, signed: bool) -> torch.Tensor:
    """The Q4 layout from groups of 32 codes held as Q4_0 holds them (per group 16 bytes [..., 16]: element i in the
    low nibble of byte i, element i + 16 in its high nibble)."""
    q = np.ascontiguousarray(qs).reshape(n, -1, 4, 4)  # [n, groups, c mod 4, 4 bytes]
    chunks = np.concatenate([_q4_chunks(q, False), _q4_chunks(q, True)], axis=2)  # [n, groups, 8] uint16
    return packing.q4_tiles(torch.from_numpy(chunks.view(np.uint8).reshape(n, -1, 8, 2)), signed=signed)


def held_for(p: PackedWeight, bf16: bool) -> PackedWeight:
    """The weight as products of this compute type take it. For float32 compute: a Q4 or Q3 weight whose codes index
    a table (IQ4, grid formats: packing.code_values), whose kernels take codes as linear, as its table's int8 values
    in the Q8 layout (the same weight, more bytes); another Q3 or Q5 weight in Q6's layout (its float32 and int16
    kernels). Anything else, and everything for bfloat16 compute, as it is."""
    if bf16:
        return p
    if p.code_values is None:
        return packing.as_q6(p) if p.format in (WeightFormat.Q3, WeightFormat.Q5) else p
    values = packing.values_of(p)  # [n, k] int8
    if p.kscales is not None:
        return packing.pack_k(WeightFormat.Q8, values, p.group, p.kscales, p.label)
    assert p.scale is not None
    return packing.pack_q8(values, packing.per_group(p.scale, p.n), p.group, name=p.label)


def _pack_k(ggml_type: int, b: np.ndarray, n: int, k: int) -> PackedWeight:
    """Super-blocks of 256 with their scales as stored (packing.KScales)."""
    if ggml_type in _PACK_K:
        return _PACK_K[ggml_type](b, n, k)
    if ggml_type == Q6_K:
        ql, qh, sc = b[..., 0:128], b[..., 128:192], b[..., 192:208].view(np.int8)
        d = _halves(b[..., 208:210])  # [n, supers]
        # Per half of 128: elements 0-63 the low nibbles of its 64 ql bytes, 64-127 the high ones; the top 2 bits of
        # element 32 s + i in bits 2s, 2s + 1 of its qh byte i.
        low = _nibbles(ql.reshape(n, -1, 2, 64)).reshape(n, -1, 2, 128)
        top = ((qh.reshape(n, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(n, -1, 2, 128)
        q = (low | (top << 4)).astype(np.int8) - 32
        ks = packing.pack_kscales(d, None, _tensor(sc, n, k // 16, torch.int8), None, 16)
        return packing.pack_k(WeightFormat.Q6, _tensor(q, n, k, torch.int8), 16, ks, "q6_k")
    d, dmin = _halves(b[..., 0:2]), _halves(b[..., 2:4])
    sc, m = _k_scale_min(b[..., 4:16])
    qs = b[..., 16:144] if ggml_type == Q4_K else b[..., 48:176]
    ks = packing.pack_kscales(d, dmin, _tensor(sc, n, k // 32, torch.uint8), _tensor(m, n, k // 32, torch.uint8), 8)
    # sub-block (group) 2j: low nibbles of the j-th 32 bytes; 2j + 1: their high nibbles
    if ggml_type == Q4_K:
        qb = np.ascontiguousarray(qs).reshape(n, -1, 4, 8, 4)  # [n, supers, j, c, 4 bytes]
        chunks = np.stack([_q4_chunks(qb, False), _q4_chunks(qb, True)], axis=3)  # [n, supers, j, 2, 8] uint16
        data = packing.q4_tiles(torch.from_numpy(chunks.view(np.uint8).reshape(n, -1, 8, 2)), signed=False)
        return packing.pack_k_tiled(WeightFormat.Q4, data, n, k, 32, ks, "q4_k")
    q = _nibbles(qs.reshape(n, -1, 4, 32)).reshape(n, -1, 8, 32)
    q = q | (_bits(b[..., 16:48], 8) << 4)  # bit j of byte i: the fifth bit of sub-block j's element i
    return packing.pack_k(WeightFormat.Q5, _tensor(q.astype(np.int8), n, k, torch.int8), 32, ks, "q5_k")


def _two_bits(qs: np.ndarray, n: int) -> np.ndarray:
    """Q2_K's and Q3_K's 2-bit codes: [n, supers, 64] bytes -> [n, supers, 256] (0..3). Per half of 128 elements,
    element 32 j + l is bits 2j, 2j + 1 of the half's byte l."""
    shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]
    return ((qs.reshape(n, -1, 2, 1, 32) >> shifts) & 3).reshape(n, -1, 256)


def _pack_q3_k(b: np.ndarray, n: int, k: int) -> PackedWeight:
    """Q3_K: hmask [32], qs [64], scales [12], d. Element 32 i + l (i = 0..7 over both halves): its two bits as
    Q2_K's, minus 4 unless bit i of hmask byte l is set. Group g's 6-bit scale, less 32: the low 4 bits are byte g's
    low nibble (g < 8) or byte g - 8's high one, the top 2 are bits 2 (g // 4), 2 (g // 4) + 1 of byte 8 + g % 4."""
    hmask, qs, scales = b[..., 0:32], b[..., 32:96], b[..., 96:108]
    d = _halves(b[..., 108:110])  # [n, supers]
    high = _bits(hmask, 8).reshape(n, -1, 256)  # bit i of byte l: element 32 i + l
    q = _two_bits(qs, n).astype(np.int8) - 4 * (1 - high.astype(np.int8))  # -4..3
    low = _nibbles(scales[..., 0:8]).reshape(n, -1, 16)  # i < 8: low nibble of byte i; then the high nibbles
    top = (scales[..., 8:12].reshape(n, -1, 1, 4) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    sc = (low | (top.reshape(n, -1, 16) << 4)).astype(np.int8) - 32
    ks = packing.pack_kscales(d, None, _tensor(sc, n, k // 16, torch.int8), None, 16)
    return packing.pack_k(WeightFormat.Q3, _tensor(q, n, k, torch.int8), 16, ks, "q3_k")


def _pack_q2_k(b: np.ndarray, n: int, k: int) -> PackedWeight:
    """Q2_K: scales [16] (group i: sc in the low nibble of byte i, m in the high one), qs [64], d, dmin."""
    scales, qs = b[..., 0:16], b[..., 16:80]
    d, dmin = _halves(b[..., 80:82]), _halves(b[..., 82:84])
    ks = packing.pack_kscales(d, dmin, _tensor(scales & 0x0F, n, k // 16, torch.uint8),
                              _tensor(scales >> 4, n, k // 16, torch.uint8), 16)
    return packing.pack_k(WeightFormat.Q3, _tensor(_two_bits(qs, n).astype(np.int8), n, k, torch.int8), 16, ks,
                          "q2_k")


def _pack_iq4_xs(b: np.ndarray, n: int, k: int) -> PackedWeight:
    """IQ4_XS: d, scales_h (a little-endian uint16: bits 2i, 2i + 1 the top of group i's scale), scales_l [4]
    (group i's low 4 bits: byte i // 2, low nibble first), qs [128] (group g: 16 bytes, elements j and j + 16 in the
    low and high nibbles of byte j)."""
    d = _halves(b[..., 0:2])  # [n, supers]
    scales_h = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)  # [n, supers, 1]
    low = _nibbles(b[..., 4:8]).transpose(0, 1, 3, 2).reshape(n, -1, 8)  # group 2j + e: nibble e of byte j
    top = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, supers, 8]
    sc = (low | (top.astype(np.uint8) << 4)).astype(np.int8) - 32
    ks = packing.pack_kscales(d, None, _tensor(sc, n, k // 32, torch.int8), None, 8)
    data = _q4_group_tiles(b[..., 8:136].reshape(n, -1, 16), n, signed=False)
    return packing.pack_k_tiled(WeightFormat.Q4, data, n, k, 32, ks, "iq4_xs")


# the super-block formats with a packer of their own
_PACK_K = {Q3_K: _pack_q3_k, Q2_K: _pack_q2_k, IQ4_XS: _pack_iq4_xs}
