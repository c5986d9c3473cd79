"""A scripted stand-in for AsyncEngine, and the real GenerateService over it on an in-process grpc.aio server.

No model: every output of a prompt with ids p gets the tokens 10, 11, ... (len(p) of them, one delta each) and
finishes EOS; a prompt starting with HANG streams one token, then waits until the call is cancelled. Usage
reports CACHED cached prompt tokens. Tests see the servicer's whole path (validation, admission, streaming or
merging, telemetry) without torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import grpc

from lmrpc.server.config import EngineConfig, LoraConfig, SchedulerConfig, ServerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineOutput, EngineRequest, EngineStats, Finish, FinishReason, Usage
from lmrpc.server.frontend import Frontend
from lmrpc.server.generate.service import GenerateService
from lmrpc.server.load import LoadTracker
from lmrpc.server.lora.registry import LoraRegistry
from lmrpc.server.metrics import Metrics
from lmrpc.server.models.types import ModelInfo
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

HANG = 7  # first prompt token that makes an output hang after its first token
CACHED = 1  # cached_tokens reported by every finished output
NUM_PAGES = 100

INFO = ModelInfo(
    path="/models/fake", served_model_name="fake", architecture="LlamaForCausalLM", vocab_size=1000,
    max_context_length=2048, eos_token_ids=(2,), generation_defaults={}, dtype="float32", device="cpu",
)


@dataclass
class FakeEngine:
    """What GenerateService calls on AsyncEngine (protocol.EngineClient plus model_info and is_live)."""

    model_info: ModelInfo = INFO
    live: dict[str, EngineRequest] = field(default_factory=dict)  # request_id -> request, while generating
    on_generate: list[Callable[[], None]] = field(default_factory=list)  # run inside each generate (span probes)
    failure: str | None = None  # AsyncEngine.failure: set, calls are refused UNAVAILABLE
    media_processor: Any = None  # AsyncEngine.media_processor: a text-only model
    load_tracker: LoadTracker = field(default_factory=LoadTracker)  # what GetLoad and ORCA reports read
    # no adapters can load (no model): lora_path is NOT_FOUND, GetModelInfo lists none
    lora: LoraRegistry = field(default_factory=lambda: LoraRegistry(LoraConfig(), None))

    max_running: int = 1_000  # live requests beyond the first max_running count as queued, not running

    @property
    def running_by_client(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in list(self.live.values())[:self.max_running]:
            counts[r.client] = counts.get(r.client, 0) + 1
        return counts

    async def generate(self, requests: list[EngineRequest]) -> AsyncIterator[EngineOutput]:
        for probe in self.on_generate:
            probe()
        for r in requests:
            self.live[r.request_id] = r
        try:
            scheduled = time.monotonic()
            await asyncio.sleep(0)
            # Round-robin, one token per output per "step", like the engine's deltas.
            steps = max(len(r.prompt_ids) for r in requests)
            for step in range(steps):
                for r in requests:
                    n = len(r.prompt_ids)
                    if step >= n:
                        continue
                    last = step == n - 1 and r.prompt_ids[0] != HANG
                    yield EngineOutput(
                        r.request_id, token_ids=(10 + step,), text=f"t{step}", scheduled_at=scheduled,
                        finish=Finish(FinishReason.EOS, matched_token_id=2) if last else None,
                        usage=Usage(n, n, CACHED) if last else None,
                    )
                    if r.prompt_ids[0] == HANG:
                        await asyncio.Event().wait()  # until the call is cancelled
                await asyncio.sleep(0.001)
        finally:
            for r in requests:
                self.live.pop(r.request_id, None)

    def abort(self, rids: list[str] | None) -> list[str]:
        return []

    def is_live(self, rid: str) -> bool:
        return any(r.rid == rid for r in self.live.values())

    def stats(self) -> EngineStats:
        used = len(self.live)
        return EngineStats(num_running=used, num_waiting=0, num_pages=NUM_PAGES, num_free_pages=NUM_PAGES - used,
                           num_used_pages=used, num_cached_pages=0)


def make_service(engine: FakeEngine, metrics: Metrics | None = None, max_queued: int = 256) -> GenerateService:
    engine_config = EngineConfig(scheduler=SchedulerConfig(max_running_requests=8), sampling_defaults="openai")
    server_config = ServerConfig(host="127.0.0.1", port=0, max_queued_requests=max_queued)
    return GenerateService(Frontend(cast(AsyncEngine, engine), engine_config, server_config, metrics=metrics))


@asynccontextmanager
async def serving(
    service: GenerateService, interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
) -> AsyncIterator[generate_pb2_grpc.GenerateServiceStub]:
    """Serve `service` on a loopback port; yield a stub on a channel to it."""
    server = grpc.aio.server(interceptors=interceptors)
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield generate_pb2_grpc.GenerateServiceStub(channel)
    finally:
        await server.stop(grace=None)


def ids_request(*prompts: list[int], stream: bool = False, rid: list[str] | None = None
                ) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        input_ids=[generate_pb2.TokenIds(ids=p) for p in prompts], stream=stream, rid=rid or [],
        sampling_params=[generate_pb2.SamplingParams(max_new_tokens=16)],
    )
