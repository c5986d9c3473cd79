"""An adapter as low-rank products on the model's fused projections, and their application to one step's rows.

The model computes q, k and v in one fused product, and gate and up in another. An adapter's delta on the fused
output is one A product, A_fused stacking the targeted modules' A matrices ([sum of ranks, in]), then one B product
per targeted module (scale folded in): its rank columns of A's output -> its slice of the fused output (not one
B_fused with zero blocks: those would be read and multiplied for nothing, a third of the work on qkv). The
products run on the same kernels as the base layers (dense, the model's dtype), with the base layer's prologue (its
RMSNorm, or SiLU-and-multiply) fused into the A product and the base output added as the B products' residual, so:

- each row's delta is computed alone (the kernels are row-invariant): a request's bits do not depend on which
  other rows, or adapters, share the step;
- rows are grouped by adapter: one A product and a B product per targeted module per adapter, fused projection
  and layer, never a loop over tokens.

What a step applies (`LayerLora`, `RowGroup`, `add_delta`: the Python loop's way, models/llama.py's DecoderLayer)
lives with the models in models/lora_delta.py, so models never import this package. The native decoder stack does
the same with the same kernels in the same order, reading and writing the group's rows where they lie
(`native_adapter` gives it an adapter's products), so a step gives the same bits on either path.
"""

from __future__ import annotations

from typing import cast

import torch

from lmrpc.kernels import native, packing
from lmrpc.server.lora.adapter import AdapterFile
from lmrpc.server.models.linear import DenseLinear, LinearLayer
from lmrpc.server.models.lora_delta import FUSED, LayerLora, LowRank, ModuleB
from lmrpc.server.models.quantized import LinearBuilder, NativeLinear


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
    parts = []
    for slot, module in enumerate(present):
        pair = adapter.modules[(layer, module)]
        a[slot * rank : (slot + 1) * rank] = pair.a
        out_start = sum(out_sizes[: modules.index(module)])
        parts.append(ModuleB(dense_layer(builder, pair.b * adapter.scale), slot * rank, out_start))  # [out, rank]
    return LowRank(dense_layer(builder, a), tuple(parts))


def native_adapter(layers: tuple[LayerLora, ...]) -> object | None:
    """The native decoder stack's form of an adapter (a StackAdapter holding the same kernel objects), or None when
    its products are not all native (then steps with it run the Python loop)."""
    per_layer: list[list[tuple[object, list[tuple[object, int, int]]] | None]] = []
    for layer in layers:
        products: list[tuple[object, list[tuple[object, int, int]]] | None] = []  # (a, [(b, rank_start, out_start)])
        for name in FUSED:
            low: LowRank | None = getattr(layer, name)
            if low is None:
                products.append(None)
                continue
            if not isinstance(low.a, NativeLinear) or not all(isinstance(p.b, NativeLinear) for p in low.parts):
                return None
            products.append((low.a.op, [(cast(NativeLinear, p.b).op, p.rank_start, p.out_start)
                                        for p in low.parts]))
        per_layer.append(products)
    return native.load().StackAdapter(per_layer)
