"""Block weights' products with int16 activations: float32 compute on AVX2 (CPUs without AVX512-BF16), on by default
there under `--dtype auto` (`--no-int16-activations` or `--dtype float32` keeps float32 inputs). Each product
equals, bit for bit, a reference that quantizes each row as the kernels define it (per group of 32: d = max|x| /
32767, q = round-half-even(x * (32767 / max|x|))) and folds exact integer sums against the codes gguf's `dequantize`
gives (gguf_blocks_ref.py): per row and output, for each weight group in order, Y = fma(isum * d, scale, Y), then
Y = fma(d * sum(q), offset, Y) (Q4_0: codes q + 8 and offset -8 * scale), for every row count and however rows are
split between threads, after every prologue."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks_ref import FORMATS, Q4_FORMATS, Reference, fma, random_blocks, reference

from lmrpc.kernels import gguf_blocks, native, packing, quantize
from lmrpc.kernels.packing import Compute, PackedWeight
from lmrpc.server.config import ModelConfig
from lmrpc.server.models.linear import resolve_dtype
from lmrpc.server.models.loader import load_model
from lmrpc.server.models.quantized import NativeLinear

AVX2 = native.available() and bool(native.load().native_avx2())
NOT_AVX2 = "int16 activations are the AVX2 build's (float32 compute)"  # (test_native_kernels looks for it)
pytestmark = pytest.mark.skipif(not AVX2, reason=NOT_AVX2)

ROWS = [*range(1, 14), 16, 17, 31, 40]


def kernel(p: PackedWeight, int16: bool, compute: Compute = Compute.F32, int8: bool = False) -> Any:
    p = gguf_blocks.held_for(p, compute == Compute.BF16)  # as the server holds it (IQ4: Q8 for float32 compute)
    ks = p.kscales
    extra = {} if ks is None else {"kd": ks.d, "kdmin": ks.dmin, "ksc": ks.sc, "km": ks.m,
                                   "super_groups": ks.super_groups, "sc_signed": ks.sc.dtype == torch.int8}
    return native.load().PackedLinear(int(p.format), int(compute), p.n, p.k, p.group, p.q4_signed, p.data, p.scale,
                                      p.offset, None, int8_activations=int8, int16_activations=int16,
                                      code_values=list(p.code_values or ()),
                                      **extra)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 rows [m, k] -> int16 codes [m, groups, 32], d and d * sum(q) [m, groups], in float32 throughout."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(g).max(-1)
    inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.rint(g * inv[..., None].astype(np.float32))
    assert np.abs(q).max() <= 32767
    d = amax / np.float32(32767)
    return q.astype(np.int64), d, d * q.sum(-1).astype(np.float32)


def int16_reference(fmt: str, ref: Reference, x: np.ndarray) -> np.ndarray:
    """y [m, n] as the int16 products compute x @ W.T: per weight group (32 or 16 inputs) an exact integer sum,
    made float32 (rounded, for 8-bit codes beyond 2^24) and scaled by its inputs' d."""
    codes, scale, offset, group = ref.codes, ref.scale, ref.offset, ref.group
    if fmt == "q4_0":  # stored as q in 0..15 with value (q - 8) * scale
        codes, offset = codes + 8, scale * np.float32(-8)
    q, d, dsum = quantize_rows(x)
    n, groups = scale.shape
    m = x.shape[0]
    isum = np.einsum("mgj,ngj->mng", q.reshape(m, groups, group), codes.astype(np.int64).reshape(n, groups, group))
    assert np.abs(isum).max() < 2**31  # exact in int32
    if fmt in Q4_FORMATS:
        assert np.abs(isum).max() < 2**24  # so float32(isum) is exact too
    y = np.zeros((m, n), np.float32)
    for g in range(groups):
        ag = g * group // 32  # the inputs' group of 32
        a = isum[:, :, g].astype(np.float32) * d[:, ag : ag + 1]
        y = fma(a, np.broadcast_to(scale[None, :, g], y.shape), y)
        if offset is not None:
            y = fma(np.broadcast_to(dsum[:, ag : ag + 1], y.shape), np.broadcast_to(offset[None, :, g], y.shape), y)
    return y


