"""Weights in the native kernels' tiled layout (csrc/linear.h): dense, quantized by us (quantize.py), or GGUF blocks.

A weight [n, k] is stored in tiles of 16 outputs, tiles in pairs (n padded to a multiple of 32), over pairs of inputs
("kpairs"; k padded to a multiple of 4, or of the group size when quantized). A tile pair's data is one contiguous
run, kpair by kpair (both tiles' vectors side by side), so a thread reading it streams one sequential range.
Quantized weights keep integer codes with float32 scales (and offsets) per group of inputs:

- Q4: 4-bit codes in groups of 32, value `(q - 8) * scale` (GGUF Q4_0, "signed"), `q * scale + offset` (Q4_1 and
  our own asymmetric int4) or `T[q] * scale` (GGUF IQ4_NL, IQ4_XS and grid formats: a table T of Q4_TABLES;
  bfloat16 products only, see `code_values`). A
  GGUF file's blocks are repacked code for code, never dequantized, so a model is served with exactly its own
  weights.
- Q8: signed 8-bit codes, value `q * scale` (+ offset), in groups of 32 (GGUF Q8_0, and tabled Q4 weights' values for
  float32 compute) or one group per output row (our own int8 per-channel quantization).
- Q6: Q8 whose codes lie in -32..31 held in 6 bits a code (csrc/linear.h's layout), in groups of 16 (GGUF Q6_K), or
  of 16 or 32 for Q3 and Q5 weights with float32 compute, so a Q4_K_M file's 6-bit tensors take their own size.
- Q3: Q8 whose codes lie in -4..3 held in 3 bits a code (csrc/linear.h's layout), in groups of 16 (GGUF Q3_K, Q2_K),
  or indices into a table of 8 values (Q3_TABLES: the IQ2 and IQ1 grid formats); bfloat16 products only
  (float32 compute holds them as Q6, or with a table as its values in Q8: gguf_blocks.held_for).
- Q5: 5-bit codes as the file stores them (0..31; `q4_signed`: value q - 16) in the same kind of layout, in groups of
  32 (GGUF Q5_0, Q5_1, Q5_K); bfloat16 products only, as Q3.
- GGUF K-quants (Q4_K and IQ4_XS as Q4; Q2_K and Q3_K as Q3; Q5_K as Q5; Q6_K as Q6) keep the file's scales as they are
  (`KScales`: per super-block fp16 d and dmin, per group 8-bit sc and m); the kernels fold each group with d * sc
  and -(dmin * m), exact in float32. gguf_blocks.py reads every GGUF block format into these layouts.

Everything here is plain torch on the host, run once at load.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from lmrpc.kernels import code_layouts
from lmrpc.kernels.tiles import PAIR_TILES, TILE, group_tiles, pad, per_group, round_up, tiles, untile, untiled

MIN_SCALE = 2.0**-24  # the smallest positive float16: a group of zeros keeps a non-zero scale
Q4_GROUP = 32
# GGUF's IQ4_NL and IQ4_XS values (ggml's kvalues_iq4nl), indexed by their 4-bit codes
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The values Q4 codes index, by the label of a weight whose codes are not q or q - 8: IQ4's, and those of the GGUF
# grid formats held in 4 bits (gguf_grids.py: each value a grid value times its sign). bfloat16 products turn codes
# into values through the table (csrc's Q4Table); float32 compute holds the values as Q8.
Q4_TABLES: dict[str, tuple[int, ...]] = {
    "iq4_nl": IQ4_VALUES, "iq4_xs": IQ4_VALUES,
    "iq3_s": tuple(range(-15, 16, 2)),  # grid 1, 3, ..., 15
    "iq3_xxs": (-31, -26, -22, -18, -14, -10, -6, -2, 2, 6, 10, 14, 18, 22, 26, 31),  # grid 4, 12, ..., 62, halved
}
# The values Q3 codes index (stored as q + 4, 0..7), by label: the grid formats with 6 values, which fit 3 bits
# (gguf_grids.py; unused entries 0). As Q4's, bfloat16 products only.
_IQ2_VALUES = (-43, -25, -8, 8, 25, 43, 0, 0)  # grid 8, 25, 43, signed
_IQ1_VALUES = (-9, -7, -1, 1, 7, 9, 0, 0)  # 8 x (grid -1, 0, 1 + or - 1/8)
Q3_TABLES: dict[str, tuple[int, ...]] = {
    "iq2_xxs": _IQ2_VALUES, "iq2_xs": _IQ2_VALUES, "iq2_s": _IQ2_VALUES, "iq1_s": _IQ1_VALUES, "iq1_m": _IQ1_VALUES,
}


class WeightFormat(enum.IntEnum):
    F32 = 0
    BF16 = 1
    Q4 = 2
    Q8 = 3
    Q6 = 4
    Q3 = 5
    Q5 = 6


class Compute(enum.IntEnum):
    """How activations enter products: float32, or rounded to bfloat16 (AVX512-BF16 dot products)."""

    F32 = 0
    BF16 = 1


@dataclass(frozen=True)
class KScales:
    """GGUF K-quant scales as the file stores them, tiled like PackedWeight's scales (csrc/linear.h's KScales):
    group g's scale is d * sc and its offset -(dmin * m), d and dmin those of its super-block (each d times d_scale)."""

    d: torch.Tensor  # [n_pad / 32, supers, 2, 16] float16
    dmin: torch.Tensor | None  # as d, or None (no offsets: Q6_K)
    sc: torch.Tensor  # [n_pad / 32, groups, 2, 16] uint8 (int8 when signed: Q6_K)
    m: torch.Tensor | None  # as sc (uint8), or None
    super_groups: int  # groups per super-block
    # a power of two every d stands times (GGUF grid formats, gguf_grids.py: d / 8, where d alone is an fp16); the
    # kernels multiply their results by it, exactly as if it were in each d. Only without offsets.
    d_scale: float = 1.0

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.d, self.dmin, self.sc, self.m) if t is not None]


