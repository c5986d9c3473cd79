"""Gateway benchmark: one lmrpc-server called through SMG (SGLang's model gateway) vs called directly.

    nice -n 19 .venv/bin/python bench/gateway.py [--streams 8 32] [--rounds 3] [--new-tokens 64]
                                                 [--policy round_robin] [--lmrpc-args "--kv-cache-tokens 65536"]
                                                 [--json FILE]

One lmrpc-server (bench/serverproc.py starts it: python -m lmrpc.server on a free loopback port, the bundled model
unless --lmrpc-args says otherwise) and one `smg launch --worker-urls grpc://127.0.0.1:PORT --policy POLICY` in
front of it. The two paths are:
  gateway  OpenAI chat completions over HTTP to SMG (the `openai` SDK, streamed): SMG renders the chat template,
           tokenizes, sends token ids to lmrpc's SMG worker service (sglang.grpc.scheduler.SglangScheduler) and
           detokenizes what comes back into server-sent events.
  direct   lmrpc's own OpenAI-shaped ChatComplete over gRPC (lmrpc's AsyncClient, streamed): lmrpc renders the same
           chat template, tokenizes and detokenizes itself.
Why chat on both sides: each path then does the whole job a client asks for (messages in, text deltas out) with
the same template, tokenizer and engine, so the difference is what the gateway adds: a hop, HTTP/1.1 + SSE instead
of gRPC, and tokenization in SMG's Rust instead of lmrpc's Python. Comparing against lmrpc's Generate with token
ids would spare the direct path its tokenizer and detokenizer, which the gateway path cannot skip. Both run on this
host and share its cores, so SMG's CPU time is taken from lmrpc's (in a cluster they run in separate pods): on a
2-core machine that cost is part of the figure.

Every stream: one user message of --prompt-words words, greedy, --new-tokens new tokens with EOS ignored
(`ignore_eos`, which both paths accept), usage reported at the end (stream_options.include_usage). The message
starts with a number unique to the round, level, path and stream, so neither path meets the other's prompts in
lmrpc's prefix cache (only the chat template's opening is shared, alike for both); the words after it are the same
on both paths in a round. Each of --rounds rounds runs every level of --streams on both paths, the paths taking turns
(which goes first alternates by round). A level sends all its streams at once. Per path and level:
  tok/s    completion tokens (from usage) / wall time from the first request sent to the last chunk received
  TTFT     per stream, from sending its request to the first chunk with text; p50 over the level's streams
Reported: per-round figures, and per level the median over rounds of the per-round ratios gateway / direct (tok/s:
below 1 is the gateway slower; TTFT: above 1 is the gateway slower). The host (lscpu's model name) heads the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import openai
import serverproc

from lmrpc.client import AsyncClient

PATHS = ("gateway", "direct")
SMG = str(Path(sys.executable).with_name("smg"))  # installed beside this Python (requirements-dev.txt)
SMG_READY_TIMEOUT = 180.0  # seconds: SMG lists the model before its tokenizer is registered (503 meanwhile)
WORDS = ("river", "window", "garden", "silver", "morning", "paper", "mountain", "signal", "lantern", "harbor",
         "engine", "meadow", "copper", "thunder", "station", "velvet", "orchard", "compass", "marble", "feather")


@dataclass(frozen=True)
class Stream:
    """What one stream saw (seconds on time.perf_counter())."""

    sent: float  # request sent
    first_text: float | None  # first chunk carrying text
    last: float  # last chunk received
    completion_tokens: int  # from usage


@dataclass(frozen=True)
class LevelRun:
    """One path at one level in one round."""

    path: str
    streams: int
    tok_s: float
    ttft_p50_ms: float


Send = Callable[[str], Awaitable[Stream]]  # one streamed chat call for this user message


def host_name() -> str:
    """lscpu's model name: which of the session hosts this ran on."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def gateway_send(client: openai.AsyncOpenAI, model: str, new_tokens: int) -> Send:
    async def send(message: str) -> Stream:
        sent = time.perf_counter()
        first = None
        tokens = 0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": message}], temperature=0, max_tokens=new_tokens,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return Stream(sent, first, time.perf_counter(), tokens)

    return send


