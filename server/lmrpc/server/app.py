"""Builds and runs the gRPC server: GenerateService and OpenAIService over one engine, grpc.health.v1, reflection,
and the graceful drain."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lmrpc.server.config import EngineConfig, ServerConfig
from lmrpc.server.engine.engine import AsyncEngine
from lmrpc.server.frontend import Frontend
from lmrpc.server.metrics import Metrics, MetricsServer
from lmrpc.server.openai.service import OpenAIService
from lmrpc.server.service import GenerateService
from lmrpc.server.telemetry import configure_tracing
from lmrpc.server.transport import add_port, server_options
from lmrpc.v1 import generate_pb2, generate_pb2_grpc, openai_pb2, openai_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
OPENAI_SERVICE_NAME = openai_pb2.DESCRIPTOR.services_by_name["OpenAIService"].full_name
SERVICE_NAMES = ("", SERVICE_NAME, OPENAI_SERVICE_NAME)  # what health reports on ("" is the whole server)


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    tracing = configure_tracing(os.environ)  # None unless OTEL_* variables ask for traces (then no interceptor)
    server = grpc.aio.server(options=server_options(server_config.transport),
                             interceptors=tracing.interceptors if tracing is not None else ())
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in SERVICE_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, OPENAI_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    # grpc.aio takes no servicer after start, so the service is registered now and gets its engine once loaded.
    metrics = Metrics() if server_config.metrics_port is not None else None
    frontend = Frontend(None, engine_config, server_config, metrics)
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateService(frontend), server)
    openai_pb2_grpc.add_OpenAIServiceServicer_to_server(OpenAIService(frontend, server_config.chat_template), server)
    port = add_port(server, f"{server_config.host}:{server_config.port}", server_config.transport)
    await server.start()
    print(f"lmrpc-server listening on {server_config.host}:{port}", flush=True)
    metrics_server = None
    if metrics is not None and server_config.metrics_port is not None:
        metrics_server = MetricsServer.start(metrics.registry, server_config.host, server_config.metrics_port)
        print(f"lmrpc-server metrics on {server_config.host}:{metrics_server.port}", flush=True)

    # Probes answer NOT_SERVING while the model loads and warms up, off the event loop.
    engine = await asyncio.to_thread(AsyncEngine.start, engine_config)
    await asyncio.to_thread(engine.warmup)
    frontend.attach(engine)
    if metrics is not None:
        metrics.attach(engine.stats)
    for name in SERVICE_NAMES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print("lmrpc-server ready", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    logger.info("draining: NOT_SERVING, then refusing new calls after %.1fs", server_config.drain_delay)
    await health_servicer.enter_graceful_shutdown()
    await asyncio.sleep(server_config.drain_delay)
    frontend.draining = True
    await server.stop(grace=server_config.shutdown_grace)  # in-flight streams get the grace period
    engine.shutdown()
    if metrics_server is not None:
        metrics_server.stop()
    if tracing is not None:
        tracing.shutdown()  # flushes the spans still queued
