"""The kernels' tiled layout as index arithmetic (csrc/linear.h): a weight [n, k] in tiles of 16 outputs, tiles in
pairs, over pairs of inputs ("kpairs"); per-group scales tiled the same way. packing.py builds weights on these."""

from __future__ import annotations

import torch

TILE = 16  # outputs per tile
PAIR_TILES = 32  # n is padded to whole tile pairs


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = t.new_zeros(rows, cols)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def tiles(values: torch.Tensor) -> torch.Tensor:
    """[n_pad, k_pad] -> [n_pad / 32, k_pad / 2, 2, 16, 2]: per tile pair, per kpair, per tile 16 outputs x 2 inputs."""
    n_pad, k_pad = values.shape
    return values.view(n_pad // PAIR_TILES, 2, TILE, k_pad // 2, 2).permute(0, 3, 1, 2, 4).contiguous()


def untile(data: torch.Tensor) -> torch.Tensor:
    """The inverse of tiles: [n_pad, k_pad]."""
    pairs, kpairs = data.shape[0], data.shape[1]
    return data.permute(0, 2, 3, 1, 4).reshape(pairs * PAIR_TILES, kpairs * 2)


def group_tiles(per_group: torch.Tensor, n_pad: int) -> torch.Tensor:
    """[n, groups] (values representable in float16; 8-bit integers kept as they are) -> [n_pad / 32, groups, 2, 16]
    float16 (or the integers' dtype)."""
    if per_group.dtype not in (torch.uint8, torch.int8):
        per_group = per_group.half()
    padded = pad(per_group, n_pad, per_group.shape[1])
    return padded.view(n_pad // PAIR_TILES, 2, TILE, -1).permute(0, 3, 1, 2).contiguous()


def untiled(t: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of group_tiles, cut to n rows, in the stored dtype: [n, groups]."""
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])[:n]


def per_group(t: torch.Tensor | None, n: int) -> torch.Tensor:
    """The inverse of group_tiles, cut to n rows: [n, groups] float32."""
    assert t is not None
    return untiled(t, n).float()
