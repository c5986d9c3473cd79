"""Q8's int8 codes held in fewer bits, when every code of a weight lies in a narrow range (csrc/linear.h's layouts):
6 bits (Q6, codes -32..31: four vectors of 32 in 96 bytes), 5 bits (Q5, 0..31 or -16..15: sixteen vectors in 320
bytes, three codes to a 16-bit word) and 3 bits (Q3, -4..3: sixteen in 192 bytes, five to a word). Each takes Q8's
tiled data [pairs, kpairs, 2, 16, 2] and gives it back from the narrow form, code for code; packing.py makes weights
of them."""

from __future__ import annotations

import torch

from lmrpc.kernels.tiles import TILE


def q6_data(q8: torch.Tensor) -> torch.Tensor:
    """Q8 data [pairs, kpairs, 2, 16, 2] (codes -32..31) -> the Q6 layout [pairs, kpairs / 2, 3, 32] uint8: per
    four Q8 vectors, the low 4 bits of vectors 0 and 1 (low and high nibbles), of 2 and 3, then the top 2 bits of
    vector i in bits 2i, 2i + 1; each code as q + 32."""
    if q8.numel() and (int(q8.min()) < -32 or int(q8.max()) > 31):
        raise ValueError("Q6 holds codes -32..31")
    u = (q8.to(torch.int16) + 32).to(torch.uint8).view(q8.shape[0], -1, 4, 32)  # [pairs, units, vector, byte]
    low, top = u & 0x0F, u >> 4
    return torch.stack([low[:, :, 0] | (low[:, :, 1] << 4), low[:, :, 2] | (low[:, :, 3] << 4),
                        top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)], dim=2)


def q8_of_q6(data: torch.Tensor) -> torch.Tensor:
    """The inverse of q6_data: [pairs, kpairs, 2, 16, 2] int8."""
    a, b, h = data[:, :, 0], data[:, :, 1], data[:, :, 2]
    vectors = [(a & 0x0F), (a >> 4), (b & 0x0F), (b >> 4)]
    u = torch.stack([v | (((h >> (2 * i)) & 3) << 4) for i, v in enumerate(vectors)], dim=2)
    return (u.to(torch.int16) - 32).to(torch.int8).view(data.shape[0], -1, 2, TILE, 2)


def _word_lines(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes u [pairs, blocks, 16 vectors, 32 lanes] (int16, 0..2^bits - 1) -> `bits` lines of 32 little-endian
    16-bit words per block, [pairs, blocks * 64 * bits] uint8: word l of line j holds lane l of vector per * j + s in
    bits bits * s.. (per = 15 // bits codes a word) and bit j of lane l of vector 15 in bit 15 (int16 throughout: a
    2048 x 8192 chunk's temporaries stay small at load)."""
    per = 15 // bits
    lines = [sum(u[:, :, per * j + s] << (bits * s) for s in range(per)) | (((u[:, :, 15] >> j) & 1) << 15)
             for j in range(bits)]
    return torch.stack(lines, dim=2).view(torch.uint8).view(u.shape[0], -1, 64 * bits)  # (x86: little-endian)


def _word_codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of _word_lines: [pairs, blocks, 16, 32] int16 codes."""
    per, mask = 15 // bits, (1 << bits) - 1
    words = data.contiguous().view(torch.int16).view(data.shape[0], -1, bits, 32)  # [pairs, blocks, line, lane]
    top = (words >> 15) & 1  # bit j of vector 15's codes (an arithmetic shift: the mask keeps bit 0)
    vectors = [(words[:, :, i // per] >> (bits * (i % per))) & mask for i in range(15)]
    last = top[:, :, 0]
    for j in range(1, bits):
        last = last | (top[:, :, j] << j)
    vectors.append(last)
    return torch.stack(vectors, dim=2)


def _check_range(q8: torch.Tensor, lo: int, hi: int, name: str) -> None:
    if q8.numel() and (int(q8.min()) < lo or int(q8.max()) > hi):
        raise ValueError(f"{name} holds codes {lo}..{hi}")


def q3_data(q8: torch.Tensor) -> torch.Tensor:
    """Q8 data [pairs, kpairs, 2, 16, 2] (codes -4..3, kpairs a multiple of 8) -> the Q3 layout [pairs, kpairs / 8,
    192] uint8: per 16 Q8 vectors, three lines of 32 16-bit words, five codes a word (_word_lines); each code as
    q + 4."""
    _check_range(q8, -4, 3, "Q3")
    return _word_lines((q8.to(torch.int16) + 4).view(q8.shape[0], -1, 16, 32), 3)


def q8_of_q3(data: torch.Tensor) -> torch.Tensor:
    """The inverse of q3_data: [pairs, kpairs, 2, 16, 2] int8."""
    return (_word_codes(data, 3) - 4).to(torch.int8).view(data.shape[0], -1, 2, TILE, 2)


def q5_data(q8: torch.Tensor, signed: bool) -> torch.Tensor:
    """Q8 data [pairs, kpairs, 2, 16, 2] (codes 0..31, or -16..15 if signed; kpairs a multiple of 8) -> the Q5 layout
    [pairs, kpairs / 8, 320] uint8: per 16 Q8 vectors, five lines of 32 16-bit words, three codes a word
    (_word_lines); codes + 16 if signed."""
    lo = -16 if signed else 0
    _check_range(q8, lo, lo + 31, "Q5")
    return _word_lines((q8.to(torch.int16) - lo).view(q8.shape[0], -1, 16, 32), 5)


def q8_of_q5(data: torch.Tensor, signed: bool) -> torch.Tensor:
    """The inverse of q5_data: [pairs, kpairs, 2, 16, 2] int8."""
    return (_word_codes(data, 5) - (16 if signed else 0)).to(torch.int8).view(data.shape[0], -1, 2, TILE, 2)
