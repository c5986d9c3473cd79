"""lmrpc's own CPU kernels (csrc/): built once for this machine with the system compiler, cached, loaded.

The build goes into `<cache>/kernels/<key>/`, keyed by the sources, the compiler flags, torch's version and the CPU's
instruction-set flags, so a restart loads the built library in about a second and a changed CPU or source builds
anew. `-march=native` lets the compiler use what this CPU has (the AVX512-BF16 paths when present, else AVX2 + FMA
registers, else portable C++ loops); `-ffp-contract=off` keeps every multiply-add as written, so the same source
gives the same bits.

`load()` returns the module, or raises `NativeKernelsUnavailable` with the reason (no compiler, a build error); the
caller decides whether to fall back. `LMRPC_NATIVE_KERNELS=0` turns them off; `LMRPC_KERNEL_ARCH=generic` builds
the portable loops only, `LMRPC_KERNEL_ARCH=avx2` the AVX2 + FMA paths (what a CPU without AVX512-BF16 runs) on any
x86 CPU that has AVX2, FMA and F16C: tests use them to check every path on one machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCES = ("module.cpp", "linear.cpp", "linear_products.cpp", "linear_int8.cpp", "linear_int16.cpp",
           "attention.cpp", "attention_few.cpp", "rope.cpp", "grid_codes.cpp")
HEADERS = ("common.h", "linear.h", "linear_impl.h", "linear_codes.h", "linear_kernels.h", "linear_kernels_codes.h",
           "linear_kernels_avx2.h", "linear_kscales.h", "linear_int16_fold.h", "attention.h", "attention_avx2.h",
           "attention_cache.h", "py_linear.h", "py_attention.h", "py_stack.h", "grid_codes.h")
CSRC = Path(__file__).parent / "csrc"


class NativeKernelsUnavailable(RuntimeError):
    """The native CPU kernels cannot be used here (the message says why)."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


# LMRPC_KERNEL_ARCH: the instruction sets a build may use, beyond the compiler's baseline (the portable loops)
ARCH_FLAGS = {"native": ["-march=native"], "avx2": ["-mavx2", "-mfma", "-mf16c"], "generic": []}


def _arch() -> str:
    arch = os.environ.get("LMRPC_KERNEL_ARCH", "native")
    if arch not in ARCH_FLAGS:
        raise NativeKernelsUnavailable(f"LMRPC_KERNEL_ARCH={arch!r}: expected one of {', '.join(ARCH_FLAGS)}")
    return arch


def _cflags(arch: str) -> list[str]:
    return ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17", *ARCH_FLAGS[arch]]


def build_key(arch: str) -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(_cflags(arch)).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("LMRPC_CACHE") or Path.home() / ".cache" / "lmrpc") / "kernels"


def enabled() -> bool:
    return os.environ.get("LMRPC_NATIVE_KERNELS", "1") != "0"


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One builder per cache directory, across processes, by an flock the kernel drops when its holder dies.

    torch's own lock is a file that exists while a build runs: a process killed mid-build (SIGKILL, OOM, a pod
    evicted during a cold start) leaves it behind, and every later start waits for it forever. Under this flock no
    other of our processes is building here, so such a file is stale and is removed before torch looks at it.
    """
    with open(directory / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing a stale kernel build lock left by a process that died: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def load() -> ModuleType:
    """Build (first time on this machine) and import the kernels module."""
    if not enabled():
        raise NativeKernelsUnavailable("turned off by LMRPC_NATIVE_KERNELS=0")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise NativeKernelsUnavailable("no C++ compiler (c++ or $CXX) on PATH")
    from torch.utils import cpp_extension

    arch = _arch()
    key = build_key(arch)
    directory = cache_dir() / key
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    fresh = not any(directory.glob("*.so"))
    try:
        with _build_lock(directory):
            module = cpp_extension.load(
                name=f"lmrpc_cpu_{key}",
                sources=[str(CSRC / s) for s in SOURCES],
                extra_cflags=_cflags(arch),
                extra_include_paths=[str(CSRC)],
                build_directory=str(directory),
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as e:  # a compiler error, a missing ninja, a broken toolchain
        raise NativeKernelsUnavailable(f"building the CPU kernels failed: {e}") from e
    if fresh:
        logger.info("built lmrpc's CPU kernels in %.1f s (%s, cached in %s)", time.monotonic() - started,
                    _instructions(module), directory)
    return module


def _instructions(module: ModuleType) -> str:
    if module.native_bf16():
        return "AVX512-BF16"
    return "AVX2" if module.native_avx2() else "portable"


@functools.cache  # (a failed build is not tried again for every caller: a GGUF's every grid tensor asks)
def available() -> bool:
    try:
        load()
    except NativeKernelsUnavailable:
        return False
    return True
