"""Products alone: a packed 4-bit weight times rows, with and without int8 activations (`--int8-activations`).

    nice -n 19 .venv/bin/python bench/products.py [--rounds 5] [--rows 1 8 64 256] [--format int4|q4_0|q4_k|q6_k]

The weights have SmolLM2-1.7B's product shapes (qkv 6144x2048, gate_up 16384x2048, down 2048x8192; random values,
which speed does not depend on), quantized as --quantization int4 does (or GGUF blocks of random bytes). The down
projection's shape runs as a plain product here; served, its inputs (after SiLU-gating) stay float. Per round,
each shape and row count runs both ways in turn (which goes first alternates), each timed as the best of 3 batches
of calls; the report gives per way the median multiply-adds per second and the median over rounds of the per-round
ratio int8 / float. The compute type is the build's: float32 on AVX2 CPUs, bfloat16 on AVX512-VNNI ones (where the
int8 path lives). Nothing else runs: no attention, no engine, one product at a time on torch's threads.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from typing import Any

import numpy as np
import torch

from lmrpc.kernels import gguf_blocks, native, quantize
from lmrpc.kernels.packing import Compute, PackedWeight

# GGUF formats: their type and the byte offsets of their fp16 scales within a block
GGUF = {"q4_0": (gguf_blocks.Q4_0, (0,)), "q4_k": (gguf_blocks.Q4_K, (0, 2)), "q6_k": (gguf_blocks.Q6_K, (208,))}
SHAPES = {"qkv": (6144, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def packed(fmt: str, n: int, k: int) -> PackedWeight:
    if fmt == "int4":
        return quantize.quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02)
    kind, fp16_at = GGUF[fmt]
    per, size = gguf_blocks.BLOCK[kind]
    rng = np.random.default_rng(n + k)  # random bytes, with small positive fp16 scales where the format keeps them
    b = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at in fp16_at:
        b[..., at:at + 2] = np.full((n, k // per, 1), 1e-3, dtype=np.float16).view(np.uint8)
    return gguf_blocks.pack_gguf(kind, b.reshape(n, -1), n, k)


def kernel(p: PackedWeight, compute: Compute, int8: bool) -> Any:
    ks = p.kscales
    extra = {} if ks is None else {"kd": ks.d, "kdmin": ks.dmin, "ksc": ks.sc, "km": ks.m,
                                   "super_groups": ks.super_groups, "sc_signed": ks.sc.dtype == torch.int8}
    return native.load().PackedLinear(int(p.format), int(compute), p.n, p.k, p.group, p.q4_signed, p.data, p.scale,
                                      p.offset, None, int8_activations=int8, **extra)


def seconds(lin: Any, x: torch.Tensor, macs: int) -> float:
    reps = max(2, int(4e9 / macs))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            lin.forward(x)
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--format", choices=("int4", *GGUF), default="int4")
    args = parser.parse_args()
    lib = native.load()
    compute = Compute.BF16 if lib.native_vnni() else Compute.F32 if lib.native_avx2() else None
    if compute is None:
        raise SystemExit("no int8-activation products in this build (they need AVX2, or AVX512-VNNI)")
    host = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in host.splitlines() if line.startswith("Model name")), "?")
    print(f"Host: {model}, {torch.get_num_threads()} threads, {compute.name} compute, {args.format} weights")
    gmacs: dict[tuple[str, int, bool], list[float]] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    weights = {name: packed(args.format, n, k) for name, (n, k) in SHAPES.items()}
    for rnd in range(args.rounds):
        for name, p in weights.items():
            ops = {False: kernel(p, compute, False), True: kernel(p, compute, True)}
            for m in args.rows:
                x = torch.randn(m, p.k, generator=torch.Generator().manual_seed(m))
                macs = m * p.n * p.k
                took = {}
                for int8 in ((False, True) if rnd % 2 == 0 else (True, False)):
                    ops[int8].forward(x)
                    took[int8] = seconds(ops[int8], x, macs)
                    gmacs.setdefault((name, m, int8), []).append(macs / took[int8] / 1e9)
                ratios.setdefault((name, m), []).append(took[False] / took[True])
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    print("\n| product | rows | float G mul-adds/s | int8 G mul-adds/s | int8 / float |")
    print("| --- | --- | --- | --- | --- |")
    for name, (n, k) in SHAPES.items():
        for m in args.rows:
            f, i = (statistics.median(gmacs[(name, m, b)]) for b in (False, True))
            print(f"| {name} {n}x{k} | {m} | {f:.1f} | {i:.1f} | {statistics.median(ratios[(name, m)]):.2f}x |")


if __name__ == "__main__":
    main()
