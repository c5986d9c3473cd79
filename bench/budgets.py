"""lmrpc servers side by side, one per step token budget (`--max-batched-tokens`): what a smaller step buys in time
to first token and costs in throughput when a burst of prompts arrives together.

    nice -n 19 .venv/bin/python bench/budgets.py [--model FILE] [--budgets 512 256 128] [--streams 8 32] [--rounds 3]
                                                   [--prompt-len 64] [--new-tokens 64]

One server per budget, all started first (each holds its model; a 1.7B Q4_K_M file takes ~2.2 GB per server). Per
round and stream count, the servers take turns (the order reversed every other round): --streams requests of random
token ids are sent at once over one channel (greedy, EOS ignored, streamed). Per run: TTFT p50 (from sending to the
first token) and tok/s (new tokens over the time from sending to the last token). Reported: medians over rounds, and
medians of per-round ratios to the first budget.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import serverproc

from lmrpc.client import AsyncClient


@dataclass(frozen=True)
class Run:
    ttft_p50: float  # seconds from sending a request to its first token, median over the streams
    tok_s: float  # new tokens of all streams over the time from sending to the last token


async def stream(client: AsyncClient, prompt: list[int], new_tokens: int, sent: float) -> tuple[float, float, int]:
    """(seconds to the first token, when the last came, tokens) of one streamed request."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.0}
    first = last = 0.0
    count = 0
    async for delta in await client.generate(input_ids=prompt, sampling_params=params, stream=True):
        if delta.token_ids:
            last = time.perf_counter()
            first = first or last
            count += len(delta.token_ids)
    return first - sent, last, count


async def burst(client: AsyncClient, streams: int, args: argparse.Namespace, rng: random.Random) -> Run:
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(streams)]
    sent = time.perf_counter()
    done = await asyncio.gather(*(stream(client, p, args.new_tokens, sent) for p in prompts))
    end = max(last for _, last, _ in done)
    return Run(statistics.median(ttft for ttft, _, _ in done), sum(n for _, _, n in done) / (end - sent))


async def main(args: argparse.Namespace) -> None:
    budgets = [str(b) for b in args.budgets]
    model = ("--model", args.model) if args.model else ()
    servers = {b: serverproc.start(*model, "--max-running-requests", "64", "--kv-cache-tokens", "4096",
                                   "--max-batched-tokens", b) for b in budgets}
    clients = {b: AsyncClient(s.target) for b, s in servers.items()}
    runs: dict[tuple[str, int], list[Run]] = {(b, n): [] for b in budgets for n in args.streams}
    try:
        for client in clients.values():
            await client.__aenter__()
            await burst(client, 4, args, random.Random(0))  # warm-up, untimed
        for r in range(args.rounds):
            for n in args.streams:
                for b in budgets if r % 2 == 0 else budgets[::-1]:
                    run = await burst(clients[b], n, args, random.Random(1000 * r + n))
                    runs[(b, n)].append(run)
                    print(f"round {r + 1} budget {b} x{n}: TTFT p50 {run.ttft_p50 * 1e3:,.0f} ms, "
                          f"{run.tok_s:.1f} tok/s", flush=True)
    finally:
        for client in clients.values():
            await client.__aexit__(None, None, None)
        for server in servers.values():
            server.stop()
    base = budgets[0]
    print(f"\n| streams | budget | TTFT p50 ms | tok/s | TTFT ratio to {base} | tok/s ratio to {base} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.streams:
        for b in budgets:
            mine, theirs = runs[(b, n)], runs[(base, n)]
            ttft = statistics.median(a.ttft_p50 / c.ttft_p50 for a, c in zip(mine, theirs, strict=True))
            tok = statistics.median(a.tok_s / c.tok_s for a, c in zip(mine, theirs, strict=True))
            print(f"| {n} | {b} | {statistics.median(x.ttft_p50 for x in mine) * 1e3:,.0f} | "
                  f"{statistics.median(x.tok_s for x in mine):.1f} | {ttft:.2f}x | {tok:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the bundled model)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 256, 128])
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    asyncio.run(main(parser.parse_args()))
