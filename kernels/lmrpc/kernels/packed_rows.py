"""Packed weights' rows joined and reordered without going through float values: stacked into one product (fused
q/k/v and gate/up), chunks of one weight packed row range by row range joined (gguf_blocks.py), rows permuted
(GGUF's q/k order). Codes and scales move as they are, so the weight stays the file's to the bit."""

from __future__ import annotations

from dataclasses import replace

import torch

from lmrpc.kernels.packing import (
    KScales,
    PackedWeight,
    WeightFormat,
    codes_of,
    dense_values,
    kscale_rows,
    kscales_map,
    narrow,
    pack_dense,
    pack_k,
    pack_kscales,
    pack_q4_tiled,
    pack_q8,
    q4_data,
)
from lmrpc.kernels.tiles import PAIR_TILES, per_group


def stackable(parts: list[PackedWeight]) -> bool:
    """Whether concat_rows can stack these: one format, width and grouping."""
    first = parts[0]

    def kind(p: PackedWeight) -> tuple[object, ...]:
        ks = p.kscales
        k_kind = None if ks is None else (ks.super_groups, ks.sc.dtype, ks.dmin is None, ks.d_scale)
        return (p.format, p.k, p.group, p.q4_signed, p.offset is None, p.label, k_kind)

    return all(kind(p) == kind(first) for p in parts)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack weights of one format along n (fused qkv and gate_up).

    Parts of whole tile pairs (all but the last) are joined tile for tile, as they are: the usual case (a model's
    projection widths are multiples of 32), and at load the cheap one (no codes unpacked). Otherwise re-packed from
    the logical rows, so each part may have its own padding; both give the same weight."""
    if not stackable(parts):
        raise ValueError("only weights of one format and width can be stacked")
    if all(p.n % PAIR_TILES == 0 for p in parts[:-1]):
        return concat_tiled_rows(parts)
    return concat_repacked(parts)


def concat_repacked(parts: list[PackedWeight]) -> PackedWeight:
    """concat_rows by unpacking every part's codes and packing the stacked rows anew (any row counts)."""
    first = parts[0]
    if not first.quantized:
        return pack_dense(torch.cat([dense_values(p) for p in parts]))
    codes = torch.cat([codes_of(p) for p in parts])
    if first.kscales is not None:
        rows = [kscale_rows(p.kscales, p.n) for p in parts if p.kscales is not None]
        d, dmin, sc, m = (None if r[0] is None else torch.cat(list(r)) for r in zip(*rows, strict=True))
        assert d is not None and sc is not None
        ks = pack_kscales(d, dmin, sc, m, first.kscales.super_groups, first.kscales.d_scale)
        return pack_k(first.format, codes, first.group, ks, first.label, first.q4_signed)
    scale = torch.cat([per_group(p.scale, p.n) for p in parts])
    offset = None if first.offset is None else torch.cat([per_group(p.offset, p.n) for p in parts])
    return _repack(first, codes, scale, offset)


def concat_tiled_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Weights packed from consecutive row ranges of one weight, each range but the last a whole number of tile
    pairs: their tiles follow one another as they are (no codes unpacked), so packing a large weight in row chunks
    holds one chunk's temporaries at a time."""
    if not stackable(parts) or any(p.n % PAIR_TILES for p in parts[:-1]):
        raise ValueError("row chunks of one weight, each but the last whole tile pairs")
    first = parts[0]

    def cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if tensors[0] is None else torch.cat([t for t in tensors if t is not None])

    kscales = None
    if first.kscales is not None:
        ks = [p.kscales for p in parts if p.kscales is not None]
        d, sc = cat([k.d for k in ks]), cat([k.sc for k in ks])
        assert d is not None and sc is not None
        kscales = KScales(d, cat([k.dmin for k in ks]), sc, cat([k.m for k in ks]), first.kscales.super_groups,
                          first.kscales.d_scale)
    data = cat([p.data for p in parts])
    assert data is not None
    return replace(first, n=sum(p.n for p in parts), data=data, scale=cat([p.scale for p in parts]),
                   offset=cat([p.offset for p in parts]), kscales=kscales)


def _repack(like: PackedWeight, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
            ) -> PackedWeight:
    """Codes and per-group scales in `like`'s format (fp16 scales)."""
    if like.format != WeightFormat.Q4:
        q8 = pack_q8(codes, scale, like.group, offset, like.name)
        return q8 if like.format == WeightFormat.Q8 else narrow(q8, like.format, like.q4_signed)
    n, k = codes.shape  # (padded as `like` was: Q4_0's codes with 8, IQ4's table indices and Q4_1's with 0)
    data = q4_data(codes, like.q4_signed)
    return replace(pack_q4_tiled(data, n, k, scale, offset, like.name), q4_signed=like.q4_signed)


def permute_rows(p: PackedWeight, order: torch.Tensor) -> PackedWeight:
    """Rows reordered: row i of the result is row order[i] (GGUF stores q and k rows in llama.cpp's RoPE order)."""
    if not p.quantized:
        return pack_dense(dense_values(p)[order])
    codes = codes_of(p)[order]
    if p.kscales is not None:
        return pack_k(p.format, codes, p.group, kscales_map(p.kscales, p.n, lambda t: t[order]), p.label, p.q4_signed)
    offset = None if p.offset is None else per_group(p.offset, p.n)[order]
    return _repack(p, codes, per_group(p.scale, p.n)[order], offset)
