"""Admission control, the custom-processor switch and the graceful drain, on a server of their own: small
running/queue limits, custom logit processors off. The drain test stops this server, so it runs last."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from lmrpc.client import Client, FinishReason, GenerateResult
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

if TYPE_CHECKING:
    from tests.e2e.conftest import RunningServer

pytestmark = pytest.mark.e2e

MAX_RUNNING, MAX_QUEUED = 2, 4


@pytest.fixture(scope="module")
def small_server(launch_server: Callable[..., RunningServer]) -> Iterator[RunningServer]:
    running = launch_server("--max-running-requests", str(MAX_RUNNING), "--max-queued-requests", str(MAX_QUEUED),
                           "--sampling-defaults", "openai", "--drain-delay", "2", "--shutdown-grace", "60",
                           # float32: every row's arithmetic is then the same whatever shares its step, so admitted
                           # outputs can be compared exactly with solo runs (bf16 on CPU rounds by route).
                           "--dtype", "float32")
    yield running
    if running.process.poll() is None:
        running.process.kill()
        running.process.wait()


def test_custom_logit_processor_needs_the_server_flag(small_server: RunningServer) -> None:
    params = generate_pb2.SamplingParams(max_new_tokens=4)
    params.custom_params.update({"token_ids": [5]})
    with grpc.insecure_channel(small_server.target) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generate_pb2.GenerateRequest(
                text=["Hi"], sampling_params=[params], custom_logit_processor="disallowed_tokens")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "custom_logit_processor" in (err.value.details() or "")
    assert "--enable-custom-logit-processor" in (err.value.details() or "")


def test_queue_overflow_is_resource_exhausted_with_retry_info(small_server: RunningServer) -> None:
    prompts = [f"Count from {i}:" for i in range(20)]
    params = generate_pb2.SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    outcomes: dict[int, generate_pb2.GenerateResponse | grpc.RpcError] = {}
    start = threading.Barrier(len(prompts))

    def call(i: int) -> None:
        with grpc.insecure_channel(small_server.target) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            start.wait()
            try:
                [outcomes[i]] = list(stub.Generate(
                    generate_pb2.GenerateRequest(text=[prompts[i]], sampling_params=[params]), timeout=300))
            except grpc.RpcError as exc:
                outcomes[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    rejected = {i: o for i, o in outcomes.items() if isinstance(o, grpc.RpcError)}
    admitted = {i: o for i, o in outcomes.items() if not isinstance(o, grpc.RpcError)}
    assert len(outcomes) == 20
    assert len(admitted) >= MAX_RUNNING + MAX_QUEUED and len(rejected) >= 20 - 2 * (MAX_RUNNING + MAX_QUEUED)
    for exc in rejected.values():
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]
        assert status is not None
        retry = error_details_pb2.RetryInfo()
        assert any(d.Unpack(retry) for d in status.details) and retry.retry_delay.ToNanoseconds() > 0
    with Client(small_server.target) as client:  # every admitted output equals its solo greedy run
        for i, out in admitted.items():
            [solo] = client.generate(prompts[i], sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                                  "ignore_eos": True})
            assert list(out.token_ids) == solo.token_ids and out.text == solo.text


def test_sigterm_drains_running_streams_then_exits_zero(small_server: RunningServer) -> None:
    results: dict[int, GenerateResult] = {}
    first_delta = [threading.Event() for _ in range(4)]

    def stream(i: int) -> None:
        with Client(small_server.target) as client:
            result = GenerateResult(index=0, rid="")
            for delta in client.generate(f"Story number {i}:", stream=True,
                                         sampling_params={"max_new_tokens": 40, "ignore_eos": True,
                                                          "temperature": 0}):
                first_delta[i].set()
                result.add(delta)
            results[i] = result

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for event in first_delta[:MAX_RUNNING]:  # the others are queued behind the running limit
        assert event.wait(timeout=120)
    small_server.process.send_signal(signal.SIGTERM)
    statuses = set()
    with grpc.insecure_channel(small_server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and health_pb2.HealthCheckResponse.NOT_SERVING not in statuses:
            try:
                statuses.add(health.Check(health_pb2.HealthCheckRequest(), timeout=2).status)
            except grpc.RpcError:
                break
            time.sleep(0.05)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == [0, 1, 2, 3]
    for r in results.values():
        assert r.finish.reason == FinishReason.LENGTH and len(r.token_ids) == 40
    assert small_server.process.wait(timeout=90) == 0
