"""Weights in the native kernels' tiled layout (csrc/linear.h): dense, quantized by us, or GGUF blocks as they are.

A weight [n, k] is stored in tiles of 16 outputs, tiles in pairs (n padded to a multiple of 32), over pairs of inputs
("kpairs"; k padded to a multiple of 4, or of the group size when quantized). A tile pair's data is one contiguous
run, kpair by kpair (both tiles' vectors side by side), so a thread reading it streams one sequential range.
Quantized weights keep integer codes with float32 scales (and offsets) per group of inputs:

- Q4: 4-bit codes in groups of 32, value `(q - 8) * scale` (GGUF Q4_0, "signed") or `q * scale + offset` (Q4_1 and
  our own asymmetric int4). A GGUF file's Q4_0/Q4_1 blocks are repacked code for code, never dequantized, so a
  model is served with exactly its own weights.
- Q8: signed 8-bit codes, value `q * scale`, in groups of 32 (GGUF Q8_0) or one group per output row (our own int8
  per-channel quantization).

Everything here is plain torch on the host, run once at load.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import numpy as np
import torch

TILE = 16  # outputs per tile
MIN_SCALE = 2.0**-24  # the smallest positive float16: a group of zeros keeps a non-zero scale
PAIR_TILES = 32  # n is padded to whole tile pairs
Q4_GROUP = 32


class WeightFormat(enum.IntEnum):
    F32 = 0
    BF16 = 1
    Q4 = 2
    Q8 = 3


class Compute(enum.IntEnum):
    """How activations enter products: float32, or rounded to bfloat16 (AVX512-BF16 dot products)."""

    F32 = 0
    BF16 = 1


@dataclass(frozen=True)
class PackedWeight:
    """A weight [n, k] in the kernels' layout (see the module doc)."""

    format: WeightFormat
    n: int  # output features
    k: int  # input features
    group: int  # quantized: inputs per scale group; dense: the padded k
    q4_signed: bool  # Q4 codes are offset by 8 (GGUF Q4_0) instead of carrying offsets
    data: torch.Tensor  # packed codes or values (uint8, int8, bfloat16 or float32)
    scale: torch.Tensor | None  # [n_pad / 32, groups, 2, 16] float16 (quantized), else None
    offset: torch.Tensor | None  # [n_pad / 32, groups, 2, 16] float16 (Q4 with offsets), else None

    @property
    def quantized(self) -> bool:
        return self.format in (WeightFormat.Q4, WeightFormat.Q8)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.offset) if t is not None)

    @property
    def n_pad(self) -> int:
        """Outputs padded to whole tile pairs."""
        return _round_up(self.n, PAIR_TILES)

    @property
    def k_pad(self) -> int:
        """Inputs padded to whole groups (quantized; `group` is the padded k when dense)."""
        return _round_up(self.k, self.group)

    @property
    def label(self) -> str:
        """The weight's format by name: f32, bf16, q4_0, q4_1 (4-bit with offsets), q8_0 (8-bit in groups of 32)
        or int8 (8-bit per output channel)."""
        if self.format == WeightFormat.Q4:
            return "q4_0" if self.q4_signed else "q4_1"
        if self.format == WeightFormat.Q8:
            return "q8_0" if self.group == 32 else "int8"
        return self.format.name.lower()


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = t.new_zeros(rows, cols)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _tiles(values: torch.Tensor) -> torch.Tensor:
    """[n_pad, k_pad] -> [n_pad / 32, k_pad / 2, 2, 16, 2]: per tile pair, per kpair, per tile 16 outputs x 2 inputs."""
    n_pad, k_pad = values.shape
    return values.view(n_pad // PAIR_TILES, 2, TILE, k_pad // 2, 2).permute(0, 3, 1, 2, 4).contiguous()


def _untile(data: torch.Tensor) -> torch.Tensor:
    """The inverse of _tiles: [n_pad, k_pad]."""
    pairs, kpairs = data.shape[0], data.shape[1]
    return data.permute(0, 2, 3, 1, 4).reshape(pairs * PAIR_TILES, kpairs * 2)


def _group_tiles(per_group: torch.Tensor, n_pad: int) -> torch.Tensor:
    """[n, groups] (values representable in float16) -> [n_pad / 32, groups, 2, 16] float16."""
    padded = _pad(per_group.half(), n_pad, per_group.shape[1])
    return padded.view(n_pad // PAIR_TILES, 2, TILE, -1).permute(0, 3, 1, 2).contiguous()


def _per_group(t: torch.Tensor | None, n: int) -> torch.Tensor:
    """The inverse of _group_tiles, cut to n rows: [n, groups] float32."""
    assert t is not None
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])[:n].float()


