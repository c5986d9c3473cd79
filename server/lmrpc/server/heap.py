"""Returning the heap a burst freed to the OS once the engine goes idle.

glibc's malloc keeps freed memory in its arenas for reuse: after a burst (hundreds of outputs of long prompts, a
large grammar's matchers, a 20 MB request decoded on a gRPC thread) the process stays at that high-water mark,
and its RSS says more about the largest burst so far than about what it holds. `malloc_trim(0)` gives the free
pages of every arena back. The engine calls `idle()` on each tick it waits with nothing to do, and `busy()` when it
works; a trim runs once per idle period, so it never sits between two steps. Loading a model is such a burst too
(a GGUF's blocks are shuffled into the kernels' layout through megabytes of temporaries per tensor, 0.6 GB left in the
arenas for a 1.7B model): the loader calls `trim_heap()` once it is done, and the engine's start once more after the
grammar tables are built (a 49k-token vocabulary's build leaves ~50 MB), both before the KV pool is allocated. Where
the C library has no malloc_trim (musl, macOS), this does nothing.

NumPy, on Linux, advises transparent huge pages (`madvise(MADV_HUGEPAGE)`) for every array of 4 MiB or more. Such an
array can sit inside a malloc arena (glibc's mmap threshold rises to 32 MiB once a large block is freed), and the advice
outlives the array: that part of the arena stays huge-page memory, where the first touch of any byte faults in 2 MiB and
khugepaged fills partly used 2 MiB ranges. A 1.7B GGUF's load leaves some 400 MiB of arena address space so marked (its
blocks pass through numpy); serving then put up to 44 MiB there, 40 of it in 2 MiB pages, on top of what the same
allocations take in plain pages. The server turns numpy's advice off before it loads a model
(`keep_numpy_off_huge_pages`); what should be in huge pages (weights, the KV cache) is placed there on purpose
(`lmrpc.kernels.hugepages`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

try:
    from numpy._core import multiarray as _multiarray  # numpy >= 2
except ImportError:  # numpy 1.26
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]

logger = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # no C library to load, or one without malloc_trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: int(trim(0))


def keep_numpy_off_huge_pages() -> None:
    """NumPy's arrays from now on get no MADV_HUGEPAGE advice (above: it outlives them in the malloc arenas)."""
    # A process-wide switch, the one NUMPY_MADVISE_HUGEPAGE sets at import (numpy >= 1.20; not in numpy's stubs).
    _multiarray._set_madvise_hugepage(False)  # type: ignore[attr-defined]


def trim_heap() -> None:
    """One trim now (nothing where the C library has no malloc_trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim()


class HeapTrimmer:
    """One trim per idle period of the engine loop (engine thread only)."""

    def __init__(self, trim: Callable[[], int] | None = None, enabled: bool = True) -> None:
        self._trim = (trim or _malloc_trim()) if enabled else None
        self._worked = False  # work since the last trim
        self.trims = 0  # trims run (tests read it)

    def busy(self) -> None:
        self._worked = True

    def idle(self) -> None:
        if self._worked and self._trim is not None:
            self._worked = False
            self._trim()
            self.trims += 1
