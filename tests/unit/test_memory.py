"""memory.py over fake /proc and cgroup trees: v1 and v2 limits (the tighter of host and cgroup, parents' limits
too, page cache not counted as used), the KV pool sized from them, and the errors a pool that cannot fit raises."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmrpc.server import memory
from lmrpc.server.memory import CgroupMemory, InsufficientMemoryError, MemoryBudget

GIB = 1 << 30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _meminfo(tmp: Path, available: int) -> Path:
    path = tmp / "meminfo"
    _write(path, f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {available // 1024} kB\n")
    return path


def fake_v2(tmp: Path, *, cgroup: str = "/kubepods/pod1/ctr", root: str = "/", levels: dict[str, tuple[str, int, int]]
            ) -> Path:
    """A /proc/self and a cgroup2 mount at tmp/cg; levels: directory (relative to the mount) -> (memory.max,
    memory.current, inactive_file)."""
    proc = tmp / "proc"
    mount = tmp / "cg"
    _write(proc / "cgroup", f"0::{cgroup}\n")
    _write(proc / "mountinfo",
           "22 1 8:1 / / rw,relatime - ext4 /dev/vda rw\n"
           f"31 22 0:28 {root} {mount} rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n")
    for rel, (limit, current, inactive) in levels.items():
        d = mount / rel if rel else mount
        _write(d / "memory.max", f"{limit}\n")
        _write(d / "memory.current", f"{current}\n")
        _write(d / "memory.stat", f"anon 1\nfile 2\ninactive_file {inactive}\nactive_file 3\n")
    return proc


def fake_v1(tmp: Path, *, limit: int, usage: int, inactive: int, hierarchical: int | None = None) -> Path:
    """A hybrid host as on these machines: cgroup2 mounted without the memory controller, v1 memory beside it."""
    proc = tmp / "proc"
    v1 = tmp / "memory"
    unified = tmp / "unified"
    path = "/process_api/abc"
    _write(proc / "cgroup", f"9:name=systemd:/\n4:memory:{path}\n3:cpuset:/\n0::/\n")
    _write(proc / "mountinfo",
           f"35 31 0:32 / {v1} rw,relatime - cgroup cgroup rw,memory\n"
           f"41 31 0:38 / {unified} rw,relatime - cgroup2 cgroup2 rw\n")
    unified.mkdir(parents=True)
    d = v1 / path.lstrip("/")
    _write(d / "memory.limit_in_bytes", f"{limit}\n")
    _write(d / "memory.usage_in_bytes", f"{usage}\n")
    _write(d / "memory.stat", f"cache 5\ninactive_file {inactive}\nhierarchical_memory_limit "
                              f"{hierarchical if hierarchical is not None else 9223372036854771712}\n"
                              f"total_inactive_file {inactive}\n")
    return proc


def test_v2_limit_counts_page_cache_as_free(tmp_path: Path) -> None:
    proc = fake_v2(tmp_path, levels={"kubepods/pod1/ctr": (str(2 * GIB), GIB, GIB // 2)})
    cg = memory.cgroup_memory(proc)
    assert cg is not None and cg.version == 2
    binding = cg.binding
    assert binding is not None and binding.limit == 2 * GIB
    assert binding.headroom == 2 * GIB - GIB // 2  # usage 1 GiB of which half is reclaimable page cache


def test_v2_a_parents_tighter_limit_binds(tmp_path: Path) -> None:
    proc = fake_v2(tmp_path, levels={
        "kubepods/pod1/ctr": ("max", GIB, 0),
        "kubepods/pod1": (str(3 * GIB // 2), GIB + GIB // 4, 0),  # a sibling container uses a quarter
        "kubepods": ("max", 5 * GIB, 0),
    })
    cg = memory.cgroup_memory(proc)
    assert cg is not None and [level.path.name for level in cg.levels] == ["ctr", "pod1", "kubepods", "cg"][:3]
    assert cg.binding is not None and cg.binding.path.name == "pod1"
    assert MemoryBudget(64 * GIB, cg).available == GIB // 4


def test_v2_in_a_cgroup_namespace(tmp_path: Path) -> None:
    # Inside a container the process sees itself at "/" of a namespaced mount: the limit is the mount's own files.
    proc = fake_v2(tmp_path, cgroup="/", levels={"": (str(2 * GIB), GIB // 2, 0)})
    budget = MemoryBudget(64 * GIB, memory.cgroup_memory(proc))
    assert budget.available == 2 * GIB - GIB // 2
    assert "cgroup v2 memory limit of 2.00 GiB" in budget.describe()


def test_v2_without_limit_leaves_the_host(tmp_path: Path) -> None:
    proc = fake_v2(tmp_path, cgroup="/user.slice", levels={"user.slice": ("max", GIB, 0)})
    budget = memory.memory_budget(proc, _meminfo(tmp_path, 10 * GIB))
    assert budget.cgroup_headroom is None and budget.available == 10 * GIB
    assert "host's available memory" in budget.describe()


def test_v1_on_a_hybrid_host(tmp_path: Path) -> None:
    proc = fake_v1(tmp_path, limit=4 * GIB, usage=3 * GIB, inactive=GIB)
    budget = memory.memory_budget(proc, _meminfo(tmp_path, 20 * GIB))
    assert budget.cgroup is not None and budget.cgroup.version == 1
    assert budget.available == 2 * GIB
    assert budget.cgroup_limit == 4 * GIB


def test_v1_unlimited_and_hierarchical_limits(tmp_path: Path) -> None:
    unlimited = fake_v1(tmp_path / "a", limit=9223372036854771712, usage=GIB, inactive=0)
    assert memory.memory_budget(unlimited, _meminfo(tmp_path, 20 * GIB)).available == 20 * GIB
    parent_limited = fake_v1(tmp_path / "b", limit=9223372036854771712, usage=GIB, inactive=0,
                             hierarchical=3 * GIB)
    assert memory.memory_budget(parent_limited, _meminfo(tmp_path, 20 * GIB)).available == 2 * GIB


def test_the_host_binds_when_tighter(tmp_path: Path) -> None:
    proc = fake_v1(tmp_path, limit=16 * GIB, usage=GIB, inactive=0)
    budget = memory.memory_budget(proc, _meminfo(tmp_path, 3 * GIB))
    assert budget.available == 3 * GIB


def test_no_cgroup_files(tmp_path: Path) -> None:
    assert memory.cgroup_memory(tmp_path / "nothing") is None
    assert memory.host_available_bytes(tmp_path / "nothing") is None
    assert MemoryBudget(None, None).available is None


def test_this_machine_reads_something() -> None:
    budget = memory.memory_budget()
    assert budget.host_available is not None and budget.host_available > 0
    assert memory.resident_bytes() > 10 << 20  # a Python process with pytest loaded


# ---- the pool -------------------------------------------------------------------------------------------------


def _budget(host: int, limit: int | None, used: int = 0) -> MemoryBudget:
    if limit is None:
        return MemoryBudget(host, None)
    return MemoryBudget(host, CgroupMemory(2, (memory.CgroupLevel(Path("/sys/fs/cgroup"), limit, used, 0),)))


def test_pool_sized_from_the_container_not_the_host() -> None:
    per_token = 23040  # SmolLM2-135M in bfloat16
    host_sized = memory.kv_pool_tokens(None, 0.25, per_token, _budget(64 * GIB, None))
    container_sized = memory.kv_pool_tokens(None, 0.25, per_token, _budget(64 * GIB, 2 * GIB, used=GIB // 2))
    assert host_sized.tokens == memory.MAX_AUTO_POOL_TOKENS  # the host's share exceeds the cap
    assert container_sized.tokens == int(1.5 * GIB * 0.25) // per_token
    assert "cgroup v2 memory limit" in container_sized.reason


def test_too_small_a_limit_is_a_clear_error() -> None:
    with pytest.raises(InsufficientMemoryError, match=r"at least 2048 tokens.*cgroup v2 memory limit of 1\.00 GiB"):
        memory.kv_pool_tokens(None, 0.25, 23040, _budget(64 * GIB, GIB, used=GIB - (50 << 20)))


def test_an_explicit_pool_over_the_limit_is_refused_under_it_kept() -> None:
    budget = _budget(64 * GIB, 2 * GIB, used=GIB)
    with pytest.raises(InsufficientMemoryError, match=r"--kv-cache-tokens 65536 needs 1\.41 GiB"):
        memory.kv_pool_tokens(65536, 0.25, 23040, budget)
    assert memory.kv_pool_tokens(8192, 0.25, 23040, budget).tokens == 8192
    # The host's MemAvailable is no hard limit (other processes' caches, swap): an explicit pool over it is kept.
    assert memory.kv_pool_tokens(65536, 0.25, 23040, _budget(GIB, None)).tokens == 65536


def test_cuda_pools_ignore_host_limits() -> None:
    budget = _budget(64 * GIB, GIB, used=GIB)  # no host headroom at all
    assert memory.kv_pool_tokens(None, 0.5, 1000, budget, device_free=10_000_000).tokens == 5000


def test_model_that_cannot_fit_is_refused_before_loading(tmp_path: Path) -> None:
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"\0" * 3000)
    (weights / "config.json").write_text("{}")
    assert memory.model_files_bytes(weights) == 3000
    with pytest.raises(InsufficientMemoryError, match="do not fit"):
        memory.check_model_fits(3000, _budget(64 * GIB, 2000))
    memory.check_model_fits(3000, _budget(64 * GIB, 10_000))
    memory.check_model_fits(3000, _budget(1000, None))  # the host is not a hard limit