def pack_dense(weight: torch.Tensor) -> PackedWeight:
    """A float32 or bfloat16 weight [n, k], values kept as they are."""
    fmt = {torch.float32: WeightFormat.F32, torch.bfloat16: WeightFormat.BF16}.get(weight.dtype)
    if fmt is None:
        raise ValueError(f"dense weights are float32 or bfloat16, got {weight.dtype}")
    n, k = weight.shape
    n_pad, k_pad = _round_up(n, PAIR_TILES), _round_up(k, 4)
    return PackedWeight(fmt, n, k, k_pad, False, _tiles(_pad(weight, n_pad, k_pad)), None, None)


def pack_q8(codes: torch.Tensor, scale: torch.Tensor, group: int) -> PackedWeight:
    """int8 codes [n, k] with float scales [n, k_pad / group]: value q * scale."""
    n, k = codes.shape
    if group % 4:
        raise ValueError("Q8 groups are multiples of 4 inputs")
    n_pad, k_pad = _round_up(n, PAIR_TILES), _round_up(k, group)
    if scale.shape != (n, k_pad // group):
        raise ValueError(f"scale must be [{n}, {k_pad // group}], got {list(scale.shape)}")
    data = _tiles(_pad(codes.to(torch.int8), n_pad, k_pad))
    return PackedWeight(WeightFormat.Q8, n, k, group, False, data, _group_tiles(scale, n_pad), None)


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> PackedWeight:
    """4-bit codes [n, k] (uint8 0..15) in groups of 32 with scales [n, groups] and, for Q4_1, offsets [n, groups]
    (value q * scale + offset); without offsets, Q4_0 (value (q - 8) * scale)."""
    n, k = codes.shape
    n_pad, k_pad = _round_up(n, PAIR_TILES), _round_up(k, Q4_GROUP)
    groups = k_pad // Q4_GROUP
    if scale.shape != (n, groups) or (offset is not None and offset.shape != (n, groups)):
        raise ValueError(f"scale and offset must be [{n}, {groups}]")
    padded = _pad(codes.to(torch.uint8), n_pad, k_pad)
    if offset is None:
        padded[n:, :] = 8  # padding decodes to 0 either way; 8 keeps Q4_0 rows at exactly zero
        padded[:n, k:] = 8
    # [pair, tile, o, group, kpair j (16), e] -> [pair, group, tile, j, o, e]; per tile, chunk c's bytes hold kpair 2c
    # (low nibble) and kpair 2c + 1 (high nibble) at byte 2 * o + e, so a chunk yields kpairs in order.
    v = padded.view(n_pad // PAIR_TILES, 2, TILE, groups, Q4_GROUP // 2, 2).permute(0, 3, 1, 4, 2, 5)
    data = (v[:, :, :, 0::2] | (v[:, :, :, 1::2] << 4)).contiguous()  # [pair, group, tile, 8, 16, 2]: 256 B a tile
    return PackedWeight(WeightFormat.Q4, n, k, Q4_GROUP, offset is None, data, _group_tiles(scale, n_pad),
                        None if offset is None else _group_tiles(offset, n_pad))


# ---- our own quantization of dense weights ---------------------------------------------------------------------


def _half(t: torch.Tensor) -> torch.Tensor:
    """Scales as stored (float16), back in float32: codes are computed against the stored value."""
    return t.clamp(min=MIN_SCALE).half().float()


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    """Symmetric int8 per output channel: scale = max|w| / 127 (one group per row)."""
    w = weight.float()
    k = w.shape[1]
    scale = _half(w.abs().amax(dim=1) / 127.0)  # [n]
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    group = _round_up(k, 4)
    return pack_q8(codes, scale[:, None], group)


def quantize_int4(weight: torch.Tensor) -> PackedWeight:
    """Asymmetric int4 in groups of 32 (GGUF Q4_1's scheme, float16 scale and offset): value q * scale + min."""
    w = weight.float()
    n, k = w.shape
    k_pad = _round_up(k, Q4_GROUP)
    groups = _pad(w, n, k_pad).view(n, k_pad // Q4_GROUP, Q4_GROUP)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)  # [n, groups]
    lo, scale = lo.half().float(), _half((hi - lo) / 15.0)
    codes = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return pack_q4(codes.view(n, k_pad)[:, :k], scale, lo)


# ---- GGUF blocks ---------------------------------------------------------------------------------------------

GGUF_Q4_0, GGUF_Q4_1, GGUF_Q8_0 = 2, 3, 8  # ggml type ids
GGUF_BLOCK_BYTES = {GGUF_Q4_0: 18, GGUF_Q4_1: 20, GGUF_Q8_0: 34}


def _halves(raw: np.ndarray) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def pack_gguf(ggml_type: int, raw: np.ndarray, n: int, k: int) -> PackedWeight:
    """A GGUF tensor's blocks (uint8 [n, k / 32 * block bytes]) repacked code for code."""
    if ggml_type not in GGUF_BLOCK_BYTES:
        raise ValueError(f"no kernel for ggml type {ggml_type}")
    if k % 32:
        raise ValueError("GGUF block formats need k divisible by 32")
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, GGUF_BLOCK_BYTES[ggml_type])
    scale = _halves(blocks[..., 0:2])  # [n, groups] (float16 values, stored as such)
    if ggml_type == GGUF_Q8_0:
        codes = torch.from_numpy(blocks[..., 2:].view(np.int8).copy()).reshape(n, k)
        return pack_q8(codes, scale, 32)
    offset = _halves(blocks[..., 2:4]) if ggml_type == GGUF_Q4_1 else None
    qs = torch.from_numpy((blocks[..., 4:] if ggml_type == GGUF_Q4_1 else blocks[..., 2:]).copy())
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k)  # element j low nibble, j + 16 high nibble
    return pack_q4(codes, scale, offset)


def dequantize(p: PackedWeight) -> torch.Tensor:
    """The float32 weight [n, k] a packed weight stands for (the reference the kernels are tested against)."""
    codes = _padded_codes(p).float()  # [n_pad, k_pad]
    if p.format == WeightFormat.Q4 and p.q4_signed:
        codes = codes - 8
    if not p.quantized:
        return codes[: p.n, : p.k].contiguous()
    per_elem = _per_group(p.scale, codes.shape[0]).repeat_interleave(p.group, dim=1)
    values = codes * per_elem
    if p.offset is not None:
        values = torch.addcmul(_per_group(p.offset, codes.shape[0]).repeat_interleave(p.group, dim=1), codes, per_elem)
    return values[: p.n, : p.k].contiguous()


def _padded_codes(p: PackedWeight) -> torch.Tensor:
    """Codes (quantized) or values (dense) [n_pad, k_pad] in their stored dtype."""
    if p.format != WeightFormat.Q4:
        return _untile(p.data)
    pairs, groups = p.data.shape[0], p.data.shape[1]
    v = torch.stack([p.data & 0x0F, p.data >> 4], dim=4).flatten(3, 4)  # [pair, group, tile, j = 2c + nibble, o, e]
    return v.permute(0, 2, 4, 1, 3, 5).reshape(pairs * PAIR_TILES, groups * Q4_GROUP)


def stackable(parts: list[PackedWeight]) -> bool:
    """Whether concat_rows can stack these: one format, width and grouping."""
    first = parts[0]
    return all(p.format == first.format and p.k == first.k and p.group == first.group
               and p.q4_signed == first.q4_signed and (p.offset is None) == (first.offset is None) for p in parts)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack weights of one format along n (fused qkv and gate_up), re-packed from their codes.

    Works on the logical rows, so each part may have its own padding."""
    if not stackable(parts):
        raise ValueError("only weights of one format and width can be stacked")
    first = parts[0]
    if not first.quantized:
        return pack_dense(torch.cat([_dense_values(p) for p in parts]))
    codes = torch.cat([_codes(p) for p in parts])
    scale = torch.cat([_per_group(p.scale, p.n) for p in parts])
    if first.format == WeightFormat.Q8:
        return pack_q8(codes, scale, first.group)
    offsets = [p.offset for p in parts]
    offset = None if offsets[0] is None else torch.cat([_per_group(o, p.n) for o, p in zip(offsets, parts,
                                                                                          strict=True)])
    return replace(pack_q4(codes, scale, offset), q4_signed=first.q4_signed)


def _dense_values(p: PackedWeight) -> torch.Tensor:
    return _untile(p.data)[: p.n, : p.k]


def _codes(p: PackedWeight) -> torch.Tensor:
    """The integer codes [n, k] of a quantized weight."""
    return _padded_codes(p)[: p.n, : p.k]


def permute_rows(p: PackedWeight, order: torch.Tensor) -> PackedWeight:
    """Rows reordered: row i of the result is row order[i] (GGUF stores q and k rows in llama.cpp's RoPE order)."""
    if not p.quantized:
        return pack_dense(_dense_values(p)[order])
    codes = _codes(p)[order]
    scale = _per_group(p.scale, p.n)[order]
    if p.format == WeightFormat.Q8:
        return pack_q8(codes, scale, p.group)
    offset = None if p.offset is None else _per_group(p.offset, p.n)[order]
    return replace(pack_q4(codes, scale, offset), q4_signed=p.q4_signed)
