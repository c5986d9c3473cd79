"""An adapter as low-rank products on the model's fused projections, and their application to one step's rows.

The model computes q, k and v in one fused product, and gate and up in another. An adapter's delta on the fused
output is `B_fused (A_fused x) * scale`: A_fused stacks the targeted modules' A matrices ([sum of ranks, in]) and
B_fused places each module's B (scale folded in) at that module's output rows and rank columns, zero elsewhere. The
products run on the same kernels as the base layers (dense, the model's dtype), with the base layer's prologue (its
RMSNorm, or SiLU-and-multiply) fused into the A product and the base output added as the B product's residual, so:

- each row's delta is computed alone (the kernels are row-invariant): a request's bits do not depend on which
  other rows, or adapters, share the step;
- rows are grouped by adapter: one A and one B product per adapter, fused projection and layer, never a loop over
  tokens.

`add_delta` is the Python loop's way (models/llama.py's DecoderLayer). The native decoder stack does the same with
the same kernels in the same order, reading and writing the group's rows where they lie (`native_adapter` gives it
an adapter's products), so a step gives the same bits on either path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmrpc.kernels import native, packing
from lmrpc.server.lora.adapter import AdapterFile
from lmrpc.server.models.linear import DenseLinear, LinearLayer
from lmrpc.server.models.quantized import LinearBuilder, NativeLinear

# The fused projections and the PEFT modules each one holds, in output order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class LowRank:
    """The delta of one fused projection: x -> b(a(x))."""

    a: LinearLayer  # [in] -> [sum of ranks]
    b: LinearLayer  # [sum of ranks] -> [out] (scale folded in)


@dataclass(frozen=True)
class LayerLora:
    """One decoder layer's deltas; None where the adapter does not touch that projection."""

    qkv: LowRank | None
    o: LowRank | None
    gate_up: LowRank | None
    down: LowRank | None


def dense_layer(builder: LinearBuilder, weight: torch.Tensor) -> LinearLayer:
    """A product over `weight` [out, in] kept dense in the model dtype whatever --quantization says (adapters are
    small; quantizing them would cost accuracy for nothing)."""
    weight = weight.to(builder.dtype).contiguous()
    if builder.native:
        return NativeLinear(packing.pack_dense(weight), builder.compute)
    return DenseLinear(weight.to(builder.device), None)


def build_layers(adapter: AdapterFile, builder: LinearBuilder, layers: int,
                 features: dict[str, tuple[int, int]]) -> tuple[LayerLora, ...]:
    """Every layer's fused deltas for `adapter` (features: PEFT module -> (in, out) of the base model)."""
    out: list[LayerLora] = []
    for layer in range(layers):
        parts = {name: _fused(adapter, builder, layer, modules, features) for name, modules in FUSED.items()}
        out.append(LayerLora(**parts))
    return tuple(out)


def _fused(adapter: AdapterFile, builder: LinearBuilder, layer: int, modules: tuple[str, ...],
           features: dict[str, tuple[int, int]]) -> LowRank | None:
    present = [m for m in modules if (layer, m) in adapter.modules]
    if not present:
        return None
    in_features = features[modules[0]][0]
    out_sizes = [features[m][1] for m in modules]
    rank = adapter.rank
    a = torch.zeros(rank * len(present), in_features)  # [ranks, in]
    b = torch.zeros(sum(out_sizes), rank * len(present))  # [out, ranks]: block per targeted module
    for slot, module in enumerate(present):
        pair = adapter.modules[(layer, module)]
        row = sum(out_sizes[: modules.index(module)])
        a[slot * rank : (slot + 1) * rank] = pair.a
        b[row : row + pair.b.shape[0], slot * rank : (slot + 1) * rank] = pair.b * adapter.scale
    return LowRank(dense_layer(builder, a), dense_layer(builder, b))


def native_adapter(layers: tuple[LayerLora, ...]) -> object | None:
    """The native decoder stack's form of an adapter (a StackAdapter holding the same kernel objects), or None when
    its products are not all native (then steps with it run the Python loop)."""
    per_layer: list[list[tuple[object, object] | None]] = []
    for layer in layers:
        products: list[tuple[object, object] | None] = []
        for name in FUSED:
            low: LowRank | None = getattr(layer, name)
            if low is None:
                products.append(None)
            elif isinstance(low.a, NativeLinear) and isinstance(low.b, NativeLinear):
                products.append((low.a.op, low.b.op))
            else:
                return None
        per_layer.append(products)
    return native.load().StackAdapter(per_layer)


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
        out.index_copy_(0, group.rows, low.b(h, residual=out.index_select(0, group.rows)))  # [n, out]
    return out
