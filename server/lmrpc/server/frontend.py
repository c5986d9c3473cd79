"""What every servicer of the engine shares: the engine once loaded, the drain flag, admission control (outputs in
flight against the server's limit, and per client), request ids, the replica's load, the observation of a call
(metrics, span, request log; an engine that cannot serve ends it UNAVAILABLE), the check of a structured-output
constraint, and a call's media handed to media/prepare.py with its failures mapped to statuses."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import TypeVar

import grpc

from lmrpc.server import auth, load, memory, statuses, validation
from lmrpc.server.config import EngineConfig, ServerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.engine import EngineUnavailable
from lmrpc.server.engine.grammar_limits import GrammarError
from lmrpc.server.engine.types import EngineRequest, SamplingParams
from lmrpc.server.lora.registry import LoadedAdapter
from lmrpc.server.media import ingest, prepare
from lmrpc.server.media.types import MediaError, MultimodalProcessor, MultimodalPrompt
from lmrpc.server.metrics import Metrics
from lmrpc.server.telemetry import CallObserver

T = TypeVar("T")
LOAD_REFRESH = 0.5  # seconds a load reading is reused for ORCA reports (a burst of calls reads it once)


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
        self._in_flight_by_client: dict[str, int] = {}  # the same, per client identity
        budget = memory.memory_budget()
        # What GetLoad reports as the memory limit: the container's, else the host's available memory at start.
        self.memory_limit = budget.cgroup_limit or budget.host_available or 0
        self._load: tuple[float, load.Load] | None = None  # (when read, reading) for ORCA reports

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

    @property
    def loaded(self) -> bool:
        """The model is loaded and the engine attached."""
        return self._engine is not None

    @property
    def engine(self) -> AsyncEngine:
        assert self._engine is not None, "checked by check_loaded"
        return self._engine

    async def check_loaded(self, context: grpc.aio.ServicerContext) -> None:
        if self._engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    async def check_open(self, context: grpc.aio.ServicerContext) -> None:
        """Generating calls: the model must be loaded, the engine serving, and the server not draining."""
        await self.check_loaded(context)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        failure = self.engine.failure
        if failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, failure)

    @staticmethod
    def metadata_rid(context: grpc.aio.ServicerContext) -> str | None:
        """The call's x-request-id metadata, if any."""
        value = dict(context.invocation_metadata() or ()).get("x-request-id")
        return str(value) if value else None

    def new_rid(self, given: str | None) -> str:
        """`given`, or a fresh id; a given id still running is a user error."""
        c = statuses.Collector()
        validation.check_rids(c, "rid", [given] if given else [])
        c.raise_if_any()
        if given and self.engine.is_live(given):
            raise statuses.invalid("rid", f"request id {given!r} is already running")
        return given or uuid.uuid4().hex

    def client_of(self, context: grpc.aio.ServicerContext) -> str:
        """Who is calling: its API key's fingerprint (with --api-key-file), else its peer's address."""
        return auth.client_identity(context.invocation_metadata(), context.peer() or "", self.server_config.api_keys)

    @property
    def capacity(self) -> int:
        """Outputs the server runs or queues at once: a call asking for more could never be admitted."""
        return self.engine_config.scheduler.max_running_requests + self.server_config.max_queued_requests

    # ---- media -------------------------------------------------------------------------------------------------

    def multimodal_processor(self) -> MultimodalProcessor | None:
        """The loaded model's multimodal processor; None for a text-only model."""
        return self.engine.media_processor

    def media_target(self) -> prepare.MediaTarget:
        info = self.engine.model_info
        return prepare.MediaTarget(self.multimodal_processor(), info.architecture, info.hidden_size)

    def check_media_items(self, items: Sequence[Sequence[ingest.WireItem]]) -> None:
        """Each prompt's items are of kinds the model takes, and at most --max-media-items (media/prepare.py)."""
        try:
            prepare.check_items(items, self.media_target(), self.server_config.media.max_media_items)
        except prepare.MediaRefused as exc:
            raise statuses.media_error(exc) from exc

    async def prepare_media(self, prompts: Sequence[Sequence[int]], items: Sequence[Sequence[ingest.WireItem]]
                            ) -> list[MultimodalPrompt | None]:
        """Each prompt with its media items placed by the model's processor (None for a prompt without items), by
        media/prepare.py; every failure a RequestError naming the item (statuses.media_error)."""
        try:
            return await prepare.prepare(prompts, items, self.media_target(), self.server_config.media)
        except (MediaError, prepare.MediaRefused) as exc:
            raise statuses.media_error(exc) from exc

    # ---- admission ---------------------------------------------------------------------------------------------

    @asynccontextmanager
    async def admitted(self, context: grpc.aio.ServicerContext, requests: list[EngineRequest],
                       priority: int = 0) -> AsyncIterator[list[EngineRequest]]:
        """Count `requests` in flight for the block, as the calling client's, at `priority`; yields them tagged so.
        Over the server's limit, or over the client's share of the queue, the call ends RESOURCE_EXHAUSTED."""
        limit = self.capacity
        if self._outputs_in_flight + len(requests) > limit:
            await context.abort_with_status(statuses.resource_exhausted_status(limit))
        client = self.client_of(context)
        await self._check_client_share(context, client, len(requests))
        self._outputs_in_flight += len(requests)
        self._in_flight_by_client[client] = self._in_flight_by_client.get(client, 0) + len(requests)
        # LoRA adapters the call uses are not evicted before it ends (lora/registry.py)
        adapters = [a for a in {r.adapter for r in requests if r.adapter is not None} if isinstance(a, LoadedAdapter)]
        if adapters:
            self.engine.lora.pin(adapters)
        try:
            yield [replace(r, client=client, priority=priority) for r in requests]
        finally:
            if adapters:
                self.engine.lora.unpin(adapters)
            self._outputs_in_flight -= len(requests)
            left = self._in_flight_by_client[client] - len(requests)
            if left:
                self._in_flight_by_client[client] = left
            else:
                del self._in_flight_by_client[client]

    async def _check_client_share(self, context: grpc.aio.ServicerContext, client: str, new: int) -> None:
        """--max-queued-per-client: a client's outputs that would wait (admitted and not running) are capped, once
        the server has no free running slot for them, so one caller cannot fill the queue for everyone."""
        cap = self.server_config.max_queued_per_client
        if cap is None:
            return
        running = self.engine.running_by_client.get(client, 0)
        queued = self._in_flight_by_client.get(client, 0) + new - running
        contended = self._outputs_in_flight + new > self.engine_config.scheduler.max_running_requests
        if queued > cap and contended:
            await context.abort_with_status(statuses.client_share_exhausted_status(cap, queued - new))

    # ---- load --------------------------------------------------------------------------------------------------

    def load(self) -> load.Load:
        engine = self.engine
        reading = load.read_load(engine.stats(), engine.load_tracker, memory.resident_bytes(), self.memory_limit,
                                 self.engine_config.scheduler.max_running_requests)
        self._load = (time.monotonic(), reading)
        return reading

    def report_load(self, context: grpc.aio.ServicerContext) -> None:
        """Set the call's ORCA load report (trailing metadata); called as a call starts and as it ends."""
        if self._engine is None:
            return
        cached = self._load
        reading = cached[1] if cached is not None and time.monotonic() - cached[0] < LOAD_REFRESH else self.load()
        context.set_trailing_metadata(((load.ORCA_TRAILER, load.orca_report(reading)),))

    # ---- streaming calls ---------------------------------------------------------------------------------------

    @staticmethod
    async def observed(
        context: grpc.aio.ServicerContext, call: CallObserver, messages: AsyncGenerator[T, None]
    ) -> AsyncGenerator[T, None]:
        """`messages`, with the call's final status reported to `call` however the call ends; an engine that
        cannot serve ends the call UNAVAILABLE. (A client that stops reading is wire.py's: it sets the code first.)"""
        # Metrics, the call's span and the request log see every way a call ends, so the status is decided here.
        status = grpc.StatusCode.UNKNOWN  # an unexpected exception: grpc answers UNKNOWN
        try:
            async with aclosing(messages):  # closed here even when the caller stops early: its cleanup runs now
                async for msg in messages:
                    yield msg
            status = grpc.StatusCode.OK
        except EngineUnavailable as exc:
            status = grpc.StatusCode.UNAVAILABLE
            await context.abort(status, str(exc))
        except (asyncio.CancelledError, GeneratorExit):
            remaining = context.time_remaining()
            passed = remaining is not None and remaining <= 0
            status = grpc.StatusCode.DEADLINE_EXCEEDED if passed else grpc.StatusCode.CANCELLED
            raise
        finally:
            call.end(context.code() or status)  # code() is set by abort / abort_with_status / wire.py


async def check_constraint(engine: AsyncEngine, params: SamplingParams, field: str) -> SamplingParams:
    """`params` with its constraint checked, carrying the matcher the check built to the engine (compiled off the
    event loop); INVALID_ARGUMENT naming `field` if it does not compile or passes the grammar limits."""
    if params.constraint is None:
        return params
    try:
        constraint = await asyncio.to_thread(engine.check_constraint, params.constraint)
    except GrammarError as exc:
        raise statuses.invalid(field, str(exc)) from exc
    return replace(params, constraint=constraint)
