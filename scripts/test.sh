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

stage() { printf '\n=== %s (%s) ===\n' "$1" "$(date -u +%H:%M:%S)"; }  # the clock: where CI's minutes go

stage "setup (scripts/setup.sh --dev)"
scripts/setup.sh --dev

# Work that waits on the network, the disk or the compiler runs in the background while the checks below run, at
# the lowest priority (nice 19) unless pytest needs it first, so that it takes the CPU the foreground leaves idle
# (pytest leaves about a third of two cores idle): CI's wall time is what its 20-minute budget counts. Each
# background job writes a log under $LOGS, shown when the job fails.
LOGS="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # a check that fails ends the run: its background jobs too

# The CPU kernels, for this CPU (-march=native) and portable (LMRPC_KERNEL_ARCH=generic, which
# tests/unit/test_native_kernels.py runs), built into $LMRPC_CACHE (default ~/.cache/lmrpc) as the tests will find them:
# a no-op when cached. pytest waits for the native build below; the portable one runs at the lowest priority and the
# test that needs it waits for it (one builder per cache directory: an flock, lmrpc/kernels/native.py).
stage "CPU kernels (building in the background: $LOGS/kernels.log, $LOGS/kernels-portable.log)"
"$BIN/python" -c 'from lmrpc.kernels import native; native.load()' >"$LOGS/kernels.log" 2>&1 &
KERNELS_PID=$!
LMRPC_KERNEL_ARCH=generic nice -n 19 "$BIN/python" -c 'from lmrpc.kernels import native; native.load()' \
  >"$LOGS/kernels-portable.log" 2>&1 &

stage "ruff check"
"$BIN/ruff" check .

# mypy takes a minute of CPU on a fresh machine: it runs beside pytest at the lowest priority, and its verdict is
# read after pytest.
stage "mypy (server kernels client/lmrpc/client; in the background: $LOGS/mypy.log)"
nice -n 19 "$BIN/mypy" server kernels client/lmrpc/client >"$LOGS/mypy.log" 2>&1 &
MYPY_PID=$!

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

