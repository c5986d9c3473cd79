"""Prometheus metrics: an output's timeline, the registry fed by the real GenerateService over a fake engine,
scrape-time engine gauges (also under vLLM's names, for the endpoint pickers that read them), the HTTP endpoint,
and the engine stamping when an output was first scheduled."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from fake_engine import CACHED, NUM_PAGES, FakeEngine, ids_request, make_service, serving
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from test_engine import collect, make_engine, request

from lmrpc.server.__main__ import parse_args
from lmrpc.server.config import ServerConfig
from lmrpc.server.engine.engine import adapter_names
from lmrpc.server.engine.types import EngineOutput, EngineStats, Finish, FinishReason, SamplingParams, Usage
from lmrpc.server.metrics import Metrics, MetricsServer, OutputTimeline


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


VLLM_GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:lora_requests_info", "vllm:cache_config_info"}


def only_sample(families: dict[str, list[Sample]], name: str) -> Sample:
    [sample] = families[name]  # one series: a router must not have to choose between label sets
    return sample


def test_vllm_gauges_carry_vllms_names_labels_and_units() -> None:
    metrics = Metrics(clock=lambda: 1_700_000_000.5)
    assert VLLM_GAUGES.isdisjoint(samples(metrics))  # no engine yet: no figures to report (not zeros)
    metrics.attach(lambda: EngineStats(3, 5, NUM_PAGES, 60, 25, 15, num_loaded_adapters=4, page_size=32,
                                       max_adapters=2, running_adapters=("sql", "summarise"),
                                       waiting_adapters=("chat",)))
    m = samples(metrics)
    assert set(m) >= VLLM_GAUGES
    assert (only_sample(m, "vllm:num_requests_running").value, only_sample(m, "vllm:num_requests_waiting").value) \
        == (3, 5)
    kv = only_sample(m, "vllm:kv_cache_usage_perc")
    assert (kv.labels, kv.value) == ({}, 0.25)  # a fraction, as vLLM reports it; cached-only pages are free
    lora = only_sample(m, "vllm:lora_requests_info")
    assert lora.labels == {"max_lora": "2", "running_lora_adapters": "sql,summarise", "waiting_lora_adapters": "chat"}
    assert lora.value == 1_700_000_000.5  # when it was updated: the picker takes the latest series
    cache = only_sample(m, "vllm:cache_config_info")
    assert (cache.labels, cache.value) == ({"block_size": "32", "num_gpu_blocks": str(NUM_PAGES)}, 1)
    # the lmrpc names still say the same
    assert (value(m, "lmrpc:num_requests_running"), value(m, "lmrpc:kv_cache_usage_ratio")) == (3, 0.25)


def test_vllm_lora_info_without_adapters_names_none() -> None:
    metrics = Metrics()
    before = time.time()
    metrics.attach(lambda: EngineStats(0, 0, NUM_PAGES, NUM_PAGES, 0, 0, page_size=16))
    lora = only_sample(samples(metrics), "vllm:lora_requests_info")
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert before <= lora.value <= time.time()  # the wall clock, as vLLM's set_to_current_time()


def test_adapter_names_are_distinct_sorted_and_skip_the_base_model() -> None:
    def seq(adapter: str | None) -> Any:
        return SimpleNamespace(request=SimpleNamespace(adapter=None if adapter is None else SimpleNamespace(
            name=adapter)))

    assert adapter_names(cast(Any, [seq("b"), seq(None), seq("a"), seq("b")])) == ("a", "b")
    assert adapter_names([]) == ()


def test_real_engine_reports_page_size_and_adapter_slots(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, kv_tokens=4096, page_size=16)
    try:
        metrics = Metrics()
        metrics.attach(engine.stats)
        m = samples(metrics)
    finally:
        engine.shutdown()
    cache = only_sample(m, "vllm:cache_config_info")
    assert cache.labels == {"block_size": "16", "num_gpu_blocks": str(4096 // 16)}
    lora = only_sample(m, "vllm:lora_requests_info")  # the tiny Llama takes adapters: --max-loras-per-batch's 8
    assert lora.labels == {"max_lora": "8", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert only_sample(m, "vllm:num_requests_running").value == only_sample(m, "vllm:kv_cache_usage_perc").value == 0


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
