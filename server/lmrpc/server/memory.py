"""How much memory the server may use: the host's MemAvailable and the cgroup (v1 or v2) memory limit, whichever is
tighter; the KV pool sized from it after the model's own footprint; the process's resident memory. No torch.

In a container the host's MemAvailable says nothing about the container's limit: a pool sized from a 64 GiB host
inside a 2 GiB container is killed by the kernel's OOM killer. The limit is read from the cgroup the process is in
(`/proc/self/cgroup`, located through `/proc/self/mountinfo` so that a cgroup namespace or a bind-mounted hierarchy
is followed), at every level up to the hierarchy's root, since a parent's limit binds its children too. Usage counts
the page cache, which the kernel reclaims before it kills anything, so the inactive file pages are not counted as
used (as the kubelet computes a working set).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PROC_SELF = Path("/proc/self")
MEMINFO = Path("/proc/meminfo")
# cgroup v1 says "no limit" with a huge number (PAGE_COUNTER_MAX pages, rounded): anything above this is none.
UNLIMITED = 1 << 60
# The smallest pool the server starts with: a few requests of ordinary length. Below it most requests would be
# refused, which is a configuration error to report at start, not a server to run.
MIN_POOL_TOKENS = 2048
MAX_AUTO_POOL_TOKENS = 1 << 18  # cap of an automatically sized pool, in tokens


class InsufficientMemoryError(RuntimeError):
    """The memory the server may use cannot hold the model and a minimal KV pool (the message says which limit)."""


@dataclass(frozen=True)
class CgroupLevel:
    """One cgroup directory on the way from the process's cgroup up to the hierarchy's root."""

    path: Path  # the directory
    limit: int | None  # bytes (memory.max, memory.limit_in_bytes); None: no limit at this level
    usage: int  # bytes charged here now, page cache included (memory.current, memory.usage_in_bytes)
    reclaimable: int  # inactive file pages within usage, which the kernel reclaims before an OOM kill

    @property
    def headroom(self) -> int | None:
        """Bytes that may still be charged here before the limit; None without a limit."""
        if self.limit is None:
            return None
        return max(0, self.limit - max(0, self.usage - self.reclaimable))


@dataclass(frozen=True)
class CgroupMemory:
    """The memory cgroup of this process: its version and every level that has a limit."""

    version: int  # 1 or 2
    levels: tuple[CgroupLevel, ...]  # from the process's own cgroup up; only levels whose files could be read

    @property
    def binding(self) -> CgroupLevel | None:
        """The level with the least headroom (None: no level has a limit)."""
        limited = [level for level in self.levels if level.headroom is not None]
        return min(limited, key=lambda level: level.headroom or 0) if limited else None


@dataclass(frozen=True)
class MemoryBudget:
    """What this process may still allocate, and why."""

    host_available: int | None  # MemAvailable in bytes; None where /proc/meminfo is unreadable
    cgroup: CgroupMemory | None  # None: no memory cgroup found (or not Linux)

    @property
    def available(self) -> int | None:
        """Bytes the process may still allocate: the tighter of the host and the cgroup; None if neither is known."""
        bounds = [b for b in (self.host_available, self.cgroup_headroom) if b is not None]
        return min(bounds) if bounds else None

    @property
    def cgroup_headroom(self) -> int | None:
        binding = self.cgroup.binding if self.cgroup is not None else None
        return binding.headroom if binding is not None else None

    @property
    def cgroup_limit(self) -> int | None:
        binding = self.cgroup.binding if self.cgroup is not None else None
        return binding.limit if binding is not None else None

    def describe(self) -> str:
        """Which bound is the tighter, for logs and errors."""
        headroom = self.cgroup_headroom
        if headroom is not None and (self.host_available is None or headroom <= self.host_available):
            assert self.cgroup is not None and self.cgroup.binding is not None
            level = self.cgroup.binding
            return (f"the cgroup v{self.cgroup.version} memory limit of {_gib(level.limit or 0)} at {level.path} "
                    f"({_gib(headroom)} of it free)")
        if self.host_available is not None:
            return f"the host's available memory ({_gib(self.host_available)})"
        return "unknown memory"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


# ---- reading the system ----------------------------------------------------------------------------------------


def host_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    """An integer file of the cgroup filesystem; None when absent or unreadable; "max" is None too (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


def _read_stat(path: Path, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


@dataclass(frozen=True)
class _Mount:
    root: str  # the hierarchy path mounted there (mountinfo field 4)
    point: Path  # where it is mounted (field 5)


def _mounts(mountinfo: Path) -> tuple[_Mount | None, _Mount | None]:
    """(the cgroup2 mount, the cgroup v1 mount carrying the memory controller), each None when absent."""
    v2 = v1 = None
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(after) < 3:
            continue
        mount = _Mount(root=fields[3], point=Path(fields[4].replace("\\040", " ")))
        if after[0] == "cgroup2" and v2 is None:
            v2 = mount
        elif after[0] == "cgroup" and "memory" in after[2].split(",") and v1 is None:
            v1 = mount
    return v2, v1


def _cgroup_paths(cgroup_file: Path) -> tuple[str | None, str | None]:
    """(the v2 path, the v1 memory path) of this process from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _directory(mount: _Mount, path: str) -> Path:
    """The directory of cgroup `path` under `mount` (a path outside the mounted root: the mount point itself, as in a
    container whose cgroup namespace hides the rest)."""
    root = mount.root.rstrip("/")
    if root and path.startswith(root):
        path = path[len(root):]
    elif root:
        return mount.point
    return mount.point / path.lstrip("/")


def _levels(mount: _Mount, path: str, read: type[_V1] | type[_V2]) -> tuple[CgroupLevel, ...]:
    directory = _directory(mount, path)
    levels: list[CgroupLevel] = []
    while True:
        level = read.level(directory)
        if level is not None:
            levels.append(level)
        if directory == mount.point or mount.point not in directory.parents:
            break
        directory = directory.parent
    return tuple(levels)


class _V2:
    @staticmethod
    def level(directory: Path) -> CgroupLevel | None:
        usage = _read_int(directory / "memory.current")
        if usage is None:
            return None
        return CgroupLevel(directory, _read_int(directory / "memory.max"), usage,
                           _read_stat(directory / "memory.stat", "inactive_file"))


class _V1:
    @staticmethod
    def level(directory: Path) -> CgroupLevel | None:
        usage = _read_int(directory / "memory.usage_in_bytes")
        if usage is None:
            return None
        limit = _read_int(directory / "memory.limit_in_bytes")
        hierarchical = _read_stat(directory / "memory.stat", "hierarchical_memory_limit")
        if 0 < hierarchical < UNLIMITED:
            limit = hierarchical if limit is None else min(limit, hierarchical)
        return CgroupLevel(directory, limit, usage, _read_stat(directory / "memory.stat", "total_inactive_file"))


def cgroup_memory(proc_self: Path = PROC_SELF) -> CgroupMemory | None:
    """This process's memory cgroup: v2 when its memory controller is enabled there, else v1's memory controller."""
    v2_path, v1_path = _cgroup_paths(proc_self / "cgroup")
    v2_mount, v1_mount = _mounts(proc_self / "mountinfo")
    if v2_path is not None and v2_mount is not None:
        levels = _levels(v2_mount, v2_path, _V2)
        if levels:  # a hybrid host mounts cgroup2 without the memory controller: then v1 has it
            return CgroupMemory(2, levels)
    if v1_path is not None and v1_mount is not None:
        levels = _levels(v1_mount, v1_path, _V1)
        if levels:
            return CgroupMemory(1, levels)
    return None


def memory_budget(proc_self: Path = PROC_SELF, meminfo: Path = MEMINFO) -> MemoryBudget:
    return MemoryBudget(host_available_bytes(meminfo), cgroup_memory(proc_self))


def resident_bytes(proc_self: Path = PROC_SELF) -> int:
    """This process's resident set size (VmRSS), in bytes; 0 where /proc is unreadable."""
    try:
        with open(proc_self / "status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


# ---- decisions -------------------------------------------------------------------------------------------------


def model_files_bytes(path: Path) -> int:
    """The size of a model's weight files (a GGUF file, or the weights of an HF directory): a lower bound on the
    memory the loaded model takes."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.gguf"):
        total += sum(p.stat().st_size for p in path.glob(pattern) if p.is_file())
    return total


def check_model_fits(model_bytes: int, budget: MemoryBudget) -> None:
    """Refuse to load a model whose weight files alone exceed the cgroup's headroom: loading it would end in an OOM
    kill, with nothing said. (The host's MemAvailable is not a hard limit, so only the cgroup is checked here.)"""
    headroom = budget.cgroup_headroom
    if headroom is not None and model_bytes > headroom:
        raise InsufficientMemoryError(
            f"the model's weights ({_gib(model_bytes)}) do not fit in {budget.describe()}: raise the container's "
            "memory limit or serve a smaller (or quantized) model")


@dataclass(frozen=True)
class PoolSize:
    """The KV pool chosen, and why."""

    tokens: int  # capacity in tokens
    reason: str  # where the number came from, for the start-up log


def kv_pool_tokens(num_tokens: int | None, memory_fraction: float, bytes_per_token: int,
                   budget: MemoryBudget, device_free: int | None = None,
                   min_tokens: int = MIN_POOL_TOKENS) -> PoolSize:
    """The KV pool's capacity in tokens, once the model is loaded (its memory already counted as used).

    num_tokens: --kv-cache-tokens (None: size it from memory); memory_fraction: the share of what is free that the
    pool takes; device_free: free bytes on the GPU for a CUDA pool (None: the pool lives in host memory).
    Raises InsufficientMemoryError when the pool cannot be held.
    """
    if device_free is not None:  # a CUDA pool: the host's limits do not apply to device memory
        if num_tokens is not None:
            return PoolSize(num_tokens, "--kv-cache-tokens")
        tokens = min(int(device_free * memory_fraction) // bytes_per_token, MAX_AUTO_POOL_TOKENS)
        return PoolSize(tokens, f"{memory_fraction:g} of the GPU's free memory")
    headroom = budget.cgroup_headroom
    if num_tokens is not None:
        needed = num_tokens * bytes_per_token
        if headroom is not None and needed > headroom:
            raise InsufficientMemoryError(
                f"--kv-cache-tokens {num_tokens} needs {_gib(needed)} but {budget.describe()}: lower it, or raise "
                "the memory limit")
        available = budget.available
        if available is not None and needed > available:
            logger.warning("--kv-cache-tokens %d needs %s, more than %s", num_tokens, _gib(needed), budget.describe())
        return PoolSize(num_tokens, "--kv-cache-tokens")
    available = budget.available
    if available is None:
        available = 4 << 30
        logger.warning("cannot read the memory available (no /proc/meminfo, no cgroup): assuming 4 GiB")
    tokens = min(int(available * memory_fraction) // bytes_per_token, MAX_AUTO_POOL_TOKENS)
    if tokens < min_tokens:
        raise InsufficientMemoryError(
            f"the KV cache needs at least {min_tokens} tokens ({_gib(min_tokens * bytes_per_token)} at "
            f"{bytes_per_token} bytes a token) beside the model, but {memory_fraction:g} of {budget.describe()} "
            f"holds {max(tokens, 0)}: raise the memory limit, or set --kv-cache-tokens explicitly")
    return PoolSize(tokens, f"{memory_fraction:g} of {budget.describe()}")
