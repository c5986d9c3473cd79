"""The OpenAIService servicer: Complete and ChatComplete over the shared Frontend (engine, admission, drain)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Protocol, TypeVar

import grpc

from lmrpc.server import statuses, validation
from lmrpc.server.engine.types import EngineOutput, EngineRequest
from lmrpc.server.frontend import Frontend
from lmrpc.server.openai import chat, completions, fim
from lmrpc.server.openai.chat_template import ChatTemplate
from lmrpc.server.openai.choices import EngineFailure
from lmrpc.server.telemetry import CallObserver
from lmrpc.v1 import openai_pb2, openai_pb2_grpc

Response = TypeVar("Response")


class _Plan(Protocol):
    @property
    def requests(self) -> tuple[EngineRequest, ...]: ...


P = TypeVar("P", bound=_Plan)
_Request = openai_pb2.CompleteRequest | openai_pb2.ChatCompleteRequest


class OpenAIService(openai_pb2_grpc.OpenAIServiceServicer):
    def __init__(self, frontend: Frontend, chat_template: str | None = None) -> None:
        self.frontend = frontend  # shared with GenerateService: one engine, one admission limit
        self._template_override = chat_template  # --chat-template's text; None: the tokenizer's template
        self._template: ChatTemplate | None = None  # built from the tokenizer once the model is loaded
        self._fim: fim.FimTokens | None = None  # the tokenizer's fill-in-the-middle tokens, if any

    def _model_parts(self) -> tuple[ChatTemplate, fim.FimTokens | None]:
        """The template and FIM tokens, read from the tokenizer at the first call after the model loaded."""
        if self._template is None:
            tokenizer = self.frontend.engine.tokenizer
            self._template = ChatTemplate(tokenizer, self._template_override)
            self._fim = fim.find_fim_tokens(tokenizer)
        return self._template, self._fim

    @property
    def _capacity(self) -> int:
        return self.frontend.capacity

    @property
    def _routed_enabled(self) -> bool:
        return self.frontend.engine_config.enable_return_routed_experts

    @property
    def _model_defaults(self) -> bool:
        return self.frontend.engine_config.sampling_defaults == "model"

    async def Complete(
        self, request: openai_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[openai_pb2.CompleteResponse]:
        call = CallObserver(self.frontend.metrics, rid=request.rid or None)

        async def build(rid: str) -> completions.CompletionPlan:
            _, fim_tokens = self._model_parts()
            return await completions.plan(request, self.frontend.engine, fim_tokens, rid, self._model_defaults,
                                          self._capacity, self._routed_enabled)

        def answer(plan: completions.CompletionPlan,
                   outputs: AsyncIterator[EngineOutput]) -> AsyncIterator[openai_pb2.CompleteResponse]:
            return completions.CompletionStream(plan, self.frontend.engine, call).respond(outputs)

        run = self._run(context, call, request, build, answer)
        # Closed explicitly, so that a closed call's engine requests are aborted before the close returns.
        async with aclosing(self.frontend.observed(context, call, run)) as msgs:
            async for msg in msgs:
                yield msg

    async def ChatComplete(
        self, request: openai_pb2.ChatCompleteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[openai_pb2.ChatCompleteResponse]:
        call = CallObserver(self.frontend.metrics, rid=request.rid or None)

        async def build(rid: str) -> chat.ChatPlan:
            template, _ = self._model_parts()
            return await chat.plan(request, self.frontend, template, rid, self._model_defaults,
                                   self._capacity, self._routed_enabled)

        def answer(plan: chat.ChatPlan,
                   outputs: AsyncIterator[EngineOutput]) -> AsyncIterator[openai_pb2.ChatCompleteResponse]:
            return chat.ChatStream(plan, self.frontend.engine, call).respond(outputs)

        run = self._run(context, call, request, build, answer)
        # Closed explicitly, so that a closed call's engine requests are aborted before the close returns.
        async with aclosing(self.frontend.observed(context, call, run)) as msgs:
            async for msg in msgs:
                yield msg

    async def _run(
        self, context: grpc.aio.ServicerContext, call: CallObserver, request: _Request,
        build: Callable[[str], Awaitable[P]],
        answer: Callable[[P, AsyncIterator[EngineOutput]], AsyncIterator[Response]],
    ) -> AsyncGenerator[Response, None]:
        """What both RPCs do: check the server is open, plan (user errors end the call with their status), admit,
        run the engine requests and answer from their outputs."""
        await self.frontend.check_open(context)
        default_rid = self.frontend.metadata_rid(context)
        call.rid = call.rid or default_rid
        try:
            c = statuses.Collector()
            validation.check_sizes(c, [("", request)], self.frontend.server_config.limits)
            c.raise_if_any()
            rid = self.frontend.new_rid(request.rid or default_rid)
            plan = await build(rid)
        except statuses.RequestError as exc:
            await context.abort_with_status(statuses.to_status(exc))
            return
        priority = request.priority if request.HasField("priority") else 0
        async with self.frontend.admitted(context, list(plan.requests), priority) as requests:
            call.queued(requests)
            if default_rid:
                await context.send_initial_metadata((("x-request-id", default_rid),))
            try:
                # Closed here however the call ends, so that unfinished engine requests are aborted at once.
                async with aclosing(self.frontend.engine.generate(requests)) as outputs:
                    async for msg in answer(plan, outputs):
                        yield msg
            except EngineFailure as exc:
                code = grpc.StatusCode.INVALID_ARGUMENT if exc.request_fault else grpc.StatusCode.INTERNAL
                await context.abort(code, validation.clip(str(exc), statuses.MAX_ERROR_BYTES))
