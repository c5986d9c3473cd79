"""Cancellation and deadlines free the model at once (issue 4): read through the server's /metrics, whose gauges
come straight from the engine's page pool and queues."""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import TYPE_CHECKING

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmrpc.client import Client, FinishReason
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

if TYPE_CHECKING:
    from tests.e2e.conftest import RunningServer

pytestmark = pytest.mark.e2e


def gauges(server: RunningServer) -> dict[str, float]:
    assert server.metrics_target is not None
    with urllib.request.urlopen(f"http://{server.metrics_target}/metrics", timeout=10) as response:
        text = response.read().decode()
    names = ("lmrpc:num_requests_running", "lmrpc:num_requests_waiting", "lmrpc:kv_cache_usage_ratio")
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in names}


def wait_idle(server: RunningServer, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(server)
        if all(v == 0 for v in g.values()) or time.monotonic() > deadline:
            return g
        time.sleep(0.1)


def test_cancelling_24_streams_returns_the_pool_to_idle(server: RunningServer) -> None:
    channel = grpc.insecure_channel(server.target)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    params = generate_pb2.SamplingParams(max_new_tokens=2000, ignore_eos=True, temperature=0.8)
    calls = [stub.Generate(generate_pb2.GenerateRequest(text=[f"Tell story number {i}."], sampling_params=[params],
                                                        stream=True)) for i in range(24)]
    try:
        first = [next(iter(c)) for c in calls[:2]]  # the engine is busy with them
        assert all(m.token_ids for m in first)
        # The calls reach the server on their own schedule: wait until every one of them runs or waits.
        deadline = time.monotonic() + 30
        while True:
            busy = gauges(server)
            if busy["lmrpc:num_requests_running"] + busy["lmrpc:num_requests_waiting"] >= 24:
                break
            assert time.monotonic() < deadline, busy
            time.sleep(0.05)
        assert busy["lmrpc:kv_cache_usage_ratio"] > 0
    finally:  # cancelled whatever happened, so that a failure here leaves nothing running for the next test
        for c in calls:
            c.cancel()
    cancelled = time.monotonic()
    idle = wait_idle(server, timeout=10)
    assert all(v == 0 for v in idle.values()), idle
    assert time.monotonic() - cancelled < 10
    for c in calls:
        assert c.code() == grpc.StatusCode.CANCELLED
    channel.close()
    with Client(server.target) as client:  # the next request is answered at once
        start = time.monotonic()
        [r] = client.generate("Hello", sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert r.finish.reason == FinishReason.LENGTH and time.monotonic() - start < 10


def test_deadline_of_one_second_on_a_4000_token_request(server: RunningServer) -> None:
    with Client(server.target) as client:
        prompt = client.tokenize(" ".join(f"item {i}," for i in range(1000)))[:3000]
        # What one full prefill step (512 tokens) takes on this host: "within a step or two" is measured in them (a
        # host without AVX512 runs the kernels' portable loops, several times slower)
        start = time.monotonic()
        client.generate(input_ids=prompt[1000:1512], sampling_params={"max_new_tokens": 1})  # (no prefix of it)
        step = time.monotonic() - start
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err, grpc.insecure_channel(server.target) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            request = generate_pb2.GenerateRequest(sampling_params=[generate_pb2.SamplingParams(
                max_new_tokens=1000, ignore_eos=True)], stream=True)
            request.input_ids.add().ids.extend(prompt)
            for _ in stub.Generate(request, timeout=1.0):
                pass
        elapsed = time.monotonic() - start
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < 2.0
    idle = wait_idle(server, timeout=max(10, 3 * step))  # the engine dropped it (pages freed) within a step or two
    assert all(v == 0 for v in idle.values()), idle


def test_abort_all_ends_streams_with_abort(server: RunningServer) -> None:
    results: list[FinishReason] = []

    def run() -> None:
        with Client(server.target) as c:
            results.extend(r.finish.reason for r in c.generate(["a", "b"], rid=["all-1", "all-2"],
                                                                sampling_params={"max_new_tokens": 2000,
                                                                                 "ignore_eos": True}))

    thread = threading.Thread(target=run)
    thread.start()
    with Client(server.target) as other:
        deadline = time.monotonic() + 60
        while not {"all-1", "all-2"} <= set(other.abort(abort_all=True)) and time.monotonic() < deadline:
            time.sleep(0.05)
    thread.join(timeout=60)
    assert results == [FinishReason.ABORT, FinishReason.ABORT]
