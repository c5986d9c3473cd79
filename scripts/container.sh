#!/usr/bin/env bash
# Build the lmrpc image with podman from Debian's packages alone, no container registry:
#   1. a Debian bookworm base made with debootstrap (once; kept as localhost/debian-base:bookworm),
#   2. the repo's Dockerfile on it (BASE_IMAGE build argument), torch's CPU wheel taken from a local wheel directory
#      when there is one (WHEELS, default /opt/wheels: PyPI's own torch wheel for Linux is the multi-GB CUDA build).
#
#   scripts/container.sh [IMAGE]          IMAGE defaults to localhost/lmrpc:test
# Needs root, podman, runc and debootstrap (apt-get install podman runc debootstrap). tests/e2e/test_container.py
# runs the image.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${1:-localhost/lmrpc:test}"
BASE="localhost/debian-base:bookworm"
WHEELS="${WHEELS:-/opt/wheels}"
SUITE_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null || { echo "container.sh: $tool is missing (apt-get install podman runc debootstrap)" >&2; exit 1; }
done

if ! podman image exists "$BASE"; then
  echo "container.sh: making $BASE with debootstrap"
  dir="$(mktemp -d)"
  trap 'rm -rf "$dir"' EXIT
  debootstrap --variant=minbase bookworm "$dir" "$SUITE_MIRROR" >/dev/null
  tar -C "$dir" -c . | podman import - "$BASE" >/dev/null
  rm -rf "$dir"
  trap - EXIT
fi

args=(--network host --build-arg "BASE_IMAGE=$BASE" -t "$IMAGE")
if [[ -d "$WHEELS" ]] && compgen -G "$WHEELS/torch-*+cpu-*.whl" >/dev/null; then
  # The CPU wheel from this machine's wheel directory; everything else from PyPI.
  args+=(--volume "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels
         --build-arg TORCH_INDEX_URL=https://pypi.org/simple)
fi
CA_BUNDLE="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
if [[ -f "$CA_BUNDLE" ]]; then
  # This machine's CA bundle for pip inside the build (its TLS proxy's CA is in it, not in Debian's).
  args+=(--volume "$CA_BUNDLE:/host-ca/ca.crt:ro" --build-arg PIP_CA_BUNDLE=/host-ca/ca.crt)
fi
echo "container.sh: building $IMAGE"
podman build "${args[@]}" -f "$ROOT/Dockerfile" "$ROOT"
