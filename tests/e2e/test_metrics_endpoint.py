"""Observability over a real server with the real model: /metrics on --metrics-port 0 agrees with what the calls
returned (tokens, finish reasons, one histogram observation per output), the load gauges fall back to 0 when idle,
and --log-format json writes one request line per finished output."""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from lmrpc.client import Client, GenerateResult

if TYPE_CHECKING:
    from tests.e2e.conftest import RunningServer

pytestmark = pytest.mark.e2e

HISTOGRAMS = ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue_time")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "prefix_cache_hit_ratio")
COUNTERS = ("prompt_tokens", "generation_tokens", "requests")


@pytest.fixture(scope="module")
def observed_server(launch_server: Callable[..., RunningServer]) -> Iterator[RunningServer]:
    running = launch_server("--metrics-port", "0", "--log-format", "json", "--sampling-defaults", "openai")
    yield running
    assert running.stop() == 0  # the metrics endpoint and tracing stop cleanly too


def scrape(server: RunningServer) -> dict[str, list[Sample]]:
    assert server.metrics_target is not None, "the server printed no metrics endpoint"
    with urllib.request.urlopen(f"http://{server.metrics_target}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict[str, list[Sample]], name: str, **labels: str) -> float:
    matches = [s.value for f in families.values() for s in f if s.name == name and s.labels == labels]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def run_requests(client: Client) -> list[GenerateResult]:
    greedy = {"temperature": 0}
    results = client.generate("The capital of France is", sampling_params={**greedy, "max_new_tokens": 12})
    # Two prompts sharing a long head: the second reuses the first's pages through the prefix cache.
    head = "You are a helpful assistant. Answer in one short sentence. Question: "
    results += client.generate([head + "what is 2 + 2?", head + "what colour is the sky?"],
                               sampling_params={**greedy, "max_new_tokens": 10, "stop": ["."]})
    deltas = list(client.generate(head + "name a fruit.", sampling_params={**greedy, "max_new_tokens": 6},
                                  stream=True))
    [last] = [d for d in deltas if d.finish is not None]
    assert last.usage is not None
    results.append(GenerateResult(index=0, rid=last.rid, token_ids=[t for d in deltas for t in d.token_ids],
                                  finish=last.finish, usage=last.usage))
    results += client.generate("Hi", sampling_params={"max_new_tokens": 4, "n": 2, "sampling_seed": 3})
    return results


def test_metrics_match_what_the_calls_returned(observed_server: RunningServer) -> None:
    before = scrape(observed_server)
    for name in GAUGES:
        assert f"lmrpc:{name}" in before  # the engine is attached once the server is ready
    with Client(observed_server.target) as client:
        results = run_requests(client)
    usages = [r.usage for r in results]
    assert all(u is not None for u in usages) and len(results) == 6
    prompt = sum(u.prompt_tokens for u in usages if u)
    completion = sum(u.completion_tokens for u in usages if u)
    cached = sum(u.cached_tokens for u in usages if u)
    assert cached > 0  # the shared head was reused

    deadline = time.monotonic() + 10
    while True:  # the calls have returned; the engine has already released their pages
        m = scrape(observed_server)
        idle = all(value(m, f"lmrpc:{g}") == 0 for g in GAUGES[:3])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert value(m, "lmrpc:num_requests_running") == 0
    assert value(m, "lmrpc:num_requests_waiting") == 0
    assert value(m, "lmrpc:kv_cache_usage_ratio") == 0  # cached-only prefix pages don't count as used
    for name in COUNTERS:
        assert f"lmrpc:{name}" in m
    assert value(m, "lmrpc:prompt_tokens_total") == prompt
    assert value(m, "lmrpc:generation_tokens_total") == completion
    assert value(m, "lmrpc:prefix_cache_hit_ratio") == pytest.approx(cached / prompt)
    reasons = Counter(r.finish.reason.name.lower() for r in results)
    for reason, count in reasons.items():
        assert value(m, "lmrpc:requests_total", finish_reason=reason) == count
    assert sum(s.value for s in m["lmrpc:requests"] if s.name == "lmrpc:requests_total") == len(results)

    for name in HISTOGRAMS:
        family = f"lmrpc:{name}_seconds"
        buckets = [s for s in m[family] if s.name == f"{family}_bucket"]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf"
        assert value(m, f"{family}_count") == counts[-1]
        assert value(m, f"{family}_sum") >= 0
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert value(m, f"lmrpc:{name}_seconds_count") == len(results)
    assert value(m, "lmrpc:inter_token_latency_seconds_count") == completion - len(results)
    ttft, e2e = value(m, "lmrpc:time_to_first_token_seconds_sum"), value(m, "lmrpc:e2e_request_latency_seconds_sum")
    queue = value(m, "lmrpc:request_queue_time_seconds_sum")
    assert 0 <= queue <= ttft <= e2e < 600

    # --log-format json: one request line per finished output, with the figures the calls returned.
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in list(observed_server.output) if line.startswith("{")]
        logged = [e for e in lines if e.get("logger") == "lmrpc.server.requests"]
        if len(logged) >= len(results) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(logged) == len(results)
    assert all(e["grpc_status"] == "OK" and e["e2e"] >= e["ttft"] >= e["queue_time"] >= 0 for e in logged)
    assert sum(e["completion_tokens"] for e in logged) == completion
    assert Counter(e["finish_reason"] for e in logged) == reasons
