"""DenseLinear's product routes on CPU: half-precision weights with float32 activations (see models/linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmrpc.server.models.linear import UPCAST_MIN_ROWS, DenseLinear, Workspace, has_native_bf16

CPU = torch.device("cpu")
NATIVE_BF16 = has_native_bf16(CPU)


def weight_and_inputs(out: int = 384, inp: int = 256, rows: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out, inp, generator=g) * 0.05).to(torch.bfloat16)  # [out, in]
    x = torch.randn(rows, inp, generator=g)  # [rows, in] float32 activations
    return w, x


def test_route_follows_the_cpu() -> None:
    ws = Workspace.for_device(CPU, torch.bfloat16)
    assert ws.prepack == (NATIVE_BF16 and torch.backends.mkldnn.is_available())
    assert ws.upcast_min_rows == (None if NATIVE_BF16 else UPCAST_MIN_ROWS)
    fp32 = Workspace.for_device(CPU, torch.float32)
    assert not fp32.prepack and fp32.upcast_min_rows is None  # float32 weights: plain GEMMs


@pytest.mark.skipif(not NATIVE_BF16, reason="needs a CPU with bf16 instructions (AVX512-BF16 or AMX)")
def test_packed_weights_give_the_plain_kernels_bits_whatever_the_row_count() -> None:
    w, x = weight_and_inputs()
    layer = DenseLinear(w.clone(), workspace=Workspace.for_device(CPU, torch.bfloat16))
    assert layer.packed is not None and layer.weight.numel() == 0  # only the packed copy is kept
    expected = F.linear(x.to(torch.bfloat16), w).float()  # [rows, out]
    assert torch.equal(layer(x), expected)
    # Batch invariance: a row's output does not depend on how many rows share the product, so batching and
    # prefix-cache hits can't change a greedy output.
    for rows in (1, 2, 3, 7, 8, 33):
        assert torch.equal(layer(x[:rows]), expected[:rows]), rows


def test_upcast_route_tracks_the_half_precision_route() -> None:
    """CPUs without bf16 instructions up-cast weight tiles for many rows; it multiplies the same rounded inputs."""
    w, x = weight_and_inputs()
    upcast = DenseLinear(w.clone(), workspace=Workspace(upcast_min_rows=8, elements=4096))  # several tiles
    plain = DenseLinear(w.clone(), workspace=Workspace(upcast_min_rows=None))
    exact = F.linear(x.to(torch.bfloat16).float(), w.float())  # [rows, out] float32 products of the bf16 values
    torch.testing.assert_close(upcast(x), exact, atol=1e-5, rtol=1e-5)  # many rows: float32 GEMM, not rounded
    torch.testing.assert_close(upcast(x[:3]), plain(x[:3]))  # few rows: the half-precision kernel
    torch.testing.assert_close(plain(x), exact, atol=0.02, rtol=0.01)  # its output rounded to bf16


def test_bias_is_added_in_float32() -> None:
    w, x = weight_and_inputs()
    bias = torch.randn(w.shape[0])
    layer = DenseLinear(w.clone(), bias, workspace=Workspace.for_device(CPU, torch.bfloat16))
    no_bias = DenseLinear(w.clone(), workspace=Workspace.for_device(CPU, torch.bfloat16))
    assert torch.equal(layer(x), no_bias(x) + bias)
