"""Linear layers on lmrpc's native CPU kernels, and the choice of each weight's format (`--quantization`).

`NativeLinear` runs `y = prologue(x) W^T (+ b) (+ residual)` with one kernel per weight format whatever the row
count, each output row computed alone: batching never changes a row (see kernels/lmrpc/kernels/csrc/linear.h).

Formats, by `--quantization`:
- none: the checkpoint's values in the model dtype (bfloat16 weights take bfloat16 products; float32, float32).
- int8: symmetric int8 per output channel, made here from the dense values.
- int4: a GGUF file's own blocks as they are (as auto); from a dense checkpoint, asymmetric
  int4 in groups of 32 (Q4_1's scheme), with the output projection in int8 (it decides every token; 4 bits cost it
  most).
- auto: a GGUF file's own formats where a kernel exists (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to
  Q6_K, IQ4_NL, IQ4_XS: kernels/gguf_blocks.py), everything else dense; a dense checkpoint stays dense.
Activations enter products rounded to bfloat16 when the model dtype is bfloat16, else in float32.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field, replace

import torch

from lmrpc.kernels import gguf_blocks, hugepages, native, packing, quantize
from lmrpc.kernels.packing import Compute, PackedWeight, WeightFormat
from lmrpc.server.models.linear import DenseLinear, LinearLayer
from lmrpc.server.models.weights import Matrix, RowParts

logger = logging.getLogger(__name__)


class Quantization(enum.Enum):
    AUTO = "auto"
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"


class NativeLinear:
    """A LinearLayer over a packed weight (see the module doc)."""

    def __init__(self, weight: PackedWeight, compute: Compute, bias: torch.Tensor | None = None,
                 expand_codes: bool = False, int8_activations: bool = False, int16_activations: bool = False,
                 arena: hugepages.Arena | None = None) -> None:
        weight = gguf_blocks.held_for(weight, compute == Compute.BF16)  # (IQ4 codes: bfloat16 products only)
        if arena is not None:  # the weight's tensors, and its expanded codes below, in huge pages
            ks = weight.kscales
            if ks is not None:
                ks = replace(ks, d=arena.place(ks.d), dmin=_placed(arena, ks.dmin), sc=arena.place(ks.sc),
                             m=_placed(arena, ks.m))
            weight = replace(weight, data=arena.place(weight.data), scale=_placed(arena, weight.scale),
                             offset=_placed(arena, weight.offset), kscales=ks)
        self.weight = weight  # the packed weight (kept for introspection; the kernel object holds its tensors)
        self.compute = compute
        self.in_features, self.out_features = weight.k, weight.n
        codes = None
        eight_bit = weight.format in (WeightFormat.Q8, WeightFormat.Q6)
        if arena is not None and expand_codes and eight_bit and compute == Compute.BF16:
            # bfloat16 codes [n_pad * k_pad] (the kernel expands them where the CPU has AVX512-BF16, else leaves
            # this untouched: never resident)
            codes = arena.zeros((weight.n_pad * weight.k_pad,), torch.int16)
        # With int8 activations on AVX512-VNNI the kernel reorders Q4 codes for them: in place when the arena holds
        # this layer's own copy (else once more), so the weight is held once. self.weight.data then holds that order.
        self._op = native.load().PackedLinear(
            int(weight.format), int(compute), weight.n, weight.k, weight.group, weight.q4_signed, weight.data,
            weight.scale, weight.offset, None if bias is None else bias.float().contiguous(),
            expand_codes=expand_codes, int8_activations=int8_activations,
            int16_activations=int16_activations, codes=codes, **_kscale_args(weight),
            vnni_in_place=arena is not None, code_values=list(weight.code_values or ()),
        )

    def __call__(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, silu: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._op.forward(x, norm_weight=norm, eps=eps, silu=silu, residual=residual)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the dequantized weight, float32 [len(ids), in] (embedding lookups of a tied weight)."""
        return self._op.rows(ids)

    @property
    def nbytes(self) -> int:
        return int(self._op.nbytes)

    @property
    def op(self) -> object:
        """The kernel object (the native decoder stack holds it too)."""
        return self._op

    @property
    def int8_activations(self) -> bool:
        """Whether its products take int8 activations (asked for, and this build has them for its format)."""
        return bool(self._op.int8_activations)

    @property
    def int16_activations(self) -> bool:
        """Whether its products take int16 activations (asked for, and this build has them for its format)."""
        return bool(self._op.int16_activations)

    @property
    def labels(self) -> tuple[str, ...]:
        """The weight's format (PackedWeight.label); a stacked product's, one per part."""
        return (self.weight.label,)


