"""The served benchmark's results (bench/served.py): one request's trace, one system's figures at one level, the
medians over rounds, startup times, the files served and the greedy check; and the statistics that turn traces into
figures (also used by bench/budgets.py)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


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
class Models:
    lmrpc: str  # the GGUF lmrpc serves (--model)
    llama: str  # the GGUF llama-server serves (-m)
    lmrpc_bytes_per_token: int  # weight bytes one decode step reads, as the file stores them
    llama_bytes_per_token: int  # the same for llama.cpp's file


@dataclass(frozen=True)
class Agreement:
    prompt: str  # what the prompt was
    lmrpc: tuple[int, ...]  # lmrpc's first greedy tokens (served.py's AGREE_TOKENS)
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
