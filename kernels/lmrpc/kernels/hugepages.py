"""Host memory in transparent huge pages, for what the kernels stream from DRAM: packed weights and the KV cache.

Why: a one-row product reads each of its weights once per token, from DRAM (the bundled model's layers are 66 MB,
twice this machine's L3), and a CPU's hardware prefetchers stop at every 4 KiB page boundary, where a TLB walk
waits too. In 2 MiB pages the streams run on: one thread here reads memory at 32 GB/s in 2 MiB pages against 22 GB/s
in 4 KiB pages.

- `zeros(shape, dtype)`: a tensor in its own anonymous mapping, starting on a 2 MiB boundary and madvised
  MADV_HUGEPAGE before anything touches it (Linux's transparent huge pages, "madvise" or "always" mode). It is
  written at once, so it is resident from the start, as torch.zeros was: a KV pool that does not fit fails at start,
  not under load, and the process's RSS says what it holds.
- `Arena`: tensors placed one after another in such mappings (64 MiB chunks), so a model's many small weights share
  huge pages instead of each rounding up to 2 MiB. A chunk lives as long as a tensor placed in it.

Where the kernel gives no huge pages (another OS, THP off, no 2 MiB page free) these are plain pages: slower, the
same bits. Placement changes where a tensor lives, never its values. `LMRPC_HUGE_PAGES=0` turns the advice off.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64 and arm64 (4 KiB base pages) transparent huge pages
CHUNK = 64 << 20  # bytes per Arena chunk: the bundled model's packed layers fill two
ALIGN = 64  # bytes: each placed tensor starts on a cache line (the kernels' vector loads)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def enabled() -> bool:
    """Whether mappings are advised into huge pages (`LMRPC_HUGE_PAGES=0` says no; Linux only)."""
    return os.environ.get("LMRPC_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def _mapping(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of zeros starting on a 2 MiB boundary, in a fresh anonymous mapping (advised when enabled)."""
    size = _round_up(max(nbytes, 1), HUGE_PAGE) + HUGE_PAGE  # room to start on a 2 MiB boundary
    mapped = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if enabled():
        mapped.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then take 2 MiB pages
    whole = torch.frombuffer(mapped, dtype=torch.uint8)  # holds the mapping: unmapped when no view is left
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + nbytes]


def _typed(raw: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return raw.view(dtype).view(*shape)


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in its own huge-page mapping (large buffers: the KV cache), resident (see the module doc)."""
    raw = _mapping(_nbytes(shape, dtype))
    raw.zero_()  # touch every page now
    return _typed(raw, shape, dtype)


class Arena:
    """Tensors placed one after another in huge-page chunks (see the module doc). Not thread-safe: a model is built
    on one thread."""

    def __init__(self, chunk_bytes: int = CHUNK) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8: the chunk being filled
        self._used = 0  # bytes of it handed out (rounded up to ALIGN)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor of this shape and dtype, in the arena."""
        nbytes = _nbytes(shape, dtype)
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            # A new chunk; what the old one has left stays unused (never touched, so never resident).
            self._chunk, self._used = _mapping(max(self.chunk_bytes, _round_up(nbytes, ALIGN))), 0
        raw = self._chunk[self._used : self._used + nbytes]
        self._used += _round_up(nbytes, ALIGN)
        return _typed(raw, shape, dtype)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `tensor` in the arena."""
        out = self.zeros(tuple(tensor.shape), tensor.dtype)
        out.copy_(tensor)
        return out
