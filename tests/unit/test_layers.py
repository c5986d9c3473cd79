"""The import rules docs/architecture.md draws: the three front doors (generate/, openai/, sglang/) never import one
another; what they share (pipeline/, frontend, validation, protos) imports none of them; the engine imports no
front door and nothing of the gRPC front; models import neither the engine nor LoRA; the kernels import nothing of
the server. Read from the source (ast), so a rule broken anywhere, even in a function body, fails here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server" / "lmrpc" / "server"
KERNELS = ROOT / "kernels" / "lmrpc" / "kernels"
SERVICES = ("generate", "openai", "sglang")
SHARED_FRONT = ("pipeline", "frontend", "validation", "protos")
FRONT = (*SERVICES, *SHARED_FRONT, "app", "auth", "wire", "watchdog")


def imports(path: Path) -> set[str]:
    """Every lmrpc module `path` imports (absolute imports; the project uses no relative ones)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("lmrpc.")}


def server_part(module: str) -> str | None:
    """The top-level part of lmrpc.server a module belongs to ("engine", "openai", "frontend", ...)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["lmrpc", "server"] else None


def sources(where: Path) -> list[Path]:
    return sorted(p for p in where.rglob("*.py") if "__pycache__" not in p.parts)


def part_of(path: Path) -> str:
    relative = path.relative_to(SERVER)
    return relative.parts[0].removesuffix(".py")


def violations(forbidden: dict[str, tuple[str, ...]]) -> list[str]:
    """'file imports module' for every import of a part that `forbidden[its own part]` names."""
    found = []
    for path in sources(SERVER):
        own = part_of(path)
        for module in sorted(imports(path)):
            target = server_part(module)
            if target in forbidden.get(own, ()) and target != own:
                found.append(f"{path.relative_to(ROOT)} imports {module}")
    return found


def test_no_front_door_imports_another() -> None:
    assert violations({s: SERVICES for s in SERVICES}) == []


def test_what_the_front_doors_share_imports_none_of_them() -> None:
    assert violations({s: SERVICES for s in SHARED_FRONT}) == []


def test_the_engine_imports_no_front() -> None:
    assert violations({"engine": FRONT}) == []


def test_models_and_lora_sit_below_the_engine() -> None:
    below = ("engine", *FRONT)
    assert violations({"models": (*below, "lora"), "lora": below, "media": (*below, "models", "lora")}) == []


def test_the_kernels_import_nothing_of_the_server() -> None:
    found = [f"{p.relative_to(ROOT)} imports {m}" for p in sources(KERNELS) for m in sorted(imports(p))
             if m.startswith("lmrpc.server")]
    assert found == []


@pytest.mark.parametrize("rule", [{"generate": ("openai",)}, {"models": ("lora",)}])
def test_the_rules_can_fail(rule: dict[str, tuple[str, ...]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checker that finds nothing may be looking nowhere: a planted import of each kind is found."""
    [(own, [target])] = [(k, list(v)) for k, v in rule.items()]
    planted = SERVER / own / "_planted_import_check.py"
    planted.write_text(f"from lmrpc.server.{target} import anything\n")
    try:
        assert violations(rule) == [f"{planted.relative_to(ROOT)} imports lmrpc.server.{target}",
                                    f"{planted.relative_to(ROOT)} imports lmrpc.server.{target}.anything"]
    finally:
        planted.unlink()


def test_the_scheduler_kv_cache_and_types_import_no_torch() -> None:
    """Scheduler and KV-cache bookkeeping (and the types they carry) run without torch: they test in milliseconds and
    a front door's types never pull in the model stack."""
    modules = ("lmrpc.server.engine.scheduler", "lmrpc.server.engine.kv_cache", "lmrpc.server.engine.types",
               "lmrpc.server.models.types")
    code = f"import sys; import {', '.join(modules)}; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