def q8_0(n: int, k: int, seed: int) -> tuple[PackedWeight, Reference]:
    """Random Q8_0 blocks (fp16 d, then 32 int8 codes) packed as the loader packs them, and their reference."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(1e-3, 2e-2, (n, k // 32)).astype(np.float16)
    codes = rng.integers(-128, 128, (n, k // 32, 32), dtype=np.int8)  # -128 too: the widest code
    raw = np.concatenate([d.view(np.uint8).reshape(n, k // 32, 2), codes.view(np.uint8)], axis=-1).reshape(n, -1)
    p = gguf_blocks.pack_gguf(int(gguf.GGMLQuantizationType.Q8_0), raw, n, k)
    ref = Reference(codes.astype(np.float32).reshape(n, k) * np.repeat(d.astype(np.float32), 32, axis=1),
                    codes.astype(np.float32).reshape(n, k), d.astype(np.float32), None, 32)
    return p, ref


def weight_of(fmt: str, n: int, k: int) -> tuple[PackedWeight, Reference]:
    if fmt == "q8_0":
        return q8_0(n, k, seed=n)
    qtype = {**Q4_FORMATS, **FORMATS}[fmt]
    raw = random_blocks(fmt, n, k, seed=n)
    return gguf_blocks.pack_gguf(int(qtype), raw, n, k), reference(fmt, raw, n, k)


# Q2_K's groups of 16 inputs carry offsets: they would need each group's input sum, which the int16 products keep per
# 32 inputs (one d): Q2_K keeps float32 inputs (below).
INT16_FORMATS = sorted([*Q4_FORMATS, *(f for f in FORMATS if f != "q2_k"), "q8_0"])


@pytest.mark.parametrize("fmt", INT16_FORMATS)
def test_products_equal_the_reference_bitwise_for_every_row_count_and_split(fmt: str) -> None:
    # 64 outputs: one block of tile pairs, so two threads split its rows in uneven chunks; 100: padded tiles.
    for n, k in ((64, 512), (100, 256)):
        p, ref = weight_of(fmt, n, k)
        lin = kernel(p, int16=True)
        assert lin.int16_activations and not lin.int8_activations
        x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k))
        x[3, :32] = 0.0  # a group of zeros: d = 0, no division by it
        x[5, 40] = 1e4  # an outlier: its group's other inputs keep 1/65534 of it
        expected = int16_reference(fmt, ref, x.numpy())
        threads = torch.get_num_threads()
        try:
            for count in (1, threads):
                torch.set_num_threads(count)
                for m in ROWS:
                    assert np.array_equal(lin.forward(x[:m]).numpy(), expected[:m]), (n, m, count)
                for i in (0, 3, 5, 13, 39):  # a row alone
                    assert np.array_equal(lin.forward(x[i : i + 1]).numpy(), expected[i : i + 1]), i
        finally:
            torch.set_num_threads(threads)
        # Not the float32 product, but within int16 rounding of it.
        plain = kernel(p, int16=False).forward(x).numpy()
        assert not np.array_equal(plain, expected)
        assert float(np.linalg.norm(plain - expected) / np.linalg.norm(plain)) < 1e-4


def test_every_prologue_takes_them() -> None:
    # Unlike int8, the SiLU-gated inputs of the down projection enter as int16 too: an outlier costs the other
    # inputs of its group 1/65534 of its size, not 1/254.
    n, k = 96, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.05
    p = quantize.quantize_int4(w)
    lin, plain = kernel(p, int16=True), kernel(p, int16=False)
    gate_up = torch.randn(9, 2 * k, generator=torch.Generator().manual_seed(4))
    norm = torch.rand(k, generator=torch.Generator().manual_seed(5)) + 0.5
    for kwargs in ({"silu": True}, {"norm_weight": norm, "eps": 1e-5}):
        x = gate_up if "silu" in kwargs else gate_up[:, :k].contiguous()
        y = lin.forward(x, **kwargs)
        assert not torch.equal(y, plain.forward(x, **kwargs))
        rel = (y - plain.forward(x, **kwargs)).norm() / y.norm()
        assert float(rel) < 1e-4, kwargs
        for i in range(9):
            assert torch.equal(lin.forward(x[i : i + 1], **kwargs), y[i : i + 1])
    exact = gate_up[:, :k].double() @ packing.dequantize(p).double().T
    y = lin.forward(gate_up[:, :k].contiguous()).double()
    assert float((y - exact).norm() / exact.norm()) < 1e-4


def test_only_block_weights_with_float32_compute_take_them_and_int8_wins() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    # Per-channel int8 (one group of every input): sums span many groups of inputs, each with its own d.
    assert not kernel(quantize.quantize_int8(w), int16=True).int16_activations
    q4 = quantize.quantize_int4(w)
    assert kernel(q4, int16=True).int16_activations
    both = kernel(q4, int16=True, int8=True)
    assert both.int8_activations and not both.int16_activations
    if native.load().native_bf16():
        assert not kernel(q4, int16=True, compute=Compute.BF16).int16_activations
    q2_k, _ = weight_of("q2_k", 64, 256)  # offsets per 16 inputs
    assert not kernel(q2_k, int16=True).int16_activations


@pytest.mark.skipif(resolve_dtype("auto", torch.device("cpu")) != torch.float32,
                    reason="dtype auto is bfloat16 on this CPU (the AVX2 build forced on an AVX512-BF16 host)")
def test_dtype_auto_takes_them_and_float32_or_the_flag_does_not(
        tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    def took(dtype: str = "auto", **kwargs: Any) -> list[bool]:
        loaded = load_model(ModelConfig(path=str(tiny_llama_dir), dtype=dtype, device="cpu", quantization="int4",
                                        **kwargs))
        linears = loaded.model.linear_layers()  # type: ignore[attr-defined]
        return [isinstance(lin, NativeLinear) and lin.int16_activations for lin in linears]

    with caplog.at_level(logging.INFO, logger="lmrpc.server.models.quantized"):
        # the per-channel int8 output head does not (one group of all inputs); every int4 layer product does
        assert took() == [False] + [True] * 8
    assert "int16 activations: 8 of 9 weights" in caplog.text
    assert not any(took(int16_activations=False))
    assert not any(took("float32"))  # asked for by name: exact float32 inputs
