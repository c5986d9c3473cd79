"""What every servicer of the engine shares: the engine once loaded, the drain flag, admission control (outputs in
flight against the server's limit), request ids, and the observation of a call (metrics, span, request log)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import TypeVar

import grpc

from lmrpc.server import validation
from lmrpc.server.config import EngineConfig, ServerConfig
from lmrpc.server.engine.engine import AsyncEngine
from lmrpc.server.metrics import Metrics
from lmrpc.server.protocol import EngineRequest
from lmrpc.server.telemetry import CallObserver

T = TypeVar("T")


class Frontend:
    """The engine's gRPC front, shared by GenerateService and OpenAIService (one process, one engine)."""

    def __init__(
        self, engine: AsyncEngine | None, engine_config: EngineConfig, server_config: ServerConfig,
        metrics: Metrics | None = None,
    ) -> None:
        self._engine = engine  # None while the model loads: calls get UNAVAILABLE
        self.metrics = metrics  # None: --metrics-port unset, nothing observed
        self.engine_config = engine_config
        self.server_config = server_config
        self.draining = False  # set on SIGTERM after the drain delay: new calls get UNAVAILABLE
        # Outputs admitted and not yet finished, over every servicer. Counted here, not read from the engine's
        # queues: requests posted to the engine thread are not in its scheduler yet, so a burst would all pass an
        # engine-side check.
        self._outputs_in_flight = 0

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

    @property
    def engine(self) -> AsyncEngine:
        assert self._engine is not None, "checked by check_loaded"
        return self._engine

    async def check_loaded(self, context: grpc.aio.ServicerContext) -> None:
        if self._engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    async def check_open(self, context: grpc.aio.ServicerContext) -> None:
        """Generating calls: the model must be loaded and the server not draining."""
        await self.check_loaded(context)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")

    @staticmethod
    def metadata_rid(context: grpc.aio.ServicerContext) -> str | None:
        """The call's x-request-id metadata, if any."""
        value = dict(context.invocation_metadata() or ()).get("x-request-id")
        return str(value) if value else None

    def new_rid(self, given: str | None) -> str:
        """`given`, or a fresh id; a given id still running is a user error."""
        if given and self.engine.is_live(given):
            raise validation.invalid("rid", f"request id {given!r} is already running")
        return given or uuid.uuid4().hex

    @asynccontextmanager
    async def admitted(self, context: grpc.aio.ServicerContext, requests: list[EngineRequest]) -> AsyncIterator[None]:
        """Count `requests` in flight for the block; over the limit, end the call RESOURCE_EXHAUSTED."""
        limit = self.engine_config.scheduler.max_running_requests + self.server_config.max_queued_requests
        if self._outputs_in_flight + len(requests) > limit:
            await context.abort_with_status(validation.resource_exhausted_status(limit))
        self._outputs_in_flight += len(requests)
        try:
            yield
        finally:
            self._outputs_in_flight -= len(requests)

    @staticmethod
    async def observed(
        context: grpc.aio.ServicerContext, call: CallObserver, messages: AsyncGenerator[T, None]
    ) -> AsyncIterator[T]:
        """`messages`, with the call's final status reported to `call` however the call ends."""
        # Metrics, the call's span and the request log see every way a call ends, so the status is decided here.
        status = grpc.StatusCode.UNKNOWN  # an unexpected exception: grpc answers UNKNOWN
        try:
            async with aclosing(messages):  # closed here even when the caller stops early: its cleanup runs now
                async for msg in messages:
                    yield msg
            status = grpc.StatusCode.OK
        except (asyncio.CancelledError, GeneratorExit):
            remaining = context.time_remaining()
            passed = remaining is not None and remaining <= 0
            status = grpc.StatusCode.DEADLINE_EXCEEDED if passed else grpc.StatusCode.CANCELLED
            raise
        finally:
            call.end(context.code() or status)  # code() is set by abort / abort_with_status
