"""heap.keep_numpy_off_huge_pages: numpy's large arrays stop marking their memory MADV_HUGEPAGE (the mark outlives
the array inside malloc's arenas, and the server's RSS grew by it; heap.py's docstring)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
    reason="Linux with transparent huge pages: where numpy advises them")

# In a fresh process (the switch is process-wide, and a fresh heap puts an 8 MiB array in a mapping of its own):
# whether the memory in the middle of such an array is advised for huge pages ("hg" in its mapping's VmFlags),
# before and after the switch.
SCRIPT = textwrap.dedent("""
    import numpy as np
    from lmrpc.server.heap import keep_numpy_off_huge_pages

    def advised(array):
        middle = array.ctypes.data + array.nbytes // 2
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                head = line.split()[0]
                if "-" in head and not line.startswith("VmFlags"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start <= middle < end
                elif inside and line.startswith("VmFlags:"):
                    return " hg" in line
        raise AssertionError("no mapping holds the array")

    default = (np._core if hasattr(np, "_core") else np.core).multiarray._get_madvise_hugepage()
    before = np.ones(8 << 20, dtype=np.uint8)
    keep_numpy_off_huge_pages()
    after = np.ones(8 << 20, dtype=np.uint8)
    print(default, advised(before), advised(after))
""")


def test_numpy_arrays_are_no_longer_advised_huge_pages() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    default, before, after = done.stdout.split()
    if default == "False":
        pytest.skip("numpy gives no huge-page advice here (NUMPY_MADVISE_HUGEPAGE=0, or an old kernel)")
    assert before == "True", "numpy's advice is what this test checks the switch against; it did not show"
    assert after == "False", "an array made after keep_numpy_off_huge_pages() is still advised MADV_HUGEPAGE"
