"""What streaming costs per token: one lmrpc-server (the bundled model unless --model), one request at a time, each
round a streamed call and a unary one (which goes first alternates), and per call the wall time and the CPU time per
generated token of the server's event loop (its main thread), of its two busiest other threads (the engine thread and
the compute worker: a decode step's products run on both), of its remaining threads, and of this client.

    nice -n 19 .venv/bin/python bench/streaming.py [--rounds 4] [--prompt-len 128] [--new-tokens 256]
                                                   [--model FILE] [--lmrpc-args "..."]

A unary call's outputs still reach the event loop once per step (the engine posts them; the call gathers them), so
stream minus unary is what writing one message per token adds: gRPC's per-message work on the server's event loop,
and in the client. On a machine whose cores all run the model's products, both take CPU from them. Figures from one
busy machine are noisy: compare the medians over rounds, and the per-round ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import shlex
import statistics
from dataclasses import dataclass

import serverproc

from lmrpc.client import AsyncClient

TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of a process, by thread id."""
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Call:
    """One call's figures, per generated token (milliseconds)."""

    wall: float  # from sending the request to its last message
    loop: float  # CPU of the server's main thread (its asyncio event loop)
    compute: float  # CPU of the server's two busiest other threads (engine thread, compute worker)
    other: float  # CPU of the server's remaining threads
    client: float  # CPU of this process


async def one_call(client: AsyncClient, pid: int, prompt: list[int], new_tokens: int, stream: bool) -> Call:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.0}
    before, client_before = thread_cpu(pid), own_cpu()
    started = asyncio.get_running_loop().time()
    tokens = 0
    if stream:
        async for delta in await client.generate(input_ids=prompt, sampling_params=params, stream=True):
            tokens += len(delta.token_ids)
    else:
        results = await client.generate(input_ids=prompt, sampling_params=params)
        tokens = sum(len(r.token_ids) for r in results)
    wall = asyncio.get_running_loop().time() - started
    after, client_after = thread_cpu(pid), own_cpu()
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    loop = used.pop(pid, 0.0)
    busiest = sorted(used.values(), reverse=True)
    per_token = 1e3 / tokens
    return Call(wall * per_token, loop * per_token, sum(busiest[:2]) * per_token, sum(busiest[2:]) * per_token,
                (client_after - client_before) * per_token)


def row(name: str, calls: list[Call]) -> str:
    def med(field: str) -> float:
        return statistics.median(getattr(c, field) for c in calls)

    return (f"| {name} | {med('wall'):.2f} | {med('loop'):.3f} | {med('compute'):.2f} | {med('other'):.3f} | "
            f"{med('client'):.3f} |")


async def run(args: argparse.Namespace) -> None:
    model = ["--model", args.model] if args.model else []
    server = serverproc.start(*model, "--kv-cache-tokens", str(4 * (args.prompt_len + args.new_tokens)),
                              *shlex.split(args.lmrpc_args))
    try:
        rng = random.Random(0)

        def prompt() -> list[int]:
            return [rng.randrange(100, 40000) for _ in range(args.prompt_len)]

        calls: dict[bool, list[Call]] = {True: [], False: []}
        async with AsyncClient(server.target) as client:
            await one_call(client, server.pid, prompt(), 8, stream=True)  # untimed: first-call costs
            for r in range(args.rounds):
                for stream in ((True, False) if r % 2 == 0 else (False, True)):
                    calls[stream].append(await one_call(client, server.pid, prompt(), args.new_tokens, stream))
        print(f"{args.rounds} rounds, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, one call at a "
              "time; medians, milliseconds per generated token")
        print("| call | wall | server event loop CPU | engine + compute worker CPU | other server threads CPU | "
              "client CPU |")
        print("| --- | --- | --- | --- | --- | --- |")
        print(row("streamed", calls[True]))
        print(row("unary", calls[False]))
        ratio = statistics.median(s.wall / u.wall for s, u in zip(calls[True], calls[False], strict=True))
        print(f"wall time per token, streamed / unary: median of per-round ratios {ratio:.3f}")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the bundled model)")
    parser.add_argument("--lmrpc-args", default="", help="extra lmrpc-server flags")
    args = parser.parse_args()
    if args.rounds < 1 or args.prompt_len < 1 or args.new_tokens < 2:
        parser.error("--rounds, --prompt-len must be >= 1 and --new-tokens >= 2")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
