#!/usr/bin/env bash
# N lmrpc-server replicas of one model behind SGLang's model gateway (SMG) with cache-aware routing, on this machine.
#
#   scripts/cluster.sh [-n REPLICAS] [--port SMG_PORT] [--worker-port FIRST] [--policy POLICY]
#                      [--smg-arg ARG]... [-- lmrpc-server flags...]
#
# Starts REPLICAS (default 2) lmrpc-server processes on 127.0.0.1:FIRST, FIRST+1, ... (default: free ports), each
# with the flags after `--` (the same model for all: --model ...), waits until every one is ready, then starts
# `smg launch --policy cache_aware` (default) on SMG_PORT (default 30000) with --worker-urls grpc://127.0.0.1:PORT.
# SMG subscribes to each worker's KV-event stream (SubscribeKvEvents) on its own: the replicas publish their prefix
# caches' pages, so cache-aware routing sees what each replica holds, and the load records on that stream stand in
# for GetLoads polling. --smg-arg passes one more argument to smg (repeat it).
#
# Prints, once SMG answers a completion through the model:
#   cluster: worker <i> pid <pid> grpc://127.0.0.1:<port>   (one line per replica)
#   cluster: smg pid <pid>
#   cluster: ready http://127.0.0.1:<SMG_PORT>/v1
# and runs until Ctrl-C, SIGTERM or SMG's exit; everything it started is stopped on exit. A replica that dies is
# reported and the rest keep serving. Logs: $LMRPC_CLUSTER_LOGS (default: a fresh directory under $TMPDIR).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${LMRPC_BIN:-$ROOT/.venv/bin}"
READY_TIMEOUT="${LMRPC_CLUSTER_READY_TIMEOUT:-300}"  # seconds for each replica to load, and for SMG to register

REPLICAS=2
SMG_PORT=30000
WORKER_PORT=""
POLICY=cache_aware
SMG_ARGS=()
SERVER_ARGS=()
while (($#)); do
  case "$1" in
    -n|--replicas) REPLICAS="$2"; shift 2 ;;
    --port) SMG_PORT="$2"; shift 2 ;;
    --worker-port) WORKER_PORT="$2"; shift 2 ;;
    --policy) POLICY="$2"; shift 2 ;;
    --smg-arg) SMG_ARGS+=("$2"); shift 2 ;;
    --) shift; SERVER_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "cluster: unknown argument $1 (lmrpc-server flags go after --)" >&2; exit 2 ;;
  esac
done

free_port() {
  "$BIN/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

LOGS="${LMRPC_CLUSTER_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/lmrpc-cluster.XXXXXX")}"
mkdir -p "$LOGS"
PIDS=()
PORTS=()
SMG_PID=""

stop_all() {
  trap - EXIT INT TERM
  # SMG first (no new requests reach the replicas), then the replicas: SIGTERM drains each (app.py).
  for pid in $SMG_PID "${PIDS[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in $SMG_PID "${PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap stop_all EXIT

fail() {
  echo "cluster: $1 (logs in $LOGS)" >&2
  exit 1
}

for ((i = 0; i < REPLICAS; i++)); do
  if [[ -n "$WORKER_PORT" ]]; then port=$((WORKER_PORT + i)); else port="$(free_port)"; fi
  "$BIN/lmrpc-server" --host 127.0.0.1 --port "$port" "${SERVER_ARGS[@]}" >"$LOGS/worker$i.log" 2>&1 &
  PIDS+=("$!")
  PORTS+=("$port")
done

# The replicas load concurrently; each is ready when it prints "lmrpc-server ready" (after its warm-up).
deadline=$((SECONDS + READY_TIMEOUT))
for ((i = 0; i < REPLICAS; i++)); do
  until grep -q '^lmrpc-server ready' "$LOGS/worker$i.log" 2>/dev/null; do
    kill -0 "${PIDS[$i]}" 2>/dev/null || fail "worker $i exited before it was ready"
    ((SECONDS < deadline)) || fail "worker $i was not ready within ${READY_TIMEOUT}s"
    sleep 0.5
  done
done

URLS=()
for port in "${PORTS[@]}"; do URLS+=("grpc://127.0.0.1:$port"); done
"$BIN/smg" launch --host 127.0.0.1 --port "$SMG_PORT" --prometheus-port "$(free_port)" --policy "$POLICY" \
  --worker-urls "${URLS[@]}" "${SMG_ARGS[@]}" >"$LOGS/smg.log" 2>&1 &
SMG_PID=$!

# SMG lists the model before it has registered the workers' tokenizer (503 meanwhile): ready is a completion served.
BASE="http://127.0.0.1:$SMG_PORT/v1"
ready() {
  "$BIN/python" - "$BASE" <<'EOF'
import json, sys, urllib.request
base = sys.argv[1]
try:
    models = json.load(urllib.request.urlopen(base + "/models", timeout=5))["data"]
    body = json.dumps({"model": models[0]["id"], "prompt": "Hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(base + "/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).read()
except (OSError, ValueError, KeyError, IndexError):  # not ready yet: refused, 503, no model listed
    sys.exit(1)
EOF
}
deadline=$((SECONDS + READY_TIMEOUT))
until ready; do
  kill -0 "$SMG_PID" 2>/dev/null || fail "smg exited"
  ((SECONDS < deadline)) || fail "smg did not serve a completion within ${READY_TIMEOUT}s"
  sleep 0.5
done

for ((i = 0; i < REPLICAS; i++)); do
  echo "cluster: worker $i pid ${PIDS[$i]} ${URLS[$i]}"
done
echo "cluster: smg pid $SMG_PID"
echo "cluster: ready $BASE"

declare -A REPORTED=()
while kill -0 "$SMG_PID" 2>/dev/null; do
  for ((i = 0; i < REPLICAS; i++)); do
    if [[ -z "${REPORTED[$i]:-}" ]] && ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
      echo "cluster: worker $i (pid ${PIDS[$i]}) exited; SMG routes to the others" >&2
      REPORTED[$i]=1
    fi
  done
  sleep 1
done
fail "smg exited"
