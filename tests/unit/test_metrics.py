"""Prometheus metrics: an output's timeline, the registry fed by the real GenerateService over a fake engine,
scrape-time engine gauges, the HTTP endpoint, and the engine stamping when an output was first scheduled."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
from fake_engine import CACHED, NUM_PAGES, FakeEngine, ids_request, make_service, serving
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from test_engine import collect, make_engine, request

from lmrpc.server.__main__ import parse_args
from lmrpc.server.config import ServerConfig
from lmrpc.server.metrics import Metrics, MetricsServer, OutputTimeline
from lmrpc.server.protocol import EngineOutput, EngineStats, Finish, FinishReason, SamplingParams, Usage


def samples(metrics: Metrics) -> dict[str, list[Sample]]:
    """Family name -> samples, as a scrape would parse them."""
    text = generate_latest(metrics.registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict[str, list[Sample]], sample_name: str, **labels: str) -> float:
    for family in families.values():
        for s in family:
            if s.name == sample_name and s.labels == labels:
                return s.value
    raise KeyError(sample_name, labels)


def test_timeline_splits_the_gaps_between_tokens() -> None:
    t = OutputTimeline("r", "r", arrival=10.0)
    first = t.update(EngineOutput("r", scheduled_at=10.5, token_ids=(1, 2)), now=11.0)
    assert (first.queue_time, first.ttft, first.inter_token) == (0.5, 1.0, (0.0,))  # 2nd token came with the 1st
    assert t.update(EngineOutput("r", text="held back", scheduled_at=10.5), now=11.5).inter_token == ()
    later = t.update(EngineOutput("r", token_ids=(3, 4), scheduled_at=10.5), now=12.0)
    assert later.queue_time is None and later.ttft is None and later.inter_token == (0.5, 0.5)
    t.update(EngineOutput("r", finish=Finish(FinishReason.STOP_STRING), usage=Usage(5, 4, 2)), now=12.5)
    assert (t.queue_time, t.ttft, t.e2e, t.finish_reason) == (0.5, 1.0, 2.5, "stop_string")


async def test_service_feeds_every_metric() -> None:
    metrics = Metrics()
    engine = FakeEngine()
    metrics.attach(engine.stats)
    async with serving(make_service(engine, metrics)) as stub:
        [r async for r in stub.Generate(ids_request([5, 6, 7], [8, 9], stream=True))]
        [r async for r in stub.Generate(ids_request([1, 2, 3, 4]))]
    m = samples(metrics)
    prompts = [3, 2, 4]
    assert value(m, "lmrpc:requests_total", finish_reason="eos") == 3
    assert value(m, "lmrpc:prompt_tokens_total") == sum(prompts)
    assert value(m, "lmrpc:generation_tokens_total") == sum(prompts)  # the fake makes as many as the prompt
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert value(m, f"lmrpc:{name}_seconds_count") == 3
    assert value(m, "lmrpc:inter_token_latency_seconds_count") == sum(n - 1 for n in prompts)
    assert value(m, "lmrpc:prefix_cache_hit_ratio") == 3 * CACHED / sum(prompts)
    assert value(m, "lmrpc:num_requests_running") == value(m, "lmrpc:num_requests_waiting") == 0
    assert value(m, "lmrpc:kv_cache_usage_ratio") == 0


def test_engine_gauges_are_read_at_scrape_and_absent_before_the_engine() -> None:
    metrics = Metrics()
    assert set(samples(metrics)) >= {"lmrpc:prefix_cache_hit_ratio", "lmrpc:requests", "lmrpc:prompt_tokens"}
    assert "lmrpc:num_requests_running" not in samples(metrics)
    load = [EngineStats(3, 5, NUM_PAGES, 60, 25, 15)]
    metrics.attach(lambda: load[0])
    m = samples(metrics)
    assert (value(m, "lmrpc:num_requests_running"), value(m, "lmrpc:num_requests_waiting")) == (3, 5)
    assert value(m, "lmrpc:kv_cache_usage_ratio") == 0.25  # cached-only pages don't count
    load[0] = EngineStats(0, 0, NUM_PAGES, NUM_PAGES, 0, 40)
    assert value(samples(metrics), "lmrpc:kv_cache_usage_ratio") == 0


def test_http_endpoint_serves_the_registry() -> None:
    metrics = Metrics()
    server = MetricsServer.start(metrics.registry, "127.0.0.1", 0)
    try:
        assert server.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.stop()
    assert "lmrpc:prefix_cache_hit_ratio" in {f.name for f in text_string_to_metric_families(text)}


async def test_engine_stamps_when_an_output_was_first_scheduled(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    try:
        before = time.monotonic()
        params = SamplingParams(max_new_tokens=3, temperature=0.0)
        outputs = await collect(engine, [request([100, 200, 300], params, rid="a"),
                                         request([400, 500], SamplingParams(max_new_tokens=0), rid="skip")])
    finally:
        engine.shutdown()
    stamps = {o.scheduled_at for o in outputs["a"]}
    assert len(stamps) == 1  # the first schedule, on every output
    [stamp] = stamps
    assert stamp is not None and before <= stamp <= time.monotonic()
    assert [o.scheduled_at for o in outputs["skip"]] == [None]  # never reached the model


def test_metrics_port_flag_and_config() -> None:
    assert parse_args([]).metrics_port is None  # off unless asked
    args = parse_args(["--metrics-port", "0", "--log-format", "json"])
    assert (args.metrics_port, args.log_format) == (0, "json")
    assert ServerConfig(metrics_port=0).metrics_port == 0
    with pytest.raises(ValueError, match="metrics_port"):
        ServerConfig(metrics_port=70000)
