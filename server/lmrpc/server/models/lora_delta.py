"""A LoRA adapter's deltas as the model applies them to one step's rows: the per-layer low-rank products on the
fused projections (built by lora/products.py from an adapter file) and `add_delta`, the Python loop's way of adding
them (DecoderLayer). Each row's delta is computed alone with the base layer's prologue fused in, rows grouped by
adapter (see lora/products.py for why)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmrpc.server.models.linear import LinearLayer

# The fused projections and the PEFT modules each one holds, in output order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class ModuleB:
    """One targeted module's B product within a fused projection's delta."""

    b: LinearLayer  # [rank] -> [the module's out] (scale folded in)
    rank_start: int  # its rank columns of the A product's output start here
    out_start: int  # its output columns of the fused projection start here


@dataclass(frozen=True)
class LowRank:
    """The delta of one fused projection: x -> h = a(x), then each module's b over its columns of h, added to its
    slice of the output."""

    a: LinearLayer  # [in] -> [sum of ranks]
    parts: tuple[ModuleB, ...]  # in output order


@dataclass(frozen=True)
class LayerLora:
    """One decoder layer's deltas; None where the adapter does not touch that projection."""

    qkv: LowRank | None
    o: LowRank | None
    gate_up: LowRank | None
    down: LowRank | None


@dataclass(frozen=True)
class RowGroup:
    """The rows of one step that run under one adapter."""

    rows: torch.Tensor  # [n] int64 indices into the step's flat token rows, ascending
    layers: tuple[LayerLora, ...]  # the adapter's per-layer deltas
    stack: object | None = None  # native_adapter(layers), when the native decoder stack may run them


def add_delta(out: torch.Tensor, x: torch.Tensor, groups: tuple[RowGroup, ...], layer: int, projection: str,
              norm: torch.Tensor | None = None, eps: float = 0.0, silu: bool = False) -> torch.Tensor:
    """out [T, out] (the base projection, residual included) += each group's delta on its own rows, computed from
    x [T, in] with the base product's prologue (norm or silu). Rows of no group are left as they are."""
    for group in groups:
        low: LowRank | None = getattr(group.layers[layer], projection)
        if low is None:
            continue
        h = low.a(x.index_select(0, group.rows), norm=norm, eps=eps, silu=silu)  # [n, ranks]
        rows = out.index_select(0, group.rows)  # [n, out]
        for part in low.parts:
            width, rank = part.b.out_features, part.b.in_features
            columns = rows[:, part.out_start : part.out_start + width]  # [n, width], a view
            columns.copy_(part.b(h[:, part.rank_start : part.rank_start + rank], residual=columns))
        out.index_copy_(0, group.rows, rows)
    return out