SUDO=()
if [[ "$(id -u)" -ne 0 ]] && command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo -n)
fi
# Debian's packages CI needs: nginx-light for tests/e2e/test_nginx.py (which skips without nginx on a developer's
# machine, but must run in CI), podman, runc and debootstrap for the image. One apt-get, in the foreground: apt
# takes a lock, and nginx must be there before pytest starts.
stage "Debian packages (nginx for tests/e2e/test_nginx.py; podman, runc, debootstrap for the image)"
if [[ -n "${CI:-}" ]]; then
  packages=()
  command -v nginx >/dev/null 2>&1 || [[ -x /usr/sbin/nginx ]] || packages+=(nginx-light)
  for tool in podman runc debootstrap; do
    command -v "$tool" >/dev/null 2>&1 || packages+=("$tool")
  done
  if [[ ${#packages[@]} -gt 0 ]]; then
    ${SUDO[@]+"${SUDO[@]}"} apt-get update
    ${SUDO[@]+"${SUDO[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${packages[@]}"
  else
    echo "found: nginx, podman, runc, debootstrap"
  fi
else
  echo "skipped: not in CI (tests/e2e/test_nginx.py skips without nginx: apt-get install nginx-light)"
fi

# tests/e2e/test_container.py runs the image. CI builds it with podman from Debian's packages alone (no container
# registry is reachable): a debootstrapped Debian base, then the Dockerfile (scripts/container.sh), then one run of
# the image as the test runs it (non-root, read-only root) that builds its kernels into the test's cache volume.
# Layers and the volume are kept between runs on one machine; a fresh machine takes several minutes, in the
# background: the container test runs last and waits for this job (LMRPC_TEST_IMAGE_STATUS: its exit code, written
# when it ends). Off CI the test skips unless the image was built by hand.
stage "container image (building in the background: $LOGS/container.log)"
if [[ -n "${CI:-}" ]]; then
  # podman runs each container in a cgroup of its own, where nice no longer ranks it below pytest: the image's kernel
  # build beside the suite's first server took a test from 5 s to 65 s. Where podman manages cgroup v1 directories
  # itself (cgroupfs), that run goes under a CPU cgroup of the least weight instead (podman build refuses such a
  # parent: its containers set up the devices controller there); elsewhere it runs as before.
  BACKGROUND=()
  cpu_root=/sys/fs/cgroup/cpu
  if [[ -f "$cpu_root/cpu.shares" ]] &&
    [[ "$(${SUDO[@]+"${SUDO[@]}"} podman info --format '{{.Host.CgroupManager}}' 2>/dev/null)" == cgroupfs ]] &&
    ${SUDO[@]+"${SUDO[@]}"} mkdir -p "$cpu_root/lmrpc-background" &&
    echo 2 | ${SUDO[@]+"${SUDO[@]}"} tee "$cpu_root/lmrpc-background/cpu.shares" >/dev/null; then
    BACKGROUND=(--cgroup-parent /lmrpc-background)
    echo "the image's kernel build runs under the cgroup /lmrpc-background (cpu.shares 2)"
  fi
  export LMRPC_TEST_IMAGE="${LMRPC_TEST_IMAGE:-localhost/lmrpc:test}"
  export LMRPC_TEST_CACHE_VOLUME="${LMRPC_TEST_CACHE_VOLUME:-lmrpc-test-cache}"
  export LMRPC_TEST_IMAGE_STATUS="$LOGS/container.status" LMRPC_TEST_IMAGE_LOG="$LOGS/container.log"
  (
    rc=0
    {
      ${SUDO[@]+"${SUDO[@]}"} nice -n 19 scripts/container.sh "$LMRPC_TEST_IMAGE" &&
        ${SUDO[@]+"${SUDO[@]}"} nice -n 19 podman run --rm --runtime runc --network host \
          ${BACKGROUND[@]+"${BACKGROUND[@]}"} --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
          --read-only --tmpfs /tmp -v "$LMRPC_TEST_CACHE_VOLUME:/opt/lmrpc-cache" "$LMRPC_TEST_IMAGE" \
          python3 -c 'from lmrpc.kernels import native; native.load(); print("kernels built in the volume")'
    } >"$LMRPC_TEST_IMAGE_LOG" 2>&1 || rc=$?
    echo "$rc" >"$LMRPC_TEST_IMAGE_STATUS.tmp" && mv "$LMRPC_TEST_IMAGE_STATUS.tmp" "$LMRPC_TEST_IMAGE_STATUS"
  ) &
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

stage "CPU kernels (waiting for the background build)"
if ! wait "$KERNELS_PID"; then
  cat "$LOGS/kernels.log" >&2
  echo "test.sh: FAILED: building the CPU kernels" >&2
  exit 1
fi
echo "ok"

stage "pytest -m 'not gpu' (timeout ${PER_TEST_TIMEOUT}s per test)"
set +e
"$BIN/pytest" -m "not gpu" --timeout="$PER_TEST_TIMEOUT" -q -rfEs --durations=15 "$@"
rc=$?
set -e
stage "mypy (its verdict)"
if ! wait "$MYPY_PID"; then
  cat "$LOGS/mypy.log" >&2
  echo "test.sh: FAILED: mypy" >&2
  exit 1
fi
cat "$LOGS/mypy.log"
if [[ $rc -eq 5 ]]; then
  echo "test.sh: FAILED: pytest collected no tests (exit 5); a run that tests nothing must not pass" >&2
  exit 5
elif [[ $rc -ne 0 ]]; then
  echo "test.sh: FAILED: pytest exited $rc" >&2
  exit "$rc"
fi
echo
echo "test.sh: all checks passed ($SECONDS s)"
