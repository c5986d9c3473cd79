"""The `sglang.grpc.scheduler.SglangScheduler` servicer: SMG's worker contract over the shared frontend (admission,
per-client shares, drain, metrics and the call's observation, as GenerateService and OpenAIService have them).

Generate takes token ids (the gateway tokenizes and detokenizes) and answers in SGLang's messages; Abort ends every
output of a request id at once (their pages freed, the stream ends with finish_reason "abort"), and a cancelled call
aborts its outputs the same way. LoRA adapters are lmrpc's registry's: SMG names them by a lora_id it mints at
load, kept here as that id -> the adapter's name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as sgl
from smg_grpc_proto import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import common_pb2

from lmrpc.server import statuses, validation
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineRequest
from lmrpc.server.frontend import Frontend, check_constraint
from lmrpc.server.lora.errors import AdapterError
from lmrpc.server.lora.registry import LoadedAdapter
from lmrpc.server.pipeline.fanout import PromptPlan, engine_requests
from lmrpc.server.sglang import info, requests, responses
from lmrpc.server.sglang.kv_events import KvEventLog
from lmrpc.server.sglang.kv_stream import KvEventStream, LoadReading, StreamEnded
from lmrpc.server.sglang.tokenizer_dir import TokenizerBundle, write_bundle
from lmrpc.server.telemetry import CallObserver

logger = logging.getLogger(__name__)

SERVICE_NAME = sgl.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
KV_EVENTS_MESSAGE = ("this server runs without a prefix cache (--disable-prefix-cache): it publishes no KV cache "
                     "events (cache_aware falls back to SMG's approximate prefix tree)")
FLUSH_POLL = 0.05  # seconds between looks at the engine while FlushCache waits for it to go idle


class SglangWorkerService(sgl_grpc.SglangSchedulerServicer):
    def __init__(self, frontend: Frontend, tokenizer_root: Path, chat_template: str | None = None) -> None:
        self.frontend = frontend  # the engine, admission control and the drain flag, shared with the other services
        self._tokenizer_root = tokenizer_root  # where the tokenizer directory SMG loads is written
        self._chat_template = chat_template  # --chat-template's text, written into that directory
        self._bundle: TokenizerBundle | None = None  # written on first need (the engine's tokenizer is needed)
        self._bundle_lock = asyncio.Lock()
        self._lora_ids: dict[str, str] = {}  # SMG's lora_id -> the adapter's name in lmrpc's registry
        self._kv_log: KvEventLog | None = None  # the prefix cache's listener, attached at the first subscription
        self._kv_log_lock = asyncio.Lock()
        self._started = time.time()

    @property
    def engine(self) -> AsyncEngine:
        return self.frontend.engine

    async def tokenizer_bundle(self) -> TokenizerBundle:
        """The tokenizer directory and its zip, written once (in a worker thread: it saves files)."""
        async with self._bundle_lock:
            if self._bundle is None:
                engine, config = self.engine, self.frontend.engine_config
                defaults = info.sampling_defaults(engine.model_info, config)
                self._bundle = await asyncio.to_thread(
                    write_bundle, self._tokenizer_root, engine.tokenizer, engine.model_info.eos_token_ids, defaults,
                    self._chat_template)
            return self._bundle

    # ---- Generate ------------------------------------------------------------------------------------------------

    async def Generate(
        self, request: sgl.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sgl.GenerateResponse]:
        call = CallObserver(self.frontend.metrics, rid=request.request_id or None)
        # Closed explicitly down to the engine's generator: a closed call aborts its engine requests at once.
        async with aclosing(self.frontend.observed(context, call, self._generate(request, context, call))) as msgs:
            async for msg in msgs:
                yield msg

    async def _generate(
        self, request: sgl.GenerateRequest, context: grpc.aio.ServicerContext, call: CallObserver
    ) -> AsyncGenerator[sgl.GenerateResponse, None]:
        await self.frontend.check_open(context)
        try:
            rid = self.frontend.new_rid(request.request_id or None)
            built = await self._build(request, rid)
        except statuses.RequestError as exc:
            await context.abort_with_status(statuses.to_status(exc))
            return
        async with self.frontend.admitted(context, built) as admitted:
            call.queued(admitted)
            states = {r.request_id: responses.OutputState(index=r.index, prompt_tokens=len(r.prompt_ids))
                      for r in admitted}
            async with aclosing(self.engine.generate(admitted)) as outputs:
                async for out in outputs:
                    call.output(out)
                    try:
                        messages = responses.responses(rid, states[out.request_id], out, request.stream)
                    except responses.OutputFailed as exc:
                        await context.abort(exc.code, str(exc))
                    for msg in messages:
                        yield msg

    async def _build(self, request: sgl.GenerateRequest, rid: str) -> list[EngineRequest]:
        """The request checked (validation.py's rules), its constraint compiled and its adapter resolved."""
        frontend = self.frontend
        config = frontend.engine_config
        translated = requests.translate(
            request, self.engine.model_info, frontend.server_config.limits, frontend.capacity,
            config.sampling_defaults == "model", config.enable_custom_logit_processor)
        params = translated.params
        if params.logit_processor:
            try:
                self.engine.processors.create(params.logit_processor, dict(params.processor_params))
            except (KeyError, ValueError) as exc:
                raise statuses.invalid("custom_logit_processor", str(exc).strip("'\"")) from exc
        if params.constraint is not None:
            params = await check_constraint(self.engine, params,
                                            requests.sampling_field(params.constraint.kind))
        adapter = await self._adapter(request.lora_id)
        # One prompt, n samples (ids "rid/s" for n > 1, so Abort by rid ends them all); SMG never sends a seed.
        return engine_requests([PromptPlan(request_id=rid, rid=rid, prompt_ids=translated.prompt, params=params,
                                           samples=params.n, logprobs=translated.logprobs, adapter=adapter)])

    async def _adapter(self, lora_id: str) -> LoadedAdapter | None:
        """The adapter SMG's lora_id names ("": the base model): an id minted at LoadLoRAAdapter, else an adapter's
        name (--lora-modules adapters are listed under their names)."""
        name = self._lora_ids.get(lora_id, lora_id)
        return await validation.resolve_adapter(self.engine.lora, name, "lora_id")

    async def Abort(self, request: sgl.AbortRequest, context: grpc.aio.ServicerContext) -> sgl.AbortResponse:
        await self.frontend.check_loaded(context)
        # The engine frees the outputs' pages before its next step and ends them ABORT: the Generate stream sends
        # their GenerateComplete (finish_reason "abort") and ends, while the gateway is still reading it.
        found = self.engine.abort([request.request_id])
        return sgl.AbortResponse(success=bool(found),
                                 message="aborted" if found else f"no running request {request.request_id!r}")

    # ---- registration, health and load -------------------------------------------------------------------------

    async def HealthCheck(self, request: sgl.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> sgl.HealthCheckResponse:
        frontend = self.frontend
        if not frontend.loaded:
            return sgl.HealthCheckResponse(healthy=False, message="the model is still loading")
        if frontend.draining:
            return sgl.HealthCheckResponse(healthy=False, message="server is shutting down")
        failure = self.engine.failure
        if failure is not None:
            return sgl.HealthCheckResponse(healthy=False, message=failure)
        return sgl.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request: sgl.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> sgl.GetModelInfoResponse:
        await self.frontend.check_loaded(context)
        bundle = await self.tokenizer_bundle()
        tokenizer = self.engine.tokenizer
        return info.model_info(self.engine.model_info, self.frontend.engine_config, str(bundle.path),
                               tokenizer.bos_token_id, tokenizer.pad_token_id)

    async def GetServerInfo(self, request: sgl.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> sgl.GetServerInfoResponse:
        await self.frontend.check_loaded(context)
        load = self.frontend.load()
        # The batching limits in force: token budgets left unset were sized to the model (engine/step_budget.py)
        config = replace(self.frontend.engine_config, scheduler=self.engine.scheduler_config)
        return info.server_info(self.engine.model_info, config, load.running + load.waiting, self._started,
                                self.frontend.draining)

    async def GetLoads(self, request: sgl.GetLoadsRequest, context: grpc.aio.ServicerContext) -> sgl.GetLoadsResponse:
        await self.frontend.check_loaded(context)
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank: this worker has one rank (0), got {request.dp_rank}")
        return info.loads(self.frontend.load(), self.frontend.engine_config.cache.page_size,
                          info.waiting_prompt_tokens(self.engine))

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        await self.frontend.check_loaded(context)
        bundle = await self.tokenizer_bundle()
        for data, sha256 in bundle.chunks():
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha256)

    # ---- LoRA adapters -------------------------------------------------------------------------------------------

    async def _check_lora_admin(self, context: grpc.aio.ServicerContext) -> None:
        await self.frontend.check_loaded(context)
        if not self.frontend.engine_config.lora.enable_lora_admin:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "loading and unloading LoRA adapters is disabled (server flag --enable-lora-admin)")

    def _loaded_ids(self) -> list[str]:
        names = set(self.engine.lora.names())
        by_name = {name: lora_id for lora_id, name in self._lora_ids.items() if name in names}
        return sorted(by_name.get(name, name) for name in names)

    async def LoadLoRAAdapter(self, request: sgl.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext) -> sgl.LoadLoRAAdapterResponse:
        await self._check_lora_admin(context)
        try:
            adapter = await asyncio.to_thread(self.engine.lora.load, request.lora_name, request.lora_path,
                                              confined=True)
        except AdapterError as exc:
            field = {"path": "lora_path", "name": "lora_name"}.get(exc.field or "path", exc.field or "lora_path")
            await context.abort_with_status(statuses.to_status(statuses.adapter_error(exc, field)))
        self._lora_ids[request.lora_id or adapter.name] = adapter.name
        return sgl.LoadLoRAAdapterResponse(success=True, loaded_lora_ids=self._loaded_ids())

    async def UnloadLoRAAdapter(self, request: sgl.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext) -> sgl.UnloadLoRAAdapterResponse:
        await self._check_lora_admin(context)
        name = request.lora_name or self._lora_ids.get(request.lora_id, request.lora_id)
        try:
            self.engine.lora.unload(name)
        except AdapterError as exc:
            await context.abort_with_status(statuses.to_status(statuses.adapter_error(exc, "lora_name")))
        self._lora_ids = {i: n for i, n in self._lora_ids.items() if n != name}
        return sgl.UnloadLoRAAdapterResponse(success=True, loaded_lora_ids=self._loaded_ids())

    async def ListLoadedLoRAAdapters(self, request: sgl.ListLoadedLoRAAdaptersRequest,
                                     context: grpc.aio.ServicerContext) -> sgl.ListLoadedLoRAAdaptersResponse:
        await self.frontend.check_loaded(context)
        pinned = {name for name, _ in self.frontend.engine_config.lora.lora_modules}
        ids = {name: lora_id for lora_id, name in self._lora_ids.items()}
        return sgl.ListLoadedLoRAAdaptersResponse(loaded_adapters=[
            sgl.LoadedLoRAAdapter(lora_id=ids.get(a.name, a.name), lora_name=a.name, lora_path=a.path,
                                  pinned=a.name in pinned)
            for a in self.engine.lora.list()])

    # ---- KV events and the cache ------------------------------------------------------------------------------

    async def kv_log(self) -> KvEventLog:
        """The prefix cache's event log, attached to the cache once (it first hears every page cached now)."""
        async with self._kv_log_lock:
            if self._kv_log is None:
                log = KvEventLog(self.frontend.engine_config.cache.page_size)
                await self.engine.set_cache_listener(log)
                self._kv_log = log
            return self._kv_log

    def _load_reading(self) -> LoadReading:
        return LoadReading(self.frontend.load(), info.waiting_prompt_tokens(self.engine))

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.KvEventBatch]:
        await self.frontend.check_loaded(context)
        if not self.frontend.engine_config.cache.enable_prefix_cache:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, KV_EVENTS_MESSAGE)
        stream = KvEventStream(await self.kv_log(), request, self._load_reading)
        # The gateway's subscribe call returns once headers arrive; an idle worker may send no batch for a while.
        await context.send_initial_metadata(())
        try:
            async for batch in stream:
                yield batch
        except StreamEnded as exc:
            await context.abort(exc.code, str(exc))

    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        """Drop every cached page once no request runs (SGLang's semantics: timeout_s 0 refuses while requests are
        in flight, else waits up to timeout_s for the engine to go idle). A request admitted meanwhile keeps the
        pages it holds: only pages no request holds are dropped."""
        await self.frontend.check_loaded(context)
        deadline = time.monotonic() + max(request.timeout_s, 0.0)
        while True:
            stats = self.engine.stats()
            busy = stats.num_running + stats.num_waiting
            if not busy:
                break
            if time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(
                    success=False, message=f"{busy} requests in flight: the cache is flushed once none is (set "
                                           "timeout_s to wait for them)")
            await asyncio.sleep(FLUSH_POLL)
        dropped = await self.engine.flush_cache()
        return common_pb2.FlushCacheResponse(success=True, message=f"dropped {dropped} cached pages")

    # ---- not served ----------------------------------------------------------------------------------------------

    async def Embed(self, request: sgl.EmbedRequest, context: grpc.aio.ServicerContext) -> sgl.EmbedResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "lmrpc serves generation models only: no embeddings")
        return sgl.EmbedResponse()

    async def StartProfile(self, request: common_pb2.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not offered over gRPC by lmrpc")
        return common_pb2.ProfileResponse()

    async def StopProfile(self, request: common_pb2.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not offered over gRPC by lmrpc")
        return common_pb2.ProfileResponse()
