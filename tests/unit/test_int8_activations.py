"""Q4 products with int8 activations (`--int8-activations`): bfloat16 compute on AVX512-VNNI, float32 compute on
AVX2. Each product equals, bit for bit, a reference that quantizes each row as the kernels define it (per group of
32: d = max|x| / 127, q = round-half-even(x * (127 / max|x|))) and folds exact integer sums against the codes gguf's
`dequantize` gives (gguf_blocks_ref.py): per row and output, for each group in order, Y = fma(isum * d, scale, Y),
then Y = fma(d * sum(q), offset, Y) (Q4_0: codes q + 8 and offset -8 * scale), for every row count and however rows
are split between threads. Products after SILU_MUL (the MLP's down projection) keep their float inputs."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_blocks_ref import Q4_FORMATS, Reference, fma, random_blocks, reference
from tiny_gguf import T as GGML
from tiny_gguf import write_tiny_llama

from lmrpc.kernels import gguf_blocks, native, packing, quantize
from lmrpc.kernels.packing import Compute, PackedWeight
from lmrpc.server.config import ModelConfig
from lmrpc.server.models.loader import load_model
from lmrpc.server.models.quantized import NativeLinear


def _int8_compute() -> Compute | None:
    """The compute type whose Q4 products take int8 activations in this build, or None."""
    if not native.available():
        return None
    lib = native.load()
    return Compute.BF16 if lib.native_vnni() else Compute.F32 if lib.native_avx2() else None


COMPUTE = _int8_compute()
pytestmark = pytest.mark.skipif(COMPUTE is None, reason="no int8-activation products in this build (AVX2 or VNNI)")

ROWS = [*range(1, 14), 16, 17, 31, 40]


def kernel(p: PackedWeight, int8: bool, compute: Compute | None = None, **kw: Any) -> Any:
    ks = p.kscales
    extra = {} if ks is None else {"kd": ks.d, "kdmin": ks.dmin, "ksc": ks.sc, "km": ks.m,
                                   "super_groups": ks.super_groups, "sc_signed": ks.sc.dtype == torch.int8}
    kind = COMPUTE if compute is None else compute  # (not `compute or COMPUTE`: Compute.F32 is 0)
    return native.load().PackedLinear(int(p.format), int(kind), p.n, p.k, p.group, p.q4_signed, p.data, p.scale,
                                      p.offset, None, int8_activations=int8, **extra, **kw)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 rows [m, k] -> int8 codes [m, groups, 32], d and d * sum(q) [m, groups], in float32 throughout."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(g).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.rint(g * inv[..., None].astype(np.float32))
    d = amax / np.float32(127)
    return q.astype(np.int64), d, d * q.sum(-1).astype(np.float32)


def int8_reference(fmt: str, ref: Reference, x: np.ndarray) -> np.ndarray:
    """y [m, n] as the int8 products compute x @ W.T."""
    codes, scale, offset = ref.codes, ref.scale, ref.offset
    if fmt == "q4_0":  # stored as q in 0..15 with value (q - 8) * scale
        codes, offset = codes + 8, scale * np.float32(-8)
    q, d, dsum = quantize_rows(x)
    n, groups = scale.shape
    isum = np.einsum("mgj,ngj->mng", q, codes.astype(np.int64).reshape(n, groups, 32))  # exact
    y = np.zeros((x.shape[0], n), np.float32)
    for g in range(groups):
        a = isum[:, :, g].astype(np.float32) * d[:, g : g + 1]
        y = fma(a, np.broadcast_to(scale[None, :, g], y.shape), y)
        if offset is not None:
            y = fma(np.broadcast_to(dsum[:, g : g + 1], y.shape), np.broadcast_to(offset[None, :, g], y.shape), y)
    return y


@pytest.mark.parametrize("fmt", sorted(Q4_FORMATS))
def test_products_equal_the_reference_bitwise_for_every_row_count_and_split(fmt: str) -> None:
    # 64 outputs: one block of tile pairs, so two threads split its rows in uneven chunks; 100: padded tiles.
    for n, k in ((64, 512), (100, 256)):
        raw = random_blocks(fmt, n, k, seed=n)
        p, ref = gguf_blocks.pack_gguf(int(Q4_FORMATS[fmt]), raw, n, k), reference(fmt, raw, n, k)
        lin = kernel(p, int8=True)
        assert lin.int8_activations
        x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k))
        x[3, :32] = 0.0  # a group of zeros: d = 0, no division by it
        expected = int8_reference(fmt, ref, x.numpy())
        threads = torch.get_num_threads()
        try:
            for count in (1, threads):
                torch.set_num_threads(count)
                for m in ROWS:
                    assert np.array_equal(lin.forward(x[:m]).numpy(), expected[:m]), (n, m, count)
                for i in (0, 3, 13, 39):  # a row alone
                    assert np.array_equal(lin.forward(x[i : i + 1]).numpy(), expected[i : i + 1]), i
        finally:
            torch.set_num_threads(threads)
        # And it is not the product without them: int8 rounding is coarser.
        assert not np.array_equal(kernel(p, int8=False).forward(x).numpy(), expected)


def test_our_own_int4_weights_take_them_too() -> None:
    n, k = 96, 320
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    p = quantize.quantize_int4(w)
    lin = kernel(p, int8=True)
    assert lin.int8_activations
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    y = lin.forward(x)
    # Within int8 rounding of the float product (relative error of a product ~5e-3), and row-invariant.
    exact = x.double() @ packing.dequantize(p).double().T
    assert float((y.double() - exact).norm() / exact.norm()) < 2e-2
    for i in range(9):
        assert torch.equal(lin.forward(x[i : i + 1]), y[i : i + 1])


def test_products_after_silu_keep_their_float_inputs() -> None:
    # The MLP's gated activations have outliers that int8 per 32 inputs rounds away: that call site keeps floats.
    n, k = 96, 64
    p = quantize.quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.05)
    gate_up = torch.randn(9, 2 * k, generator=torch.Generator().manual_seed(4))
    int8, plain = kernel(p, int8=True), kernel(p, int8=False)
    assert torch.equal(int8.forward(gate_up, silu=True), plain.forward(gate_up, silu=True))
    x = gate_up[:, :k].contiguous()
    assert not torch.equal(int8.forward(x), plain.forward(x))


def test_only_q4_weights_in_the_builds_compute_take_them() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    assert not kernel(quantize.quantize_int8(w), int8=True).int8_activations  # 8-bit codes: float inputs
    other = Compute.F32 if COMPUTE == Compute.BF16 else Compute.BF16
    if other == Compute.F32 or native.load().native_bf16():
        assert not kernel(quantize.quantize_int4(w), int8=True, compute=other).int8_activations


def test_the_loader_says_which_weights_take_them(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_llama_dir
    dtype = "bfloat16" if COMPUTE == Compute.BF16 else "float32"
    with caplog.at_level(logging.INFO, logger="lmrpc.server.models.quantized"):
        loaded = load_model(ModelConfig(path=str(model), dtype=dtype, device="cpu", quantization="int4",
                                            int8_activations=True))
    linears = loaded.model.linear_layers()  # type: ignore[attr-defined]
    took = [isinstance(lin, NativeLinear) and lin.int8_activations for lin in linears]
    # The int8 output head does not, nor the down projections (their SiLU-gated inputs stay float); the rest do.
    assert took == [False] + [True, True, True, False] * 2
    assert "6 of 9 weights take int8 activations" in caplog.text
    # Without 4-bit weights nothing can: a warning says so.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmrpc.server.models.quantized"):
        load_model(ModelConfig(path=str(model), dtype=dtype, device="cpu", quantization="int8",
                               int8_activations=True))
    assert "no product takes them here" in caplog.text


def test_codes_rewritten_in_place_give_the_same_products_and_rows() -> None:
    """vnni_in_place (the loader's: its arena holds each layer's own copy): on AVX512-VNNI the codes are put in the
    int8 products' order where they lie rather than once more beside them, so the weight is held once. Products and
    embedding rows (a tied head's) are bit for bit the copy's; SiLU-gated (float) inputs are refused."""
    vnni = bool(native.load().native_vnni())
    n, k = 100, 256
    for fmt in sorted(Q4_FORMATS):
        raw = random_blocks(fmt, n, k, seed=7)
        p = gguf_blocks.pack_gguf(int(Q4_FORMATS[fmt]), raw, n, k)
        copy, plain = kernel(p, int8=True), kernel(p, int8=False)
        own = replace(p, data=p.data.clone())
        in_place = kernel(own, int8=True, vnni_in_place=True)
        assert in_place.codes_in_vnni_order == vnni and not copy.codes_in_vnni_order
        assert not torch.equal(own.data, p.data) if vnni else torch.equal(own.data, p.data)
        x = torch.randn(17, k, generator=torch.Generator().manual_seed(8))
        for m in (1, 2, 7, 17):
            assert torch.equal(in_place.forward(x[:m]), copy.forward(x[:m])), (fmt, m)
        ids = torch.tensor([0, 5, 31, 32, 99])
        assert torch.equal(in_place.rows(ids), plain.rows(ids)), fmt
        assert in_place.nbytes == plain.nbytes
        assert copy.nbytes == plain.nbytes + (p.n_pad * p.k_pad // 2 if vnni else 0)
        if vnni:
            with pytest.raises(RuntimeError, match="takes no SiLU-gated inputs"):
                in_place.forward(torch.randn(2, 2 * k), silu=True)


def test_the_loader_holds_a_tied_q4_head_once(tmp_path: Path) -> None:
    """A GGUF whose matrices are all Q4_0, its output head tied to the embeddings, loaded with int8 activations:
    where the codes are reordered in place (VNNI), the embedding rows read from the reordered head are those of
    the same file loaded without int8 activations, and the down projections (float inputs) keep the stored order."""
    if COMPUTE != Compute.BF16:
        pytest.skip("the codes are reordered only for AVX512-VNNI's int8 products")
    path = write_tiny_llama(tmp_path / "q4_0.gguf", GGML.Q4_0)
    loaded = {int8: load_model(ModelConfig(path=str(path), dtype="bfloat16", device="cpu", int8_activations=int8))
              for int8 in (False, True)}
    model = loaded[True].model
    head = model.lm_head  # type: ignore[attr-defined]
    assert head.op.codes_in_vnni_order
    for layer in model.layers:  # type: ignore[attr-defined]
        assert layer.qkv.op.codes_in_vnni_order and layer.gate_up.op.codes_in_vnni_order
        assert not layer.down.int8_activations and not layer.down.op.codes_in_vnni_order
    ids = torch.tensor([0, 1, 17, 4096, 49151])
    assert torch.equal(model.embed(ids), loaded[False].model.embed(ids))  # type: ignore[attr-defined]
