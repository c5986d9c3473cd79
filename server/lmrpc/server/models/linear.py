"""The one interface every linear layer of our models goes through (`LinearLayer`), and its torch implementation
(`DenseLinear`), which serves where lmrpc's native CPU kernels don't (CUDA, or a CPU build without a compiler); the
native one is `quantized.NativeLinear`. A call may fuse what surrounds a product in a decoder layer: an RMSNorm or
SiLU-and-multiply of the input, and a residual added to the output.

Precision on CPU: a half-precision model keeps its weights (and KV cache) in half precision, as `--dtype` asks, but
carries activations in float32 (`activation_dtype`): norms, RoPE and residual sums stay exact, and each product
rounds its input to the weights' dtype and accumulates in float32.

Which kernel runs a half-precision product depends on the CPU (`Workspace.upcast_min_rows`):
- with AVX512-BF16 or AMX, the native half-precision GEMM, for every row count. It is the fastest route there
  (measured on an AMD EPYC with AVX512-BF16: 35 ms for one pass over SmolLM2's 120 layer matrices at 32 rows,
  against 77 ms in float32), and a row's result does not depend on how many rows share the product, so batching
  and prefix-cache hits never change a greedy output.
- without them, a half-precision GEMM runs one row at a time, so 32 rows cost 32 times one row (measured on such
  a CPU: 7.3 ms against 0.23 ms for a 3072x576 weight), while float32 GEMMs batch well (1.3 ms for 32 rows): from
  UPCAST_MIN_ROWS rows on, weight tiles are up-cast and multiplied in float32.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lmrpc.kernels.torch_attention import rms_norm

# At or above this many rows, up-casting the weight (tile by tile) and running a float32 GEMM beats the
# half-precision per-row kernel (measured on this CPU: break-even near 8 rows for a 3072x576 weight).
UPCAST_MIN_ROWS = 8
WORKSPACE_ELEMENTS = 1 << 21  # float32 scratch for up-cast weight tiles: 8 MiB, sized to stay cache-friendly


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def has_native_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively: CUDA, or an x86 CPU with AVX512-BF16 or AMX."""
    return device.type != "cpu" or bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def has_native_half(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether products in this half-precision dtype run natively (fp16: AVX512-FP16 or AMX-FP16 on CPU)."""
    if dtype == torch.bfloat16:
        return has_native_bf16(device)
    return device.type != "cpu" or bool({"avx512_fp16", "amx_fp16"} & _cpu_flags())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`--dtype auto` is bfloat16 where its products run natively (CUDA, CPUs with AVX512-BF16 or AMX), else
    float32: elsewhere bf16 products are emulated (the native kernels' portable loops) or, on torch's route, computed
    through per-row conversions whose rounding depends on the batch."""
    if name == "auto":
        return torch.bfloat16 if has_native_bf16(device) else torch.float32
    return getattr(torch, name)


def activation_dtype(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype activations are carried in: float32 for half-precision weights on CPU, else the weights'."""
    if device.type == "cpu" and weight_dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return weight_dtype


def _can_prepack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class LinearLayer(Protocol):
    """y = prologue(x) @ W.T (+ b) (+ residual). Implementations store W as they like (dense, int8, int4)."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, silu: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [tokens, in] ([tokens, 2 * in] with silu: gate | up) -> [tokens, out].

        norm: RMSNorm weight [in] applied to x first (with eps); silu: x is gate | up, the product takes
        silu(gate) * up; residual [tokens, out] is added to the result."""
        ...





class Workspace:
    """The product route and scratch memory shared by all linear layers of one model (one forward runs at a time,
    on one thread)."""

    def __init__(self, upcast_min_rows: int | None = None, prepack: bool = False,
                 elements: int = WORKSPACE_ELEMENTS) -> None:
        self.upcast_min_rows = upcast_min_rows  # half-precision products of this many rows run in float32; None: never
        self.prepack = prepack  # bf16 weights on CPU are stored in oneDNN's packed layout (native bf16 CPUs)
        self.elements = elements
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype) -> Workspace:
        """The route for weights of `dtype` on `device` (see the module doc)."""
        half = dtype in (torch.bfloat16, torch.float16)
        native = has_native_half(device, dtype)
        return cls(
            upcast_min_rows=UPCAST_MIN_ROWS if half and not native else None,
            # Packed once here instead of by oneDNN on every call: the same kernel and the same bits, 1.3x (one
            # row) to 2.3x (32 rows) faster over SmolLM2's layer matrices on an AVX512-BF16 CPU.
            prepack=device.type == "cpu" and dtype == torch.bfloat16 and native and _can_prepack(),
        )

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
        self.storage_dtype = weight.dtype
        self.workspace = workspace or Workspace.for_device(weight.device, weight.dtype)
        # oneDNN's blocked copy of the weight, made once; then it is the only copy kept (the plain one is dropped)
        self.packed: torch.Tensor | None = None
        if self.workspace.prepack and weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
            weight = weight.new_empty(0)
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] in the storage dtype; empty if packed
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None  # [out]

    def forward(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, silu: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:  # see LinearLayer
        if norm is not None:
            x = rms_norm(x, norm, eps)
        if silu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        y = self._product(x)
        return y if residual is None else residual + y

    def _product(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        if x.dtype == self.storage_dtype and self.packed is None:
            return F.linear(x, self.weight, None if self.bias is None else self.bias.to(x.dtype))
        # Every route multiplies the same half-precision-rounded inputs and accumulates in float32. The native ones
        # round their output to half precision; the up-cast one (many rows, CPUs without native half GEMMs) does not.
        xh = x.to(self.storage_dtype)
        upcast = self.workspace.upcast_min_rows
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(xh, self.packed, None, "none", [], "").to(x.dtype)
        elif upcast is None or x.shape[0] < upcast:
            y = F.linear(xh, self.weight).to(x.dtype)
        else:
            y = self._upcast_matmul(xh.to(x.dtype))
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