class StackedLinear(NativeLinear):
    """A NativeLinear over parts stacked along their rows, each in its own format (weights.RowParts): part i writes
    its columns of the output, all parts' work shared out in one parallel region, each part computed as it would be
    alone. The native decoder stack and LoRA take it as any other product."""

    def __init__(self, parts: list[NativeLinear]) -> None:  # (no super().__init__: there is no one weight)
        assert len(parts) > 1 and len({p.compute for p in parts}) == 1 and len({p.in_features for p in parts}) == 1
        self.parts = parts  # in output order
        self.compute = parts[0].compute
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        self._op = native.load().PackedLinear.stacked([p.op for p in parts])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("a stacked product is never an embedding table")

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(label for p in self.parts for label in p.labels)


def report_int8_activations(linears: list[LinearLayer]) -> tuple[int, int]:
    """--int8-activations: how many weights are set up for them (logged; a warning when none can), of how many.
    (Down projections, whose inputs are SiLU-gated, keep float inputs: LinearBuilder.build's gated_inputs.)"""
    took = sum(1 for lin in linears if isinstance(lin, NativeLinear) and lin.int8_activations)
    if took == 0:
        logger.warning("--int8-activations: no product takes them here: they need 4-bit weights (int4, Q4_0/Q4_1/"
                       "Q4_K) with bfloat16 compute on a CPU with AVX512-VNNI or float32 compute on an "
                       "AVX2 CPU, and the native kernels")
    else:
        logger.info("--int8-activations: %d of %d weights take int8 activations (the MLP's down projections keep "
                    "float inputs)", took, len(linears))
    return took, len(linears)


def report_int16_activations(linears: list[LinearLayer]) -> int:
    """How many weights take int16 activations (logged when any does: float32 compute on AVX2, 4-bit weights)."""
    took = sum(1 for lin in linears if isinstance(lin, NativeLinear) and lin.int16_activations)
    if took:
        logger.info("int16 activations: %d of %d weights (4-bit, float32 compute on AVX2; --no-int16-activations "
                    "keeps float32 inputs)", took, len(linears))
    return took


