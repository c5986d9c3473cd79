"""A GGUF tensor's blocks in the native kernels' layouts (packing.py), code for code, never dequantized.

Each format's values are exactly those of gguf's `dequantize` (the reference; the tests compare bit for bit):

| ggml type | block | held as | value | bits per weight (file) |
| --- | --- | --- | --- | --- |
| Q4_0 | 32: fp16 d, 4-bit q | Q4, fp16 scale | (q - 8) * d | 4.5 (4.5) |
| Q4_1 | 32: fp16 d, m, 4-bit q | Q4, fp16 scale and offset | q * d + m | 5 (5) |
| Q8_0 | 32: fp16 d, int8 q | Q8, fp16 scale | q * d | 8.5 (8.5) |
| Q5_0 | 32: fp16 d, 5-bit q | Q6 (q - 16), fp16 scale | (q - 16) * d | 6.5 (5.5) |
| Q5_1 | 32: fp16 d, m, 5-bit q | Q6 (q), fp16 scale and offset | q * d + m | 7 (6) |
| Q4_K | 256: fp16 d, dmin; 8 x (6-bit sc, m, 32 x 4-bit q) | Q4, KScales | q * (d * sc) - dmin * m | 4.625 (4.5) |
| Q5_K | 256: as Q4_K with 5-bit q | Q6 (q), KScales | q * (d * sc) - dmin * m | 6.625 (5.5) |
| Q6_K | 256: fp16 d; 16 x (int8 sc, 16 x 6-bit q) | Q6 (q - 32), KScales (16s) | (q - 32) * (d * sc) | 6.56 (6.56) |

Q5_0, Q5_1, Q5_K and Q6_K hold their codes in 6 bits (packing.py's Q6: the products decode them into Q8's vectors
a group at a time), so a Q5_K_M file's bulk takes 6.6 bits a weight against the file's 5.5, and Q4_K_M's Q6_K
tensors (the output projection, some v and down projections) their own size.

Everything here is numpy/torch on the host, run once per tensor at load, 2048 rows at a time (CHUNK_ROWS). The 4-bit
formats (Q4_0, Q4_1, Q4_K: the bulk of most files) go from their blocks' bytes to the kernels' layout by 32-bit word
operations (`_q4_chunks`), never a byte per code: a 1.7B Q4_0 file packs in about 4 s here instead of 15.
"""

from __future__ import annotations

import numpy as np
import torch

from lmrpc.kernels import packing
from lmrpc.kernels.packing import PackedWeight, WeightFormat

# ggml type ids
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (256, 144),
         Q5_K: (256, 176), Q6_K: (256, 210)}  # per ggml type: (elements, bytes) of a block
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
    """A GGUF tensor's blocks (uint8, n rows of k / block elements * block bytes) in the kernels' layout."""
    if ggml_type not in BLOCK:
        raise ValueError(f"no kernel for ggml type {ggml_type}")
    elements, nbytes = BLOCK[ggml_type]
    if k % elements:
        raise ValueError(f"ggml type {ggml_type} needs k divisible by {elements}, got {k}")
    assert chunk_rows % packing.PAIR_TILES == 0
    b = raw.reshape(n, k // elements, nbytes)  # a view of the mapped file: each chunk is copied once, below
    pack = _pack_32 if elements == 32 else _pack_k
    chunks = [pack(ggml_type, np.ascontiguousarray(b[r : r + chunk_rows]), min(chunk_rows, n - r), k)
              for r in range(0, n, chunk_rows)]
    return chunks[0] if len(chunks) == 1 else packing.concat_tiled_rows(chunks)


def _pack_32(ggml_type: int, b: np.ndarray, n: int, k: int) -> PackedWeight:
    """Blocks of 32 with an fp16 scale (and offset) each."""
    with_min = ggml_type in (Q4_1, Q5_1)
    at = 4 if with_min else 2
    if ggml_type in (Q4_0, Q4_1):  # element i: low nibble of byte i, element i + 16: its high nibble
        qs = np.ascontiguousarray(b[..., at:]).reshape(n, -1, 4, 4)  # [n, groups, c mod 4, 4 bytes]
        chunks = np.concatenate([_q4_chunks(qs, False), _q4_chunks(qs, True)], axis=2)  # [n, groups, 8] uint16
        data = packing.q4_tiles(torch.from_numpy(chunks.view(np.uint8).reshape(n, -1, 8, 2)), signed=not with_min)
        return packing.pack_q4_tiled(data, n, k, _fp16(b[..., 0:2]), _fp16(b[..., 2:4]) if with_min else None)
    d = _halves(b[..., 0:2])  # [n, groups]
    if ggml_type == Q8_0:
        return packing.pack_q8(_tensor(b[..., 2:].view(np.int8), n, k, torch.int8), d, 32)
    m = _halves(b[..., 2:4]) if with_min else None
    high = _bits(b[..., at : at + 4], 8).transpose(0, 1, 3, 2).reshape(n, -1, 32)  # bit i of the LE word: element i
    q = _nibbles(b[..., at + 4 :]).reshape(n, -1, 32) | (high << 4)  # 0..31
    if ggml_type == Q5_0:
        return packing.to_q6(packing.pack_q8(_tensor(q.astype(np.int8) - 16, n, k, torch.int8), d, 32, name="q5_0"))
    return packing.to_q6(packing.pack_q8(_tensor(q.astype(np.int8), n, k, torch.int8), d, 32, m, name="q5_1"))


def _pack_k(ggml_type: int, b: np.ndarray, n: int, k: int) -> PackedWeight:
    """Super-blocks of 256 with their scales as stored (packing.KScales)."""
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
    return packing.pack_k(WeightFormat.Q6, _tensor(q.astype(np.int8), n, k, torch.int8), 32, ks, "q5_k")
