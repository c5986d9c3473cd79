"""Regenerate the committed lmrpc.v1 stubs from proto/ (or, with --check, fail if they are stale).

Run from anywhere: python client/scripts/generate_stubs.py [--check]
The output depends on the grpcio-tools and mypy-protobuf versions, so they are pinned in requirements-dev.txt.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "client"
PACKAGE = Path("lmrpc") / "v1"


def generate(out: Path) -> list[Path]:
    """Run protoc into `out`; return the generated files relative to `out`."""
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / PACKAGE).glob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{PROTO_DIR}", f"-I{well_known}",
        f"--python_out={out}", f"--grpc_python_out={out}",
        f"--mypy_out={out}", f"--mypy_grpc_out={out}",
        *protos,
    ]
    subprocess.run(cmd, check=True, cwd=PROTO_DIR)
    return sorted(p.relative_to(out) for p in (out / PACKAGE).iterdir() if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs differ")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = sorted(
            p.relative_to(OUT_DIR) for p in (OUT_DIR / PACKAGE).iterdir()
            if p.is_file() and p.name != "__init__.py" and p.suffix in {".py", ".pyi"}
        )
        if args.check:
            stale = [
                str(p) for p in fresh
                if not (OUT_DIR / p).exists() or not filecmp.cmp(Path(tmp) / p, OUT_DIR / p, shallow=False)
            ]
            stale += [str(p) for p in committed if p not in fresh]
            if stale:
                print("stale generated stubs (run client/scripts/generate_stubs.py):", *stale, sep="\n  ")
                return 1
            print(f"stubs fresh: {len(fresh)} files")
            return 0
        for p in committed:
            if p not in fresh:
                (OUT_DIR / p).unlink()
        for p in fresh:
            shutil.copyfile(Path(tmp) / p, OUT_DIR / p)
        print(*(str(OUT_DIR / p) for p in fresh), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
