#!/usr/bin/env bash
# The demo: set up, start lmrpc-server with the default model (SmolLM2-135M-Instruct) on a loopback port, wait
# until it reports SERVING over grpc.health.v1, ask one question through chat (the model's chat template, the
# answer streamed by `lmrpc chat`), stop the server.
#   scripts/demo.sh ["question"]       (LMRPC_DEMO_PORT picks the port; default: a free one)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
QUESTION="${1:-What is the capital of France?}"
READY_TIMEOUT=300  # seconds for the server to load the model and report SERVING

scripts/setup.sh
BIN="$ROOT/.venv/bin"

PORT="${LMRPC_DEMO_PORT:-$("$BIN/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
TARGET="127.0.0.1:$PORT"
LOG="$(mktemp "${TMPDIR:-/tmp}/lmrpc-demo-server.XXXXXX.log")"

echo "demo: starting lmrpc-server on $TARGET (log: $LOG)"
"$BIN/lmrpc-server" --host 127.0.0.1 --port "$PORT" >"$LOG" 2>&1 &
SERVER_PID=$!

stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID"
  fi
}
fail() {
  echo "demo: $1; the server's log ends with:" >&2
  tail -n 40 "$LOG" >&2
  exit 1
}
trap 'kill -TERM "$SERVER_PID" 2>/dev/null || true' EXIT

echo "demo: waiting for SERVING (up to ${READY_TIMEOUT}s: loading the model)"
deadline=$((SECONDS + READY_TIMEOUT))
until "$BIN/lmrpc" health --target "$TARGET" --wait 5 >/dev/null 2>&1; do
  kill -0 "$SERVER_PID" 2>/dev/null || fail "the server exited before it was ready"
  (( SECONDS < deadline )) || fail "the server was not SERVING after ${READY_TIMEOUT}s"
done
"$BIN/lmrpc" info --target "$TARGET"

echo
echo "demo: lmrpc chat \"$QUESTION\" --max-tokens 64 --temperature 0"
"$BIN/lmrpc" chat "$QUESTION" --target "$TARGET" --max-tokens 64 --temperature 0 || fail "chat failed"

echo
echo "demo: stopping the server (SIGTERM)"
set +e
stop_server
rc=$?
set -e
trap - EXIT
if [[ $rc -ne 0 ]]; then
  fail "the server exited with status $rc on SIGTERM (expected a clean 0)"
fi
echo "demo: server stopped cleanly"