def _placed(arena: hugepages.Arena, t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else arena.place(t)


def _kscale_args(weight: PackedWeight) -> dict[str, object]:
    """A K-quant weight's scales as PackedLinear takes them (nothing for other weights)."""
    ks = weight.kscales
    if ks is None:
        return {}
    return {"kd": ks.d, "kdmin": ks.dmin, "ksc": ks.sc, "km": ks.m, "super_groups": ks.super_groups,
            "sc_signed": ks.sc.dtype == torch.int8, "d_scale": ks.d_scale}


# Bytes of bfloat16 copies of int8 weights' codes one model may keep (LinearBuilder): products of many rows read a
# copy instead of making the codes bf16 in registers (bundled model, 32 streams: decode steps ~12% faster). The
# bundled model's Q8_0 output head (57 MB) gets one; a 1.7B Q8_0 file's weights (3.4 GB of copies) mostly do not:
# a large model loads as its packed weights, not as a bf16 copy of itself. The same bits either way.
EXPANDED_CODES_BUDGET = 128 << 20


class CodesBudget:
    """What is left of a model's EXPANDED_CODES_BUDGET: the first int8 weights built take their copies from it."""

    def __init__(self, nbytes: int = EXPANDED_CODES_BUDGET) -> None:
        self.left = nbytes  # bytes still free

    def take(self, nbytes: int) -> bool:
        """Reserve nbytes if they fit (True), else leave the budget as it is (False)."""
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


@dataclass(frozen=True)
class LinearBuilder:
    """Makes every linear layer of a model in the format its quantization asks for."""

    quantization: Quantization  # as asked (auto resolved per tensor)
    dtype: torch.dtype  # the model dtype: dense weights, activations into products, the KV cache
    device: torch.device
    native: bool  # the native CPU kernels serve (else torch's DenseLinear)
    expand_codes: bool = True  # int8 weights: keep the codes expanded to bfloat16 too (ModelConfig.expand_codes)
    codes_budget: CodesBudget = field(default_factory=CodesBudget)  # ... within this model's budget
    int8_activations: bool = False  # 4-bit weights: int8 activations where the build has them (VNNI or AVX2)
    int16_activations: bool = False  # 4-bit weights: int16 activations where the build computes float32 on AVX2
    # where packed weights live: huge pages (one arena per model; kernels/hugepages.py)
    arena: hugepages.Arena = field(default_factory=hugepages.Arena)

    def __post_init__(self) -> None:
        if not self.native and self.quantization in (Quantization.INT8, Quantization.INT4):
            raise ValueError(f"--quantization {self.quantization.value} needs lmrpc's native CPU kernels, which "
                             f"serve only on CPU with a C++ compiler (device {self.device})")
        if self.native and self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the native CPU kernels compute in float32 or bfloat16, not {self.dtype}")

    @property
    def compute(self) -> Compute:
        return Compute.BF16 if self.dtype == torch.bfloat16 else Compute.F32

    def build(self, weight: Matrix, bias: torch.Tensor | None = None, output: bool = False,
              gated_inputs: bool = False) -> LinearLayer:
        """A layer for `weight` [out, in]; output: it is the output projection (int4 keeps it in 8 bits);
        gated_inputs: its inputs are SiLU-gated (an MLP's down projection), which keep float inputs under
        --int8-activations (the kernels' int8_inputs), so it is not set up for them."""
        if isinstance(weight, RowParts):
            if self.native and self.quantization in (Quantization.AUTO, Quantization.INT4):
                return self._stacked(weight, bias)
            weight = weight.dense()
        if not self.native:
            dense = packing.dequantize(weight) if isinstance(weight, PackedWeight) else weight
            return DenseLinear(dense.to(device=self.device, dtype=self.dtype),
                               None if bias is None else bias.to(self.device))
        packed = self._pack(weight, output)
        # A bfloat16 copy of the codes (2 bytes a weight) only for 8-bit formats (the 5- and 6-bit GGUF formats held
        # in 6 bits would take about 3x their file's bits), only where bf16 products read it (AVX512-BF16: elsewhere
        # the kernel would leave it untouched, and it must not spend the budget), and within the budget.
        expand = (self.expand_codes and packed.label in ("q8_0", "int8") and self.compute == Compute.BF16
                  and bool(native.load().native_bf16()) and self.codes_budget.take(2 * packed.n_pad * packed.k_pad))
        return NativeLinear(packed, self.compute, bias, expand_codes=expand,
                            int8_activations=self.int8_activations and not gated_inputs,
                            int16_activations=self.int16_activations, arena=self.arena)

    def _stacked(self, weight: RowParts, bias: torch.Tensor | None) -> StackedLinear:
        """Each part as the file gives it (with its slice of the bias), run side by side as one product."""
        parts: list[NativeLinear] = []
        start = 0
        for part in weight.parts:
            part_bias = None if bias is None else bias[start : start + part.n]
            built = self.build(part, part_bias)
            assert isinstance(built, NativeLinear)
            parts.append(built)
            start += part.n
        return StackedLinear(parts)

    def _pack(self, weight: PackedWeight | torch.Tensor, output: bool) -> PackedWeight:
        q = self.quantization
        if isinstance(weight, PackedWeight):  # a GGUF file's own blocks
            if q in (Quantization.AUTO, Quantization.INT4):
                return weight
            weight = packing.dequantize(weight)
        if q == Quantization.INT8 or (q == Quantization.INT4 and output):
            return quantize.quantize_int8(weight)
        if q == Quantization.INT4:
            return quantize.quantize_int4(weight)
        return packing.pack_dense(weight.to(self.dtype))

    def describe(self, formats: set[str]) -> str:
        """What GetModelInfo reports: the formats the layers ended up in, e.g. "Q4_1+Q8_0" or "none"."""
        return describe_formats(formats)


# Formats GetModelInfo has always named by their width (clients and dashboards read these); a model with any other
# quantized format (GGUF's Q5 and K-quants) is named by its formats, e.g. "Q4_K+Q6_K".
_LEGACY = {"q4_0": "int4", "q4_1": "int4", "q8_0": "int8", "int8": "int8"}


def describe_formats(formats: set[str] | tuple[str, ...]) -> str:
    """The quantized formats among layer labels (PackedWeight.label), upper-cased and joined: "Q4_K+Q6_K"; "none"
    when every layer is dense."""
    quantized = sorted({part.upper() for f in formats if f not in ("f32", "bf16", "f16") for part in f.split("+")})
    return "+".join(quantized) if quantized else "none"


def quantization_name(formats: tuple[str, ...]) -> str:
    """GetModelInfo's quantization: "int4", "int8" or "none" for our own and GGUF's Q4_0/Q4_1/Q8_0 formats, as
    before; with any other GGUF format, the formats (describe_formats)."""
    quantized = [part for f in formats if f not in ("f32", "bf16", "f16") for part in f.split("+")]
    if any(f not in _LEGACY for f in quantized):
        return describe_formats(formats)
    if any(_LEGACY[f] == "int4" for f in quantized):
        return "int4"
    return "int8" if quantized else "none"