def direct_send(client: AsyncClient, new_tokens: int) -> Send:
    async def send(message: str) -> Stream:
        sent = time.perf_counter()
        first = None
        tokens = 0
        stream = await client.chat(message, stream=True, temperature=0, max_tokens=new_tokens, ignore_eos=True,
                                   stream_options={"include_usage": True})
        async for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if first is None and delta is not None and delta.content:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return Stream(sent, first, time.perf_counter(), tokens)

    return send


def messages(rng: random.Random, count: int, words: int, tag: int) -> list[str]:
    """`count` user messages: a number unique to (tag, stream) first (prefix-cache misses), then the round's words."""
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return [f"{tag:04d}{i:03d}: {body}" for i in range(count)]


async def run_level(path: str, send: Send, batch: list[str], new_tokens: int, timeout: float) -> LevelRun:
    start = time.perf_counter()
    streams = await asyncio.wait_for(asyncio.gather(*(send(m) for m in batch)), timeout)
    wall = max(s.last for s in streams) - start
    short = [s.completion_tokens for s in streams if s.completion_tokens != new_tokens]
    if short:  # EOS ignored: every stream must run to max_tokens, or the paths did different work
        raise RuntimeError(f"{path}: streams ended with {short} tokens, not {new_tokens}")
    ttfts = [s.first_text - s.sent for s in streams if s.first_text is not None]
    if len(ttfts) != len(streams):
        raise RuntimeError(f"{path}: {len(streams) - len(ttfts)} streams carried no text")
    return LevelRun(path, len(batch), sum(s.completion_tokens for s in streams) / wall,
                    statistics.median(ttfts) * 1000)


def start_smg(worker: str, policy: str) -> tuple[subprocess.Popen[bytes], str]:
    port = serverproc.free_port()
    argv = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(serverproc.free_port()),
            "--worker-urls", f"grpc://{worker}", "--policy", policy, "--log-level", "warn"]
    print("smg:", shlex.join(argv), flush=True)
    # Its log is not read: DEVNULL, so a full pipe can never stall it.
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}/v1"


async def wait_for_smg(process: subprocess.Popen[bytes], client: openai.AsyncOpenAI, model: str) -> None:
    deadline = time.monotonic() + SMG_READY_TIMEOUT
    while time.monotonic() < deadline:
        try:
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=1)
            return
        except (openai.APIConnectionError, openai.NotFoundError, openai.InternalServerError,
                openai.APITimeoutError):
            pass  # not listening yet, or the worker (its tokenizer) not registered yet
        if process.poll() is not None:
            raise RuntimeError(f"smg exited with {process.returncode}")
        await asyncio.sleep(0.5)
    raise RuntimeError(f"smg did not register the worker within {SMG_READY_TIMEOUT:.0f} s")


async def benchmark(args: argparse.Namespace, target: str, base_url: str,
                    smg: subprocess.Popen[bytes]) -> list[list[LevelRun]]:
    gateway = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=args.timeout)
    async with AsyncClient(target) as direct:
        model = (await direct.model_info()).served_model_name
        await wait_for_smg(smg, gateway, model)
        sends: dict[str, Send] = {"gateway": gateway_send(gateway, model, args.new_tokens),
                                  "direct": direct_send(direct, args.new_tokens)}
        rng = random.Random(args.seed)
        for path in PATHS:  # warm both paths (SMG's connection, lmrpc's template and tokenizer) outside the timing
            await run_level(path, sends[path], messages(rng, 2, args.prompt_words, 9000 + PATHS.index(path)),
                            args.new_tokens, args.timeout)
        rounds: list[list[LevelRun]] = []
        for r in range(args.rounds):
            runs: list[LevelRun] = []
            order = PATHS if r % 2 == 0 else PATHS[::-1]
            for level, streams in enumerate(args.streams):
                body_seed = rng.random()
                for path in order:
                    tag = (r * len(args.streams) + level) * len(PATHS) + PATHS.index(path)
                    batch = messages(random.Random(body_seed), streams, args.prompt_words, tag)
                    run = await run_level(path, sends[path], batch, args.new_tokens, args.timeout)
                    print(f"round {r + 1} {path:8s} {streams:3d} streams: {run.tok_s:8.1f} tok/s"
                          f"  TTFT p50 {run.ttft_p50_ms:8.1f} ms", flush=True)
                    runs.append(run)
            rounds.append(runs)
    await gateway.close()
    return rounds


