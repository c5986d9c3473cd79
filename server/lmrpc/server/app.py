"""Builds and runs the gRPC server: GenerateService, OpenAIService and (unless --no-sglang-worker) SMG's worker service
SglangScheduler over one engine, grpc.health.v1, reflection, authentication, the engine watchdog, and the graceful
drain."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import sglang_scheduler_pb2_grpc as sgl_grpc

from lmrpc.server.auth import AuthInterceptor
from lmrpc.server.config import EngineConfig, ServerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.frontend import Frontend
from lmrpc.server.generate.service import GenerateService
from lmrpc.server.heap import keep_numpy_off_huge_pages
from lmrpc.server.metrics import Metrics, MetricsServer
from lmrpc.server.models.loader import cache_root
from lmrpc.server.openai.service import OpenAIService
from lmrpc.server.sglang.service import SERVICE_NAME as SGLANG_SERVICE_NAME
from lmrpc.server.sglang.service import SglangWorkerService
from lmrpc.server.telemetry import Tracing, configure_tracing
from lmrpc.server.transport import add_port, server_options
from lmrpc.server.watchdog import Watchdog
from lmrpc.server.wire import LMRPC_SERVICE_PREFIX, WireInterceptor
from lmrpc.v1 import generate_pb2, generate_pb2_grpc, openai_pb2, openai_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
OPENAI_SERVICE_NAME = openai_pb2.DESCRIPTOR.services_by_name["OpenAIService"].full_name
SERVICES = (SERVICE_NAME, OPENAI_SERVICE_NAME)  # readiness: what health reports on per service (lmrpc's own)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class App:
    """One server: its gRPC server (started), health, the shared frontend; the engine once attached."""

    server: grpc.aio.Server  # listening from create() on
    port: int  # the bound port (the chosen one for port 0)
    health: health.aio.HealthServicer  # NOT_SERVING until attach()
    frontend: Frontend  # the engine's front, shared by both services
    metrics: Metrics | None  # None unless --metrics-port
    tracing: Tracing | None  # None unless OTEL_* ask for traces
    services: tuple[str, ...] = SERVICES  # what health reports on per service: lmrpc's, and SMG's worker service
    watchdog: Watchdog | None = None  # set by attach()
    _watch_task: asyncio.Task[None] | None = None  # runs the watchdog

    @classmethod
    async def create(cls, engine_config: EngineConfig, server_config: ServerConfig) -> App:
        """Build and start the server (health NOT_SERVING, calls UNAVAILABLE until attach)."""
        tracing = configure_tracing(os.environ)  # None unless OTEL_* variables ask for traces (then no interceptor)
        metrics = Metrics() if server_config.metrics_port is not None else None
        frontend = Frontend(None, engine_config, server_config, metrics)
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if server_config.api_keys is not None:
            interceptors.append(AuthInterceptor(server_config.api_keys))  # first: nothing runs for a stranger
        interceptors.append(WireInterceptor(report=frontend.report_load,
                                            stall_timeout=server_config.stalled_stream_timeout,
                                            services=(LMRPC_SERVICE_PREFIX, SGLANG_SERVICE_NAME + "/")))
        if tracing is not None:
            interceptors.extend(tracing.interceptors)
        server = grpc.aio.server(options=server_options(server_config.transport), interceptors=interceptors)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        services = (*SERVICES, SGLANG_SERVICE_NAME) if server_config.sglang_worker else SERVICES
        for name in ("", *services):  # "": the whole server (liveness)
            await health_servicer.set(name, NOT_SERVING)
        reflection.enable_server_reflection((*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        # grpc.aio takes no servicer after start, so the services are registered now and get their engine once loaded.
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateService(frontend), server)
        openai_service = OpenAIService(frontend, server_config.chat_template)
        openai_pb2_grpc.add_OpenAIServiceServicer_to_server(openai_service, server)
        if server_config.sglang_worker:
            # SMG's worker contract beside lmrpc.v1: the gateway loads the tokenizer directory written under the cache
            sglang = SglangWorkerService(frontend, cache_root(engine_config.model), server_config.chat_template)
            sgl_grpc.add_SglangSchedulerServicer_to_server(sglang, server)
        port = add_port(server, f"{server_config.host}:{server_config.port}", server_config.transport)
        await server.start()
        return cls(server, port, health_servicer, frontend, metrics, tracing, services)

    async def attach(self, engine: AsyncEngine) -> None:
        """Serve `engine`: health SERVING, and the watchdog on it."""
        self.frontend.attach(engine)
        if self.metrics is not None:
            self.metrics.attach(engine.stats)
        for name in ("", *self.services):
            await self.health.set(name, SERVING)
        self.watchdog = Watchdog(engine, self._set_health, self.frontend.server_config.engine_stall_timeout)
        self._watch_task = asyncio.create_task(self.watchdog.run(), name="lmrpc-watchdog")

    async def _set_health(self, services: bool, liveness: bool) -> None:
        for name in self.services:
            await self.health.set(name, SERVING if services else NOT_SERVING)
        await self.health.set("", SERVING if liveness else NOT_SERVING)

    async def stop(self, grace: float | None) -> None:
        """Stop the watchdog and the server (in-flight calls get `grace` seconds); the engine is the caller's."""
        if self._watch_task is not None:
            self._watch_task.cancel()
        await self.server.stop(grace=grace)
        if self.tracing is not None:
            self.tracing.shutdown()  # flushes the spans still queued


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    app = await App.create(engine_config, server_config)
    print(f"lmrpc-server listening on {server_config.host}:{app.port}", flush=True)
    metrics_server = None
    try:
        if app.metrics is not None and server_config.metrics_port is not None:
            metrics_server = MetricsServer.start(app.metrics.registry, server_config.host, server_config.metrics_port)
            print(f"lmrpc-server metrics on {server_config.host}:{metrics_server.port}", flush=True)
        # Probes answer NOT_SERVING while the model loads and warms up, off the event loop.
        keep_numpy_off_huge_pages()  # before loading: heap.py says why
        engine = await asyncio.to_thread(AsyncEngine.start, engine_config)
        await asyncio.to_thread(engine.warmup)
    except BaseException:
        await app.stop(grace=None)
        if metrics_server is not None:
            metrics_server.stop()
        raise
    await app.attach(engine)
    print("lmrpc-server ready", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    logger.info("draining: NOT_SERVING, then refusing new calls after %.1fs", server_config.drain_delay)
    await app.health.enter_graceful_shutdown()
    await asyncio.sleep(server_config.drain_delay)
    app.frontend.draining = True
    await app.stop(grace=server_config.shutdown_grace)  # in-flight streams get the grace period
    engine.shutdown()
    if metrics_server is not None:
        metrics_server.stop()
