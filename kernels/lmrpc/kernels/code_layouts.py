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


def q3_data(q8: torch.Tensor) -> torch.Tensor:
    """Q8 data [pairs, kpairs, 2, 16, 2] (codes -4..3, kpairs a multiple of 8) -> the Q3 layout [pairs, kpairs / 8,
    192] uint8: per 16 Q8 vectors, three lines of 32 little-endian 16-bit words, word l of line j holding lane l of
    vector 5j + s in bits 3s..3s + 2 and bit j of lane l of vector 15 in bit 15; each code as q + 4."""
    if q8.numel() and (int(q8.min()) < -4 or int(q8.max()) > 3):
        raise ValueError("Q3 holds codes -4..3")
    u = (q8.to(torch.int32) + 4).view(q8.shape[0], -1, 16, 32)  # [pairs, blocks, vector, lane]
    lines = [sum(u[:, :, 5 * j + s] << (3 * s) for s in range(5)) | (((u[:, :, 15] >> j) & 1) << 15)
             for j in range(3)]
    words = torch.stack(lines, dim=2)  # [pairs, blocks, line, lane] 0..65535
    return torch.stack([words & 0xFF, words >> 8], dim=4).to(torch.uint8).view(q8.shape[0], -1, 192)


def q8_of_q3(data: torch.Tensor) -> torch.Tensor:
    """The inverse of q3_data: [pairs, kpairs, 2, 16, 2] int8."""
    b = data.view(data.shape[0], -1, 3, 32, 2).to(torch.int32)
    words = b[..., 0] | (b[..., 1] << 8)  # [pairs, blocks, line, lane]
    top = (words >> 15) & 1  # [pairs, blocks, line, lane]: bit j of vector 15's codes
    vectors = [(words[:, :, i // 5] >> (3 * (i % 5))) & 7 for i in range(15)]
    vectors.append(top[:, :, 0] | (top[:, :, 1] << 1) | (top[:, :, 2] << 2))
    u = torch.stack(vectors, dim=2)  # [pairs, blocks, vector, lane]
    return (u - 4).to(torch.int8).view(data.shape[0], -1, 2, TILE, 2)


def q5_data(q8: torch.Tensor, signed: bool) -> torch.Tensor:
    """Q8 data [pairs, kpairs, 2, 16, 2] (codes 0..31, or -16..15 if signed; kpairs a multiple of 8) -> the Q5 layout
    [pairs, kpairs / 8, 320] uint8: per 16 Q8 vectors, five lines of 32 little-endian 16-bit words, word l of line j
    holding lane l of vector 3j + s in bits 5s..5s + 4 and bit j of lane l of vector 15 in bit 15 (codes + 16 if
    signed)."""
    lo = -16 if signed else 0
    if q8.numel() and (int(q8.min()) < lo or int(q8.max()) > lo + 31):
        raise ValueError(f"Q5 holds codes {lo}..{lo + 31}")
    u = (q8.to(torch.int32) - lo).view(q8.shape[0], -1, 16, 32)  # [pairs, blocks, vector, lane]
    lines = [sum(u[:, :, 3 * j + s] << (5 * s) for s in range(3)) | (((u[:, :, 15] >> j) & 1) << 15)
             for j in range(5)]
    words = torch.stack(lines, dim=2)  # [pairs, blocks, line, lane] 0..65535
    return torch.stack([words & 0xFF, words >> 8], dim=4).to(torch.uint8).view(q8.shape[0], -1, 320)


def q8_of_q5(data: torch.Tensor, signed: bool) -> torch.Tensor:
    """The inverse of q5_data: [pairs, kpairs, 2, 16, 2] int8."""
    b = data.view(data.shape[0], -1, 5, 32, 2).to(torch.int32)
    words = b[..., 0] | (b[..., 1] << 8)  # [pairs, blocks, line, lane]
    top = (words >> 15) & 1  # bit j of vector 15's codes
    vectors = [(words[:, :, i // 3] >> (5 * (i % 3))) & 31 for i in range(15)]
    vectors.append(top[:, :, 0] | (top[:, :, 1] << 1) | (top[:, :, 2] << 2) | (top[:, :, 3] << 3) | (top[:, :, 4] << 4))
    u = torch.stack(vectors, dim=2)  # [pairs, blocks, vector, lane]
    return (u - (16 if signed else 0)).to(torch.int8).view(data.shape[0], -1, 2, TILE, 2)
