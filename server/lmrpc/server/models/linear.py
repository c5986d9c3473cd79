"""The one interface every linear layer of our models goes through, so quantized weights can slot in.

Precision on CPU: x86 CPUs without native bf16/fp16 matrix instructions (no AVX512-BF16/AMX) run a half-precision
GEMM one row at a time, so a batch of 32 rows costs 32 times one row (measured here: 7.3 ms against 0.23 ms for a
3072x576 weight), while float32 GEMMs batch well (1.3 ms for 32 rows). So on CPU a half-precision model keeps its
weights (and KV cache) in half precision, as `--dtype` asks, but carries activations in float32
(`activation_dtype`); each product then takes the cheaper route for its row count (`DenseLinear.forward`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

# At or above this many rows, up-casting the weight (tile by tile) and running a float32 GEMM beats the
# half-precision per-row kernel (measured on this CPU: break-even near 8 rows for a 3072x576 weight).
UPCAST_MIN_ROWS = 8
WORKSPACE_ELEMENTS = 1 << 21  # float32 scratch for up-cast weight tiles: 8 MiB, sized to stay cache-friendly


def has_native_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively: CUDA, or an x86 CPU with AVX512-BF16 or AMX."""
    if device.type != "cpu":
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`--dtype auto` is bfloat16 where it runs natively, else float32: without bf16 instructions a CPU computes
    bf16 products through per-row conversions whose rounding depends on the route a row takes (batch size,
    prefix-cache hit), so the same request could decode differently; float32 is exact across routes there."""
    if name == "auto":
        return torch.bfloat16 if has_native_bf16(device) else torch.float32
    return getattr(torch, name)


def activation_dtype(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype activations are carried in: float32 for half-precision weights on CPU, else the weights'."""
    if device.type == "cpu" and weight_dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return weight_dtype


class LinearLayer(Protocol):
    """y = x @ W.T (+ b). Implementations may store W however they like (dense, int8, int4)."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # [tokens, in] -> [tokens, out]


class Workspace:
    """Scratch memory shared by all linear layers of one model (one forward runs at a time, on one thread)."""

    def __init__(self, elements: int = WORKSPACE_ELEMENTS) -> None:
        self.elements = elements
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def buffer(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(self.elements, dtype=dtype, device=device)
        return self._buffers[key]


class DenseLinear(nn.Module):
    """A dense weight in the storage dtype; inputs and outputs in the activation dtype (see the module doc)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 workspace: Workspace | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in], storage dtype
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None  # [out]
        self.workspace = workspace or Workspace()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        w = self.weight
        if x.dtype == w.dtype:
            return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        # Both routes multiply the same half-precision-rounded inputs and accumulate in float32, so a sequence's
        # numbers barely depend on how many rows share its step. Few rows: the half-precision GEMV (it reads half
        # the bytes); many: up-cast weight tiles and one float32 GEMM.
        xh = x.to(w.dtype)
        y = F.linear(xh, w).to(x.dtype) if x.shape[0] < UPCAST_MIN_ROWS else self._upcast_matmul(xh.to(x.dtype))
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _upcast_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with W up-cast to x's dtype a tile of output rows at a time, so no full copy is ever made."""
        w = self.weight
        scratch = self.workspace.buffer(x.dtype, x.device)
        rows = max(1, self.workspace.elements // self.in_features)
        if rows >= self.out_features:
            tile = scratch[: w.numel()].view_as(w)
            tile.copy_(w)
            return F.linear(x, tile)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)  # [tokens, out]
        for lo in range(0, self.out_features, rows):
            hi = min(lo + rows, self.out_features)
            tile = scratch[: (hi - lo) * self.in_features].view(hi - lo, self.in_features)
            tile.copy_(w[lo:hi])
            out[:, lo:hi] = F.linear(x, tile)
        return out