@dataclass(frozen=True)
class PackedWeight:
    """A weight [n, k] in the kernels' layout (see the module doc)."""

    format: WeightFormat
    n: int  # output features
    k: int  # input features
    group: int  # quantized: inputs per scale group; dense: the padded k
    q4_signed: bool  # Q4 codes are offset by 8 (GGUF Q4_0), Q5 codes by 16 (Q5_0), instead of carrying offsets
    data: torch.Tensor  # packed codes or values (uint8, int8, bfloat16 or float32)
    scale: torch.Tensor | None  # [n_pad / 32, groups, 2, 16] float16 (quantized), else None
    offset: torch.Tensor | None  # [n_pad / 32, groups, 2, 16] float16 (with offsets), else None
    kscales: KScales | None = None  # GGUF K-quants: scales and offsets from these (scale and offset None)
    name: str | None = None  # the GGUF format the codes came from, where the layout does not tell (q5_0, q4_k)

    @property
    def quantized(self) -> bool:
        return self.format in (WeightFormat.Q4, WeightFormat.Q8, WeightFormat.Q6, WeightFormat.Q3, WeightFormat.Q5)

    @property
    def nbytes(self) -> int:
        tensors = [self.data, self.scale, self.offset, *(self.kscales.tensors if self.kscales else [])]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def has_offsets(self) -> bool:
        return self.offset is not None or (self.kscales is not None and self.kscales.dmin is not None)

    @property
    def n_pad(self) -> int:
        """Outputs padded to whole tile pairs."""
        return round_up(self.n, PAIR_TILES)

    @property
    def k_pad(self) -> int:
        """Inputs padded to whole groups (quantized; `group` is the padded k when dense)."""
        return round_up(self.k, self.group)

    @property
    def code_values(self) -> tuple[int, ...] | None:
        """The 16 values a code indexes, or None (codes stand for q, or q - 8): Q4 codes index Q4_TABLES' (GGUF IQ4_NL,
        IQ4_XS and the IQ3 grid formats), Q3 codes as stored (q + 4) the first 8 of Q3_TABLES' twice (the IQ2 and IQ1
        grid formats), so that a 4-bit index picks the same value whatever its top bit (csrc's Q4Table)."""
        if self.format == WeightFormat.Q4:
            return Q4_TABLES.get(self.label)
        if self.format == WeightFormat.Q3 and self.label in Q3_TABLES:
            return Q3_TABLES[self.label] * 2
        return None

    @property
    def label(self) -> str:
        """The weight's format by name: f32, bf16, q4_0, q4_1 (4-bit with offsets), q8_0 (8-bit in groups of 32)
        or int8 (8-bit per output channel); GGUF formats held in these layouts by their own name (q5_0, q6_k)."""
        if self.name is not None:
            return self.name
        if self.format == WeightFormat.Q4:
            return "q4_0" if self.q4_signed else "q4_1"
        if self.format == WeightFormat.Q8:
            return "q8_0" if self.group == 32 else "int8"
        return self.format.name.lower()


