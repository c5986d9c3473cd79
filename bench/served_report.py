"""bench/served.py's output: the greedy check as it happens, the final Markdown report (the table of medians,
startup, peak RSS, tokens per message, the greedy check, the read bandwidth and one-stream decode's share of it) and
what --json writes."""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from dataclasses import asdict
from typing import Any

from bandwidth import Bandwidth, best_bandwidth
from served_stats import Agreement, Models, Runs, Startup, Summary


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


def json_report(args: argparse.Namespace, summaries: list[Summary], startup: Startup, peaks_mib: dict[str, float],
                agree: list[Agreement], commands: dict[str, list[str]], sweeps: dict[str, list[Bandwidth]],
                runs: Runs, reads: list[list[Bandwidth]]) -> dict[str, Any]:
    """What --json writes: the command, the figures behind the table and every round's figures."""
    return {"command": ["bench/served.py", *args.argv], "host": args.host, "models": asdict(args.models),
            "bandwidth": {when: [asdict(b) for b in sweep] for when, sweep in sweeps.items()},
            "round_reads": [[asdict(b) for b in read] for read in reads],
            "servers": commands, "startup": asdict(startup),
            "peak_rss_mib": peaks_mib, "agreement": [asdict(a) for a in agree],
            "summaries": [asdict(m) for m in summaries],
            "rounds": {name: {str(s): [asdict(r) for r in per] for s, per in levels.items()}
                       for name, levels in runs.items()}}


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
