"""The engine watchdog in the real server (App: both services, health, interceptors) over the real engine on the
tiny random-weight Llama: a step that hangs makes the services NOT_SERVING and ends the call in flight
UNAVAILABLE, then serving resumes when it returns (its pages freed); an engine thread that dies fails liveness too.
The faults are injected through Engine.step_hook, a test hook no flag reaches."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmrpc.server.app import SERVICE_NAME, App
from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.sequence import ScheduledBatch
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EngineThreadKilled(BaseException):
    """Not an Exception: a step's guard does not catch it, so the engine thread ends."""


@pytest.fixture()
async def app(tiny_llama_dir: Path) -> AsyncIterator[tuple[App, AsyncEngine, grpc.aio.Channel]]:
    engine_config = EngineConfig(
        model=ModelConfig(path=str(tiny_llama_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(num_tokens=4096), scheduler=SchedulerConfig(max_batched_tokens=256, max_prefill_chunk=256),
        sampling_defaults="openai")
    server_config = ServerConfig(host="127.0.0.1", port=0, engine_stall_timeout=2)
    running = await App.create(engine_config, server_config)
    engine = await asyncio.to_thread(AsyncEngine.start, engine_config)
    await running.attach(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield running, engine, channel
    finally:
        await running.stop(grace=None)
        engine.engine.step_hook = None
        if engine.thread_alive:
            engine.shutdown()


async def _status(channel: grpc.aio.Channel, service: str) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return int(reply.status)


def _request(max_new: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        input_ids=[generate_pb2.TokenIds(ids=[100, 200, 300])], stream=True,
        sampling_params=[generate_pb2.SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)])


async def test_a_stuck_engine_is_not_serving_and_fails_its_calls_then_recovers(
        app: tuple[App, AsyncEngine, grpc.aio.Channel], caplog: pytest.LogCaptureFixture) -> None:
    _, engine, channel = app
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    release = threading.Event()
    hung = threading.Event()

    def hang(batch: ScheduledBatch) -> None:
        hung.set()
        release.wait(60)

    call = stub.Generate(_request(500))
    assert (await call.read()).token_ids
    engine.engine.step_hook = hang
    assert await asyncio.to_thread(hung.wait, 10)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while await call.read() is not grpc.aio.EOF:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no progress" in (info.value.details() or "")
    assert await _status(channel, SERVICE_NAME) == NOT_SERVING
    assert await _status(channel, "") == SERVING  # liveness: a separate answer (fails at 3x the timeout)
    assert "health NOT_SERVING, 1 call(s) in flight ended UNAVAILABLE" in caplog.text
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in stub.Generate(_request(4)):
            pass
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    engine.engine.step_hook = None
    release.set()
    for _ in range(50):
        await asyncio.sleep(0.2)
        if await _status(channel, SERVICE_NAME) == SERVING:
            break
    assert await _status(channel, SERVICE_NAME) == SERVING
    outputs = [m async for m in stub.Generate(_request(4))]
    assert sum(len(m.token_ids) for m in outputs) == 4
    load = await stub.GetLoad(generate_pb2.GetLoadRequest())
    assert load.kv_cache_used_pages == 0 and load.running_outputs == 0  # the failed call's request was freed


async def test_a_dead_engine_thread_fails_liveness(app: tuple[App, AsyncEngine, grpc.aio.Channel],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    _, engine, channel = app
    stub = generate_pb2_grpc.GenerateServiceStub(channel)

    def kill(batch: ScheduledBatch) -> None:
        raise EngineThreadKilled("injected")

    call = stub.Generate(_request(500))
    assert (await call.read()).token_ids
    engine.engine.step_hook = kill
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while await call.read() is not grpc.aio.EOF:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine thread died" in (info.value.details() or "")
    assert await _status(channel, SERVICE_NAME) == NOT_SERVING
    assert await _status(channel, "") == NOT_SERVING
    assert "the engine thread died" in caplog.text
