"""The real GenerateService (and OpenAIService) over a real engine on an in-process grpc.aio server (no subprocess):
for tests of request fields end to end through validation, the services and the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import grpc

from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.frontend import Frontend
from lmrpc.server.generate.service import GenerateService
from lmrpc.server.openai.service import OpenAIService
from lmrpc.v1 import generate_pb2_grpc, openai_pb2_grpc

Stubs = tuple[generate_pb2_grpc.GenerateServiceStub, openai_pb2_grpc.OpenAIServiceStub]


def engine_config(path: str | None, dtype: str, *, quantization: str = "auto", kv_tokens: int = 8192,
                  max_batched: int = 256) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=path, dtype=dtype, device="cpu", quantization=quantization),
        cache=CacheConfig(page_size=16, num_tokens=kv_tokens),
        scheduler=SchedulerConfig(max_running_requests=16, max_batched_tokens=max_batched,
                                  max_prefill_chunk=max_batched),
        sampling_defaults="openai",
    )


def running_engine(path: str | None, dtype: str) -> Iterator[tuple[AsyncEngine, EngineConfig]]:
    """An engine on engine_config(path, dtype) and its config, shut down after (a module fixture's body)."""
    config = engine_config(path, dtype)
    engine = AsyncEngine.start(config)
    yield engine, config
    engine.shutdown()


@asynccontextmanager
async def served(engine: AsyncEngine, config: EngineConfig) -> AsyncIterator[generate_pb2_grpc.GenerateServiceStub]:
    async with served_both(engine, config) as (stub, _):
        yield stub


@asynccontextmanager
async def served_both(engine: AsyncEngine, config: EngineConfig) -> AsyncIterator[Stubs]:
    """Both services over one frontend, as the server runs them."""
    frontend = Frontend(engine, config, ServerConfig(host="127.0.0.1", port=0))
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateService(frontend), server)
    openai_pb2_grpc.add_OpenAIServiceServicer_to_server(OpenAIService(frontend), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield generate_pb2_grpc.GenerateServiceStub(channel), openai_pb2_grpc.OpenAIServiceStub(channel)
    finally:
        await server.stop(grace=None)
