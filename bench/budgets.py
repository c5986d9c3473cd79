"""lmrpc servers side by side, one per step token budget (`--max-batched-tokens`): what a smaller step buys in time
to first token and costs in throughput when a burst of prompts arrives together.

    nice -n 19 .venv/bin/python bench/budgets.py [--model FILE] [--budgets 512 256 128] [--streams 8 32] [--rounds 3]
                                                   [--prompt-len 64] [--new-tokens 64]

One server per budget, all started first (each holds its model; a 1.7B Q4_K_M file takes ~2.2 GB per server). Per
round and stream count, the servers take turns (the order reversed every other round): --streams requests of random
token ids are sent at once over one channel (greedy, EOS ignored, streamed). Per run: TTFT p50 (from sending to the
first token) and tok/s (new tokens over the time from the first request sent to the last token), timed as
bench/served.py times a level. Reported: medians over rounds, and medians of per-round ratios to the first budget.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics

import serverproc
from served_clients import Generate, lmrpc_generate
from served_stats import LevelRun, level_run

from lmrpc.client import AsyncClient


async def burst(generate: Generate, server: serverproc.ServerProcess, streams: int, args: argparse.Namespace,
                rng: random.Random) -> LevelRun:
    """`streams` requests of random token ids sent at once, timed as bench/served.py times a level."""
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(streams)]
    traces = await asyncio.gather(*(generate(p, args.new_tokens) for p in prompts))
    return level_run(traces, len(traces), args.new_tokens, serverproc.resident_bytes(server.pid) / 2**20)


async def main(args: argparse.Namespace) -> None:
    budgets = [str(b) for b in args.budgets]
    model = ("--model", args.model) if args.model else ()
    servers = {b: serverproc.start(*model, "--max-running-requests", "64", "--kv-cache-tokens", "4096",
                                   "--max-batched-tokens", b) for b in budgets}
    clients = {b: AsyncClient(s.target) for b, s in servers.items()}
    runs: dict[tuple[str, int], list[LevelRun]] = {(b, n): [] for b in budgets for n in args.streams}
    try:
        for b, client in clients.items():
            await client.__aenter__()
            await burst(lmrpc_generate(client), servers[b], 4, args, random.Random(0))  # warm-up, untimed
        for r in range(args.rounds):
            for n in args.streams:
                for b in budgets if r % 2 == 0 else budgets[::-1]:
                    run = await burst(lmrpc_generate(clients[b]), servers[b], n, args, random.Random(1000 * r + n))
                    runs[(b, n)].append(run)
                    print(f"round {r + 1} budget {b} x{n}: TTFT p50 {run.ttft_p50_ms:,.0f} ms, {run.tok_s:.1f} tok/s",
                          flush=True)
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
            ttft = statistics.median(a.ttft_p50_ms / c.ttft_p50_ms for a, c in zip(mine, theirs, strict=True))
            tok = statistics.median(a.tok_s / c.tok_s for a, c in zip(mine, theirs, strict=True))
            print(f"| {n} | {b} | {statistics.median(x.ttft_p50_ms for x in mine):,.0f} | "
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
