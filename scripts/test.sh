#!/usr/bin/env bash
# Set up the dev environment, then run every check CI runs: ruff, mypy, stub freshness, buf lint, buf breaking
# (against the previous commit), and pytest (everything but GPU tests). Extra arguments go to pytest,
# e.g. scripts/test.sh tests/unit -k client
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN="$ROOT/.venv/bin"
export PATH="$BIN:$PATH"  # the stub generator runs protoc plugins (protoc-gen-mypy) found on PATH
PER_TEST_TIMEOUT="${LMRPC_TEST_TIMEOUT:-600}"  # seconds, per test (pytest-timeout)

stage() { printf '\n=== %s ===\n' "$1"; }

stage "setup (scripts/setup.sh --dev)"
scripts/setup.sh --dev

stage "ruff check"
"$BIN/ruff" check .

stage "mypy (server kernels client/lmrpc/client)"
"$BIN/mypy" server kernels client/lmrpc/client

stage "generated stubs are fresh (client/scripts/generate_stubs.py --check)"
"$BIN/python" client/scripts/generate_stubs.py --check

stage "buf lint"
"$BIN/buf" lint

stage "buf breaking (against the previous commit)"
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "skipped: not a git work tree"
elif ! git rev-parse -q --verify 'HEAD~1^{commit}' >/dev/null; then
  echo "skipped: no previous commit (a first commit, or a shallow clone)"
elif ! git cat-file -e 'HEAD~1:proto' 2>/dev/null || ! git cat-file -e 'HEAD~1:buf.yaml' 2>/dev/null; then
  echo "skipped: the previous commit has no proto/ or buf.yaml"
else
  "$BIN/buf" breaking --against '.git#ref=HEAD~1'
  echo "no breaking change against $(git rev-parse --short HEAD~1)"
fi

# tests/e2e/test_nginx.py puts nginx in front of two replicas. It skips without nginx on a developer's machine,
# but in CI it must run, so CI installs Debian's nginx-light (a fresh machine has no nginx).
stage "nginx (for tests/e2e/test_nginx.py)"
if command -v nginx >/dev/null 2>&1 || [[ -x /usr/sbin/nginx ]]; then
  echo "found: $(command -v nginx || echo /usr/sbin/nginx)"
elif [[ -n "${CI:-}" ]]; then
  SUDO=()
  if [[ "$(id -u)" -ne 0 ]] && command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo -n)
  fi
  ${SUDO[@]+"${SUDO[@]}"} apt-get update
  ${SUDO[@]+"${SUDO[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx-light
else
  echo "skipped: not installed and not in CI (tests/e2e/test_nginx.py will skip; apt-get install nginx-light)"
fi

# tests/e2e/test_container.py runs the image. CI builds it here with podman from Debian's packages alone (no
# container registry is reachable): a debootstrapped Debian base, then the Dockerfile (scripts/container.sh). Layers
# are cached between runs on one machine; a fresh machine takes several minutes. Off CI the test skips unless the
# image was built by hand.
stage "container image (scripts/container.sh)"
if [[ -n "${CI:-}" ]]; then
  SUDO=()
  if [[ "$(id -u)" -ne 0 ]] && command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo -n)
  fi
  if ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
    ${SUDO[@]+"${SUDO[@]}"} apt-get update
    ${SUDO[@]+"${SUDO[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      podman runc debootstrap
  fi
  ${SUDO[@]+"${SUDO[@]}"} scripts/container.sh localhost/lmrpc:test
else
  echo "skipped: not in CI (build it with scripts/container.sh; tests/e2e/test_container.py skips without it)"
fi

# pytest imports test files by basename (tests import helpers such as fake_engine as top-level modules), so two
# test files of one name in different folders break collection of the whole run: say which, before pytest does.
stage "test file names are unique"
dupes="$(find tests -name 'test_*.py' -not -path '*/node_modules/*' -printf '%f\n' | sort | uniq -d)"
if [[ -n "$dupes" ]]; then
  echo "test.sh: FAILED: test files share a name (rename one): $dupes" >&2
  exit 1
fi
echo "ok"

stage "pytest -m 'not gpu' (timeout ${PER_TEST_TIMEOUT}s per test)"
set +e
"$BIN/pytest" -m "not gpu" --timeout="$PER_TEST_TIMEOUT" -q -rfEs --durations=15 "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "test.sh: FAILED: pytest collected no tests (exit 5); a run that tests nothing must not pass" >&2
  exit 5
elif [[ $rc -ne 0 ]]; then
  echo "test.sh: FAILED: pytest exited $rc" >&2
  exit "$rc"
fi
echo
echo "test.sh: all checks passed"
