"""The GenerateService servicer: its requests translated into the pipeline's prompt plans (media items placed in
their prompts through the frontend), outputs streamed or merged (pipeline/), cancel/deadline -> engine abort."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import grpc

from lmrpc.server import statuses, validation
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineRequest, LogprobOptions, PromptEmbeddings
from lmrpc.server.frontend import Frontend, check_constraint
from lmrpc.server.lora.errors import MAX_NAME_CHARS, AdapterError
from lmrpc.server.lora.registry import LoadedAdapter
from lmrpc.server.media import ingest
from lmrpc.server.pipeline.fanout import PromptPlan, engine_requests
from lmrpc.server.pipeline.gather import Gathered
from lmrpc.server.protos import adapter_pb, hidden_pb, position_pb, routed_pb, set_finish
from lmrpc.server.telemetry import CallObserver
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)

EMBEDDING_PLACEHOLDER_ID = 0  # the token id standing for each position of an embeddings prompt (never read)


class GenerateService(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend  # the engine, admission control and the drain flag, shared with OpenAIService

    @property
    def engine(self) -> AsyncEngine:
        return self.frontend.engine

    # ---- request building --------------------------------------------------------------------------------------

    async def _build(self, req: generate_pb2.GenerateRequest, default_rid: str | None) -> list[EngineRequest]:
        num_prompts = validation.check_shape(req)
        validation.check_generate_sizes(req, num_prompts, self.frontend.server_config.limits, self.frontend.capacity)
        validation.check_media_shape(req, num_prompts)
        info = self.engine.model_info
        hidden = validation.hidden_states_mode(req, info)
        routed_from = validation.routed_experts_from(req, info,
                                                     self.frontend.engine_config.enable_return_routed_experts)
        embeds: list[PromptEmbeddings | None] = [None] * num_prompts
        if req.text:
            tokenizer = self.engine.tokenizer
            prompts = await asyncio.to_thread(lambda: [list(tokenizer.encode(t)) for t in req.text])
        elif req.input_embeds:
            embeds = list(await asyncio.to_thread(validation.check_embeddings, req, info))
            # One placeholder id per position: lengths, positions and usage stay token-shaped; the model reads the
            # rows instead, and the prefix cache keys these positions by the rows' digests (Sequence.cache_keys).
            prompts = [[EMBEDDING_PLACEHOLDER_ID] * e.num_positions for e in embeds if e is not None]
        else:
            prompts = [list(ids.ids) for ids in req.input_ids]
        # Media items placed in their prompts: each prompt's ids with the placeholders expanded
        media_items = ingest.generate_items(req, num_prompts)
        placed = await self.frontend.prepare_media(prompts, media_items)
        prompts = [list(mm.token_ids) if mm is not None else p for p, mm in zip(prompts, placed, strict=True)]
        given: list[str | None] = list(req.rid) or ([default_rid] if num_prompts == 1 else [None] * num_prompts)
        rids = [self.frontend.new_rid(rid) for rid in given]
        adapters = [await self._adapter(validation.lora_ref(req.lora_path, i), i) for i in range(num_prompts)]
        logprobs = None
        if req.return_logprob:
            logprobs = LogprobOptions(
                start_len=req.logprob_start_len if req.HasField("logprob_start_len") else -1,
                top_k=req.top_logprobs_num, token_ids=tuple(req.token_ids_logprob),
                with_text=req.return_text_in_logprobs,
            )
        plans: list[PromptPlan] = []
        use_model = self.frontend.engine_config.sampling_defaults == "model"
        for i, (prompt, rid, adapter) in enumerate(zip(prompts, rids, adapters, strict=True)):
            validation.check_prompt(prompt, i, info, req)
            if not req.sampling_params:
                pb, name = generate_pb2.SamplingParams(), "sampling_params"
            elif len(req.sampling_params) == 1:
                pb, name = req.sampling_params[0], "sampling_params[0]"
            else:
                pb, name = req.sampling_params[i], f"sampling_params[{i}]"
            params = validation.resolve_sampling(
                pb, name, info, use_model, len(prompt), req.custom_logit_processor,
                self.frontend.engine_config.enable_custom_logit_processor,
            )
            if params.logit_processor:
                try:
                    self.engine.processors.create(params.logit_processor, dict(params.processor_params))
                except (KeyError, ValueError) as exc:
                    raise statuses.invalid("custom_logit_processor", str(exc).strip("'\"")) from exc
            if params.constraint is not None:
                params = await check_constraint(self.engine, params, f"{name}.{params.constraint.kind}")
            mm = placed[i]
            plans.append(PromptPlan(
                request_id=rid, rid=rid, prompt_ids=tuple(prompt), params=params, samples=params.n,
                logprobs=logprobs, adapter=adapter, prompt_embeds=embeds[i],
                prompt_media=mm.engine_media if mm is not None else None, hidden_states=hidden,
                routed_experts_from=routed_from))
        return engine_requests(plans)

    async def _adapter(self, ref: str, index: int) -> LoadedAdapter | None:
        """Prompt `index`'s LoRA adapter ("" : the base model), loaded from under --lora-root if need be."""
        return await validation.resolve_adapter(self.engine.lora, ref, f"lora_path[{index}]")

    # ---- RPCs ----------------------------------------------------------------------------------------------------

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        call = CallObserver(self.frontend.metrics, rid=",".join(request.rid) or None)
        # Every generator down to the engine's is closed explicitly: a closed call aborts its engine requests before
        # the close returns, never later when the event loop (or the cycle collector) finalizes a dropped generator.
        async with aclosing(self.frontend.observed(context, call, self._generate(request, context, call))) as msgs:
            async for msg in msgs:
                yield msg

    async def _generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext, call: CallObserver
    ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        await self.frontend.check_open(context)
        default_rid = self.frontend.metadata_rid(context)
        call.rid = call.rid or default_rid
        try:
            engine_requests = await self._build(request, default_rid)
        except statuses.RequestError as exc:
            await context.abort_with_status(statuses.to_status(exc))
            return
        priority = request.priority if request.HasField("priority") else 0
        async with self.frontend.admitted(context, engine_requests, priority) as admitted:
            call.queued(admitted)
            async with aclosing(self._stream(request, admitted, default_rid, context, call)) as msgs:
                async for msg in msgs:
                    yield msg

    async def _stream(
        self, request: generate_pb2.GenerateRequest, engine_requests: list[EngineRequest], default_rid: str | None,
        context: grpc.aio.ServicerContext, call: CallObserver,
    ) -> AsyncGenerator[generate_pb2.GenerateResponse, None]:
        if default_rid:
            await context.send_initial_metadata((("x-request-id", default_rid),))
        by_id = {r.request_id: r for r in engine_requests}
        experts = self.engine.model_info.experts
        merged = {r.request_id: Gathered() for r in engine_requests}
        async with aclosing(self.engine.generate(engine_requests)) as outputs:
            async for out in outputs:
                call.output(out)
                req = by_id[out.request_id]
                if request.stream:
                    msg = generate_pb2.GenerateResponse(
                        index=req.index, rid=req.rid, text=out.text, token_ids=out.token_ids,
                        output_logprobs=[position_pb(p) for p in out.output_logprobs],
                        input_logprobs=[position_pb(p) for p in out.input_logprobs],
                        hidden_states=hidden_pb(out.hidden_states),
                        routed_experts=routed_pb([out.routed_experts] if out.routed_experts else [], experts),
                    )
                    set_finish(msg, out.finish, out.usage)
                    yield msg
                    continue
                m = merged[out.request_id]
                m.add(out)
                if out.finish is not None:
                    msg = generate_pb2.GenerateResponse(
                        index=req.index, rid=req.rid, text=m.text, token_ids=m.token_ids,
                        output_logprobs=[position_pb(p) for p in m.output_logprobs],
                        input_logprobs=[position_pb(p) for p in m.input_logprobs],
                        hidden_states=hidden_pb(m.hidden_states),
                        routed_experts=routed_pb(m.routed, experts),
                    )
                    set_finish(msg, m.finish, m.usage)
                    yield msg

    async def Abort(
        self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.AbortResponse:
        await self.frontend.check_loaded(context)
        found = self.engine.abort(None if request.abort_all else list(request.rid))
        return generate_pb2.AbortResponse(aborted_rid=found)

    async def GetLoad(
        self, request: generate_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GetLoadResponse:
        await self.frontend.check_loaded(context)
        load = self.frontend.load()
        return generate_pb2.GetLoadResponse(
            running_outputs=load.running, waiting_outputs=load.waiting, paused_outputs=load.paused,
            kv_cache_usage=load.kv_usage, kv_cache_pages=load.num_pages, kv_cache_used_pages=load.used_pages,
            generation_tokens_per_second=load.generation_tokens_per_second,
            prompt_tokens_per_second=load.prompt_tokens_per_second, queue_time_p50_seconds=load.queue_time_p50,
            resident_memory_bytes=load.resident_bytes, memory_limit_bytes=load.memory_limit_bytes,
            max_running_outputs=load.max_running,
        )

    async def GetModelInfo(
        self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GetModelInfoResponse:
        await self.frontend.check_loaded(context)
        info = self.engine.model_info
        defaults = dict(validation.OPENAI_DEFAULTS)
        if self.frontend.engine_config.sampling_defaults == "model":
            defaults.update(info.generation_defaults)
        return generate_pb2.GetModelInfoResponse(
            model_path=info.path, served_model_name=info.served_model_name, vocab_size=info.vocab_size,
            max_context_length=info.max_context_length, eos_token_ids=info.eos_token_ids,
            default_sampling_params=generate_pb2.SamplingParams(
                max_new_tokens=128, temperature=defaults["temperature"], top_p=defaults["top_p"],
                top_k=int(defaults["top_k"]), min_p=defaults["min_p"],
                repetition_penalty=defaults["repetition_penalty"], frequency_penalty=0.0, presence_penalty=0.0,
                min_new_tokens=0, n=1, ignore_eos=False, skip_special_tokens=True,
                spaces_between_special_tokens=True, no_stop_trim=False,
            ),
            architecture=info.architecture, dtype=info.dtype, device=info.device, quantization=info.quantization,
            weight_formats=info.weight_formats, lora_adapters=[adapter_pb(a) for a in self.engine.lora.list()],
            hidden_size=info.hidden_size,
            accepts_input_embeds=info.accepts_embeddings,
            experts=None if info.experts is None else generate_pb2.ExpertsInfo(
                num_layers=info.experts.num_layers, num_experts=info.experts.num_experts, top_k=info.experts.top_k,
                return_enabled=self.frontend.engine_config.enable_return_routed_experts),
            limits=self._limits_pb(),
        )

    def _limits_pb(self) -> generate_pb2.RequestLimits:
        """Every bound validation checks, from the flags and the model's own media limits."""
        frontend = self.frontend
        limits, media = frontend.server_config.limits, frontend.server_config.media
        grammar = frontend.engine_config.grammar
        pb = generate_pb2.RequestLimits(
            max_outputs_per_call=frontend.capacity, max_logit_bias=limits.max_logit_bias, max_stop=limits.max_stop,
            max_stop_chars=limits.max_stop_chars, max_logprob_token_ids=limits.max_logprob_token_ids,
            max_top_logprobs=validation.MAX_TOP_LOGPROBS, max_grammar_bytes=grammar.max_grammar_bytes,
            max_grammar_depth=grammar.max_grammar_depth, max_grammar_rules=grammar.max_grammar_rules,
            max_request_id_chars=validation.MAX_RID_CHARS, max_media_items=media.max_media_items,
            max_media_bytes=media.max_media_bytes, max_image_pixels=media.max_image_pixels,
            max_adapter_name_chars=MAX_NAME_CHARS,
        )
        processor = frontend.multimodal_processor()
        if processor is not None and processor.sampling_rate > 0:  # a model that takes audio
            model_max = processor.max_audio_seconds
            pb.max_audio_seconds = media.max_audio_seconds if model_max is None else min(media.max_audio_seconds,
                                                                                          model_max)
            pb.min_audio_samples = processor.min_audio_samples
            pb.audio_sampling_rate = processor.sampling_rate
        return pb

    # ---- LoRA adapters ---------------------------------------------------------------------------------------------

    async def _check_lora_admin(self, context: grpc.aio.ServicerContext) -> None:
        await self.frontend.check_loaded(context)
        if not self.frontend.engine_config.lora.enable_lora_admin:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "loading and unloading LoRA adapters is disabled (server flag --enable-lora-admin)")

    async def LoadLoraAdapter(
        self, request: generate_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.LoadLoraAdapterResponse:
        await self._check_lora_admin(context)
        try:
            adapter = await asyncio.to_thread(self.engine.lora.load, request.name, request.path, confined=True)
        except AdapterError as exc:
            await context.abort_with_status(statuses.to_status(statuses.adapter_error(exc, exc.field or "path")))
        info = next((a for a in self.engine.lora.list() if a.name == adapter.name), None)
        return generate_pb2.LoadLoraAdapterResponse(adapter=adapter_pb(info) if info is not None else None)

    async def UnloadLoraAdapter(
        self, request: generate_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.UnloadLoraAdapterResponse:
        await self._check_lora_admin(context)
        try:
            self.engine.lora.unload(request.name)
        except AdapterError as exc:
            await context.abort_with_status(statuses.to_status(statuses.adapter_error(exc, "name")))
        return generate_pb2.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(
        self, request: generate_pb2.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ListLoraAdaptersResponse:
        await self.frontend.check_loaded(context)
        return generate_pb2.ListLoraAdaptersResponse(adapters=[adapter_pb(a) for a in self.engine.lora.list()])

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        await self.frontend.check_loaded(context)
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = await asyncio.to_thread(self.engine.tokenizer.encode, request.text, add_special_tokens=add)
        return generate_pb2.TokenizeResponse(token_ids=ids)

    async def Detokenize(
        self, request: generate_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.DetokenizeResponse:
        await self.frontend.check_loaded(context)
        vocab = self.engine.model_info.vocab_size
        bad = next((t for t in request.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            await context.abort_with_status(statuses.to_status(
                statuses.invalid("token_ids", f"token id {bad} outside [0, {vocab})")))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await asyncio.to_thread(self.engine.tokenizer.decode, list(request.token_ids),
                                       skip_special_tokens=skip)
        return generate_pb2.DetokenizeResponse(text=str(text))
