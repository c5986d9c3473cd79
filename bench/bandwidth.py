"""The machine under bench/served.py: its CPU's name (which of the session hosts a run was on) and its memory read
bandwidth, torch.sum over a float32 buffer larger than every cache, timed in a fresh spawned process (torch and its
thread pool stay out of the benchmark's client process), per thread count."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MIN_SWEEP_BYTES = 1 << 30  # the bandwidth buffer: at least 1 GiB, and at least 8x the L3 cache


@dataclass(frozen=True)
class Bandwidth:
    threads: int  # threads reading
    gb_s: float  # median over passes, 1e9 bytes per second
    passes: tuple[float, ...]  # every pass's GB/s


def sweep_bytes() -> int:
    """8x the largest cache (a read of it comes from memory, not from a cache), at least MIN_SWEEP_BYTES."""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = size.read_text().strip()
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            largest = max(largest, int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(MIN_SWEEP_BYTES, 8 * largest)


def read_bandwidth(thread_counts: list[int], nbytes: int, passes: int) -> list[Bandwidth]:
    """GB/s of torch.sum over a float32 buffer of nbytes, per thread count (the median of `passes` passes). Run in
    a fresh process (measure_bandwidth): torch and its thread pool stay out of the benchmark's client process."""
    import torch

    buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # written once: every page is mapped before timing
    found = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        buffer.sum().item()  # untimed: the thread pool started, the caches in their steady state
        rates = []
        for _ in range(passes):
            start = time.perf_counter()
            buffer.sum().item()
            rates.append(buffer.numel() * 4 / (time.perf_counter() - start) / 1e9)
        found.append(Bandwidth(threads, statistics.median(rates), tuple(rates)))
    return found


def measure_bandwidth(threads: int, nbytes: int, passes: int, when: str) -> list[Bandwidth]:
    """read_bandwidth single-threaded and with `threads` threads, in a fresh spawned process: torch and its thread
    pool stay out of the benchmark's client process (a forked child would start as a copy of that process, its
    server-output threads and event loop included)."""
    counts = sorted({1, threads})
    print(f"served: read bandwidth {when} ({nbytes / 2**30:.1f} GiB, threads {counts})", file=sys.stderr)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(read_bandwidth, counts, nbytes, passes).result()


def best_bandwidth(sweeps: dict[str, list[Bandwidth]], threads: int) -> float:
    """The higher of the before and after medians at `threads`: other work on a shared machine only lowers a
    measurement, so the higher is the nearer to what the memory gives."""
    return max(b.gb_s for sweep in sweeps.values() for b in sweep if b.threads == threads)


def host_name() -> str:
    """lscpu's model name (/proc/cpuinfo's where lscpu is missing): which of the session hosts this ran on."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"