def pack_kscales(d: torch.Tensor, dmin: torch.Tensor | None, sc: torch.Tensor, m: torch.Tensor | None,
                 super_groups: int, d_scale: float = 1.0) -> KScales:
    """K-quant scales from per-row tensors: d, dmin [n, supers] (fp16 values), sc, m [n, groups] (8-bit)."""
    n_pad = round_up(d.shape[0], PAIR_TILES)
    assert d_scale == 1.0 or dmin is None, "d_scale only without offsets"
    return KScales(group_tiles(d, n_pad), None if dmin is None else group_tiles(dmin, n_pad),
                   group_tiles(sc, n_pad), None if m is None else group_tiles(m, n_pad), super_groups, d_scale)


def kscale_rows(ks: KScales, n: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The inverse of pack_kscales, cut to n rows (stored dtypes)."""
    return (untiled(ks.d, n), None if ks.dmin is None else untiled(ks.dmin, n), untiled(ks.sc, n),
            None if ks.m is None else untiled(ks.m, n))


def kscales_map(ks: KScales, n: int, change: Callable[[torch.Tensor], torch.Tensor]) -> KScales:
    """K-scales with `change` applied to each per-row tensor (rows reordered, stacked)."""
    d, dmin, sc, m = kscale_rows(ks, n)
    return pack_kscales(change(d), None if dmin is None else change(dmin), change(sc),
                        None if m is None else change(m), ks.super_groups, ks.d_scale)


def group_scales(p: PackedWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each group's scale and offset, float32 [n_pad, groups], as the kernels fold them (K-quants: d * sc and
    -(dmin * m), exact products)."""
    n_pad = p.n_pad
    if p.kscales is None:
        return per_group(p.scale, n_pad), None if p.offset is None else per_group(p.offset, n_pad)
    d, dmin, sc, m = kscale_rows(p.kscales, n_pad)
    per = p.kscales.super_groups
    scale = d.float().repeat_interleave(per, dim=1) * sc.float() * p.kscales.d_scale  # (a power of two: exact)
    if dmin is None or m is None:
        return scale, None
    return scale, -(dmin.float().repeat_interleave(per, dim=1) * m.float())


def pack_dense(weight: torch.Tensor) -> PackedWeight:
    """A float32 or bfloat16 weight [n, k], values kept as they are."""
    fmt = {torch.float32: WeightFormat.F32, torch.bfloat16: WeightFormat.BF16}.get(weight.dtype)
    if fmt is None:
        raise ValueError(f"dense weights are float32 or bfloat16, got {weight.dtype}")
    n, k = weight.shape
    n_pad, k_pad = round_up(n, PAIR_TILES), round_up(k, 4)
    return PackedWeight(fmt, n, k, k_pad, False, tiles(pad(weight, n_pad, k_pad)), None, None)


def _q8_data(codes: torch.Tensor, group: int) -> torch.Tensor:
    if group % 4:
        raise ValueError("Q8 groups are multiples of 4 inputs")
    n, k = codes.shape
    return tiles(pad(codes.to(torch.int8), round_up(n, PAIR_TILES), round_up(k, group)))


NARROW = (WeightFormat.Q6, WeightFormat.Q5, WeightFormat.Q3)  # Q8's codes held in fewer bits (code_layouts.py)


def _narrowed(q8: torch.Tensor, fmt: WeightFormat, signed: bool) -> torch.Tensor:
    """Q8 data in a NARROW format's layout (Q5: codes less 16 when signed)."""
    if fmt == WeightFormat.Q6:
        return code_layouts.q6_data(q8)
    if fmt == WeightFormat.Q5:
        return code_layouts.q5_data(q8, signed)
    assert fmt == WeightFormat.Q3
    return code_layouts.q3_data(q8)


def _widened(p: PackedWeight) -> torch.Tensor:
    """A NARROW weight's data as Q8 data [pairs, kpairs, 2, 16, 2] int8."""
    if p.format == WeightFormat.Q6:
        return code_layouts.q8_of_q6(p.data)
    if p.format == WeightFormat.Q5:
        return code_layouts.q8_of_q5(p.data, p.q4_signed)
    assert p.format == WeightFormat.Q3
    return code_layouts.q8_of_q3(p.data)


def narrow(p: PackedWeight, fmt: WeightFormat, signed: bool = False) -> PackedWeight:
    """A Q8 weight (groups of 16 or 32) whose codes fit `fmt` (Q6: -32..31; Q5: 0..31, or -16..15 signed; Q3:
    -4..3), held in that many bits a code: the same weight."""
    if p.format != WeightFormat.Q8 or p.group not in (16, 32):
        raise ValueError(f"{fmt.name} holds Q8 weights in groups of 16 or 32")
    return replace(p, format=fmt, q4_signed=signed, data=_narrowed(p.data, fmt, signed))


def as_q6(p: PackedWeight) -> PackedWeight:
    """A Q3 or Q5 weight held in 6 bits a code (Q6): the same weight, for kernels that take Q6 and not these."""
    if p.format not in (WeightFormat.Q3, WeightFormat.Q5):
        raise ValueError("Q3 and Q5 weights are widened to Q6")
    return replace(p, format=WeightFormat.Q6, q4_signed=False, data=code_layouts.q6_data(_widened(p)))


def code_pairs(codes: torch.Tensor) -> torch.Tensor:
    """Codes [rows, k_pad] (0..15) -> q4_tiles' bytes [rows, groups, 8, 2]: byte (c, e) of a group holds its codes
    4c + e (low nibble) and 4c + 2 + e (high nibble)."""
    q = codes.view(codes.shape[0], -1, 8, 2, 2)  # [rows, groups, c, code 4c + e or 4c + 2 + e, e]
    return q[:, :, :, 0] | (q[:, :, :, 1] << 4)


def q4_tiles(chunks: torch.Tensor, signed: bool) -> torch.Tensor:
    """The Q4 layout from each group's bytes as they will be stored (chunks [n, groups, 8, 2] uint8, as _code_pairs
    makes them): per tile pair, group and tile, chunk c's 16 outputs x 2 bytes, so a chunk yields kpairs 2c and
    2c + 1 in order (256 bytes a tile). A GGUF Q4 block's bytes are shuffled into these directly (gguf_blocks.py),
    without a byte per code in between."""
    n, groups = chunks.shape[0], chunks.shape[1]
    n_pad = round_up(n, PAIR_TILES)
    padded = chunks.new_full((n_pad, groups, 8, 2), 0x88 if signed else 0)  # padding rows decode to 0
    padded[:n] = chunks
    # [pair, tile, o, group, c, e] -> [pair, group, tile, c, o, e]
    return padded.view(n_pad // PAIR_TILES, 2, TILE, groups, 8, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def q4_data(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    n, k = codes.shape
    # Padding inputs decode to 0 either way; 8 keeps Q4_0 groups at exactly zero.
    padded = pad(codes.to(torch.uint8), n, round_up(k, Q4_GROUP))
    if signed:
        padded[:, k:] = 8
    return q4_tiles(code_pairs(padded), signed)


def _check_groups(name: str, t: torch.Tensor | None, n: int, groups: int) -> None:
    if t is not None and t.shape != (n, groups):
        raise ValueError(f"{name} must be [{n}, {groups}], got {list(t.shape)}")


def pack_q8(codes: torch.Tensor, scale: torch.Tensor, group: int, offset: torch.Tensor | None = None,
            name: str | None = None) -> PackedWeight:
    """int8 codes [n, k] with float scales (and offsets) [n, k_pad / group]: value q * scale (+ offset)."""
    n, k = codes.shape
    groups = round_up(k, group) // group
    _check_groups("scale", scale, n, groups)
    _check_groups("offset", offset, n, groups)
    n_pad = round_up(n, PAIR_TILES)
    return PackedWeight(WeightFormat.Q8, n, k, group, False, _q8_data(codes, group), group_tiles(scale, n_pad),
                        None if offset is None else group_tiles(offset, n_pad), name=name)


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> PackedWeight:
    """4-bit codes [n, k] (uint8 0..15) in groups of 32 with scales [n, groups] and, for Q4_1, offsets [n, groups]
    (value q * scale + offset); without offsets, Q4_0 (value (q - 8) * scale)."""
    n, k = codes.shape
    groups = round_up(k, Q4_GROUP) // Q4_GROUP
    _check_groups("scale", scale, n, groups)
    _check_groups("offset", offset, n, groups)
    return pack_q4_tiled(q4_data(codes, offset is None), n, k, scale, offset)


def pack_q4_tiled(data: torch.Tensor, n: int, k: int, scale: torch.Tensor, offset: torch.Tensor | None,
                  name: str | None = None) -> PackedWeight:
    """pack_q4's weight from codes already in its layout (q4_tiles) and scales [n, groups] (float16 values)."""
    n_pad = round_up(n, PAIR_TILES)
    return PackedWeight(WeightFormat.Q4, n, k, Q4_GROUP, offset is None, data, group_tiles(scale, n_pad),
                        None if offset is None else group_tiles(offset, n_pad), name=name)


def pack_k(fmt: WeightFormat, codes: torch.Tensor, group: int, kscales: KScales, name: str,
           signed: bool = False) -> PackedWeight:
    """Codes [n, k] with K-quant scales: Q4 (4-bit codes 0..15, groups of 32), Q8 (int8 codes), Q6 (-32..31), Q5
    (0..31, or -16..15 signed: GGUF grid formats) or Q3 (-4..3)."""
    n, k = codes.shape
    if fmt == WeightFormat.Q4:
        data = q4_data(codes, False)
    else:
        data = _q8_data(codes, group)
        if fmt in NARROW:
            data = _narrowed(data, fmt, signed=signed)
    return replace(pack_k_tiled(fmt, data, n, k, group, kscales, name), q4_signed=signed)


def pack_k_tiled(fmt: WeightFormat, data: torch.Tensor, n: int, k: int, group: int, kscales: KScales, name: str
                 ) -> PackedWeight:
    """pack_k's weight from codes already in the layout."""
    if kscales.sc.shape[1] != round_up(k, group) // group or k % (group * kscales.super_groups):
        raise ValueError("K-quant scales must cover whole super-blocks of the weight's groups")
    return PackedWeight(fmt, n, k, group, False, data, None, None, kscales, name)


def table_values(codes: torch.Tensor, values: tuple[int, ...]) -> torch.Tensor:
    """Table indices (0..15, any integer or float dtype) -> the int8 values they pick in `values` (code_values)."""
    return torch.tensor(values, dtype=torch.int8)[codes.long()]


def _padded_values(p: PackedWeight) -> torch.Tensor:
    """What each code stands for, [n_pad, k_pad]: through the weight's table (code_values), q - 8 (Q4_0), or itself."""
    codes = _padded_codes(p)
    if p.code_values is not None:
        return table_values(codes + 4 if p.format == WeightFormat.Q3 else codes, p.code_values)
    if p.format == WeightFormat.Q4 and p.q4_signed:
        return codes.to(torch.int8) - 8
    return codes


def values_of(p: PackedWeight) -> torch.Tensor:
    """The integer values [n, k] a quantized weight's codes stand for, before their scales (int8)."""
    return _padded_values(p)[: p.n, : p.k].to(torch.int8)


def dequantize(p: PackedWeight) -> torch.Tensor:
    """The float32 weight [n, k] a packed weight stands for (the reference the kernels are tested against):
    q * scale (+ offset), as gguf's dequantize computes it."""
    codes = _padded_values(p).float()  # [n_pad, k_pad]
    if not p.quantized:
        return codes[: p.n, : p.k].contiguous()
    scale, offset = group_scales(p)
    values = codes * scale.repeat_interleave(p.group, dim=1)  # exact: small integers times scales
    if offset is not None:
        values = values + offset.repeat_interleave(p.group, dim=1)
    return values[: p.n, : p.k].contiguous()


def _padded_codes(p: PackedWeight) -> torch.Tensor:
    """Codes (quantized) or values (dense) [n_pad, k_pad] in their stored dtype."""
    if p.format in NARROW:
        return untile(_widened(p))
    if p.format != WeightFormat.Q4:
        return untile(p.data)
    pairs, groups = p.data.shape[0], p.data.shape[1]
    v = torch.stack([p.data & 0x0F, p.data >> 4], dim=4).flatten(3, 4)  # [pair, group, tile, j = 2c + nibble, o, e]
    return v.permute(0, 2, 4, 1, 3, 5).reshape(pairs * PAIR_TILES, groups * Q4_GROUP)


def dense_values(p: PackedWeight) -> torch.Tensor:
    return untile(p.data)[: p.n, : p.k]


def codes_of(p: PackedWeight) -> torch.Tensor:
    """The integer codes [n, k] of a quantized weight."""
    return _padded_codes(p)[: p.n, : p.k]