def ratios(rounds: Sequence[Sequence[LevelRun]], streams: int) -> tuple[float, float]:
    """Median over rounds of gateway / direct: (tok/s, TTFT p50)."""
    tok, ttft = [], []
    for runs in rounds:
        by_path = {run.path: run for run in runs if run.streams == streams}
        g, d = by_path["gateway"], by_path["direct"]
        tok.append(g.tok_s / d.tok_s)
        ttft.append(g.ttft_p50_ms / d.ttft_p50_ms)
    return statistics.median(tok), statistics.median(ttft)


def report(args: argparse.Namespace, rounds: list[list[LevelRun]], host: str) -> str:
    lines = [f"host: {host}", f"command: {shlex.join(sys.argv)}",
             f"lmrpc behind SMG ({args.policy}) vs direct; {args.rounds} rounds, {args.new_tokens} new tokens,"
             f" {args.prompt_words}-word messages; medians over rounds",
             "streams | gateway tok/s | direct tok/s | ratio | gateway TTFT p50 ms | direct TTFT p50 ms | ratio"]
    for streams in args.streams:
        med = {path: (statistics.median(run.tok_s for runs in rounds for run in runs
                                        if run.path == path and run.streams == streams),
                      statistics.median(run.ttft_p50_ms for runs in rounds for run in runs
                                        if run.path == path and run.streams == streams)) for path in PATHS}
        tok_ratio, ttft_ratio = ratios(rounds, streams)
        lines.append(f"{streams:7d} | {med['gateway'][0]:13.1f} | {med['direct'][0]:12.1f} | {tok_ratio:5.3f} |"
                     f" {med['gateway'][1]:19.1f} | {med['direct'][1]:18.1f} | {ttft_ratio:5.3f}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[8, 32], help="concurrent streams per level")
    p.add_argument("--rounds", type=int, default=3, help="rounds (report medians of per-round ratios over them)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per stream (EOS ignored)")
    p.add_argument("--prompt-words", type=int, default=48, help="words in each user message after its number")
    p.add_argument("--policy", default="round_robin", help="SMG's --policy (one worker: it only picks that one)")
    p.add_argument("--lmrpc-args", default="", help="extra lmrpc-server flags, one shell-quoted string")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for one level of one path")
    p.add_argument("--seed", type=int, default=0, help="seeds the messages' words")
    p.add_argument("--json", type=Path, help="also write every round's figures here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 1 or any(s < 1 for s in args.streams):
        p.error("--rounds, --new-tokens and --streams must be >= 1")
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    if not Path(SMG).exists():
        sys.exit(f"{SMG} not found: pip install smg==1.13.0 (requirements-dev.txt)")
    host = host_name()
    print(f"host: {host}", flush=True)
    server = serverproc.start(*shlex.split(args.lmrpc_args))
    print(f"lmrpc-server pid {server.pid} on {server.target}", flush=True)
    smg: subprocess.Popen[bytes] | None = None
    try:
        smg, base_url = start_smg(server.target, args.policy)
        rounds = asyncio.run(benchmark(args, server.target, base_url, smg))
    finally:
        if smg is not None:
            smg.terminate()
            try:
                smg.wait(timeout=30)
            except subprocess.TimeoutExpired:
                smg.kill()
                smg.wait()
        server.stop()
    print(report(args, rounds, host))
    if args.json is not None:
        args.json.write_text(json.dumps({"host": host, "argv": sys.argv, "rounds": [[asdict(r) for r in runs]
                                                                                    for runs in rounds]}, indent=1))


if __name__ == "__main__":
    main()
