"""lmrpc's own quantization of dense weights (a safetensors checkpoint's `--quantization int8/int4`) into the packed
layouts of packing.py: int8 per output channel (Q8), asymmetric int4 in groups of 32 (Q4, GGUF Q4_1's scheme)."""

from __future__ import annotations

import torch

from lmrpc.kernels import packing
from lmrpc.kernels.packing import PackedWeight


def _half(t: torch.Tensor) -> torch.Tensor:
    """Scales as stored (float16), back in float32: codes are computed against the stored value."""
    return t.clamp(min=packing.MIN_SCALE).half().float()


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    """Symmetric int8 per output channel: scale = max|w| / 127 (one group per row)."""
    w = weight.float()
    k = w.shape[1]
    scale = _half(w.abs().amax(dim=1) / 127.0)  # [n]
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    group = packing.round_up(k, 4)
    return packing.pack_q8(codes, scale[:, None], group)


# Rows quantized at once by quantize_int4: its float32 temporaries stay a few MB per row block instead of several bytes
# a weight of the whole matrix (a 1.7B checkpoint's load spent most of its time faulting such pages in).
QUANT_ROWS = 1024


def quantize_int4(weight: torch.Tensor) -> PackedWeight:
    """Asymmetric int4 in groups of 32 (GGUF Q4_1's scheme, float16 scale and offset): value q * scale + min.

    QUANT_ROWS rows at a time, the codes going straight into the Q4 layout's bytes (q4_tiles): the weight pack_q4
    makes of the same codes."""
    n, k = weight.shape
    k_pad = packing.round_up(k, packing.Q4_GROUP)
    groups = k_pad // packing.Q4_GROUP
    chunks = torch.empty(n, groups, 8, 2, dtype=torch.uint8)  # q4_tiles' bytes
    scale, offset = torch.empty(n, groups), torch.empty(n, groups)
    for r in range(0, n, QUANT_ROWS):
        w = weight[r : r + QUANT_ROWS].float()
        rows = w.shape[0]
        g = (w if k_pad == k else packing.pad(w, rows, k_pad)).view(rows, groups, packing.Q4_GROUP)
        lo, hi = g.amin(dim=2), g.amax(dim=2)  # [rows, groups]
        lo, step = lo.half().float(), _half((hi - lo) / 15.0)
        codes = (g - lo[..., None]).div_(step[..., None]).round_().clamp_(0, 15).to(torch.uint8)  # [rows, groups, 32]
        codes.view(rows, k_pad)[:, k:] = 0  # padding inputs hold code 0, as pack_q4 pads them
        chunks[r : r + rows] = packing.code_pairs(codes.view(rows, k_pad))
        scale[r : r + rows], offset[r : r + rows] = step, lo
    return packing.pack_q4_tiled(packing.q4_tiles(chunks, signed=False), n, k, scale, offset)
