"""ChatComplete: a conversation rendered with the chat template (media parts as the model's placeholders, the items
placed by its processor) and planned into engine requests (tools turned into a constraint), and the engine's
outputs answered as OpenAI chat completions: the role first, then content deltas, then tool-call deltas, or one
message with the whole answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from lmrpc.server import statuses, validation
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineOutput, EngineRequest, Finish, LogprobOptions
from lmrpc.server.frontend import Frontend, check_constraint
from lmrpc.server.media.types import Modality, MultimodalProcessor
from lmrpc.server.openai import tools
from lmrpc.server.openai import validation as rules
from lmrpc.server.openai.chat_template import RESERVED_KWARGS, ChatTemplate
from lmrpc.server.openai.choices import CallUsage, Candidate, engine_requests, set_finish, set_model_outputs
from lmrpc.server.openai.logprobs import TokenTexts, chat_logprobs
from lmrpc.server.telemetry import CallObserver
from lmrpc.v1 import openai_pb2

ASSISTANT = "assistant"


@dataclass(frozen=True)
class ChatPlan:
    """A checked ChatCompleteRequest, rendered and ready for the engine."""

    id: str  # the response id, "chatcmpl-" + rid
    created: int  # arrival, seconds since the epoch
    model: str  # the served model's name
    options: rules.ChatOptions  # n, logprobs, tools, output options
    prompt: tuple[int, ...]  # the rendered conversation's token ids
    requests: tuple[EngineRequest, ...]  # the n choices


async def plan(req: openai_pb2.ChatCompleteRequest, frontend: Frontend, template: ChatTemplate, rid: str,
               use_model_defaults: bool, capacity: int, routed_enabled: bool) -> ChatPlan:
    """Check, render and tokenize, and place the conversation's media parts (through the frontend's media path);
    raises RequestError naming the field (FAILED_PRECONDITION without a template).
    routed_enabled: the server returns routed experts (--enable-return-routed-experts)."""
    engine = frontend.engine
    info = engine.model_info
    outputs = rules.model_outputs(req, info, routed_enabled)
    adapter_ref, adapter_field = rules.check_model(req.model, info.served_model_name, req.lora_path)
    options = rules.chat_options(req, RESERVED_KWARGS)
    validation.check_outputs(options.n, capacity, "n")
    adapter = await validation.resolve_adapter(engine.lora, adapter_ref, adapter_field)
    template.require()
    media_items = rules.chat_media_items(req)
    processor = frontend.multimodal_processor() if media_items else None
    if media_items:
        frontend.check_media_items([media_items])
    rendered = await asyncio.to_thread(
        template.render, list(req.messages), options.tools, add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message, template_kwargs=options.template_kwargs,
        placeholders=_placeholders(processor))
    if options.tool_mode == "auto" and not rendered.tool_format_known:
        raise statuses.RequestError(grpc.StatusCode.FAILED_PRECONDITION, [statuses.Violation(
            "tool_choice", 'the chat template writes tool calls in a format this server does not parse (it parses '
                           'Hermes <tool_call> tags); use tool_choice "required" or a named function')])
    tokenizer = engine.tokenizer
    # The template spells out the special tokens it wants (BOS included): add none.
    prompt = tuple(await asyncio.to_thread(tokenizer.encode, rendered.text, add_special_tokens=False))
    [placed] = await frontend.prepare_media([prompt], [media_items])
    if placed is not None:
        prompt = placed.token_ids
    rules.check_prompt(list(prompt), "messages", info, req)
    constraint = options.constraint or _tool_constraint(options)
    max_tokens, max_field = rules.chat_max_tokens(req, info)
    pb = rules.sampling_pb(req, max_tokens, constraint)
    if options.tool_mode != "none" and not pb.HasField("json_whitespace_flexible"):
        pb.json_whitespace_flexible = False  # tool calls in json.dumps' layout unless asked otherwise
    if options.tool_mode == "auto" and not options.parallel_tool_calls:
        pb.stop.append(tools.CALL_END)  # one call at most: the answer ends with the first call's end tag
    params = validation.resolve_sampling(pb, rules.sampling_names(max_field), info, use_model_defaults, len(prompt),
                                         "", False)
    if constraint is not None:
        params = await check_constraint(engine, params, constraint.field)
    logprobs = LogprobOptions(top_k=options.logprobs) if options.logprobs is not None else None
    requests = engine_requests(rid, [prompt], [params], options.n, logprobs, adapter, outputs,
                               placed.engine_media if placed is not None else None)
    model = req.model if adapter else info.served_model_name  # "base:adapter" is answered as asked
    return ChatPlan(id=f"chatcmpl-{rid}", created=int(time.time()), model=model, options=options,
                    prompt=prompt, requests=tuple(requests))


def _placeholders(processor: MultimodalProcessor | None) -> dict[str, str] | None:
    """The model's placeholder text per media part type, for templates that render content as text only; None for a
    text-only model."""
    if processor is None:
        return None
    by_part = {"image_url": Modality.IMAGE, "input_audio": Modality.AUDIO}
    return {part: processor.placeholders[m] for part, m in by_part.items() if m in processor.placeholders}


def _tool_constraint(options: rules.ChatOptions) -> rules.ConstraintRequest | None:
    if options.tool_mode == "function":
        [tool] = [t for t in options.tools if t.name == options.tool_name]
        return rules.ConstraintRequest("tool_choice", "json_schema", tools.named_schema(tool))
    if options.tool_mode == "required":
        return rules.ConstraintRequest("tools", "json_schema",
                                       tools.required_schema(options.tools, options.parallel_tool_calls))
    if options.tool_mode == "auto":
        return rules.ConstraintRequest("tools", "structural_tag", tools.hermes_structural_tag(options.tools))
    return None


@dataclass
class _Choice:
    """A choice's streaming state."""

    parser: tools.CallParser  # content and calls out of its text
    texts: TokenTexts  # its tokens' texts (logprobs)
    calls: int = 0  # tool calls sent so far
    content: list[str] = field(default_factory=list)  # content sent so far (merged answers)
    tool_calls: list[openai_pb2.ToolCall] = field(default_factory=list)  # calls read so far (merged answers)
    logprobs: list[openai_pb2.ChatTokenLogprob] = field(default_factory=list)  # every token's so far
    logprobs_sent: int = 0  # how many of them went out in chunks
    token_ids_sent: int = 0  # how many of the candidate's token ids went out in chunks (return_token_ids)


class ChatStream:
    """Answers one planned chat call from its engine outputs."""

    def __init__(self, plan: ChatPlan, engine: AsyncEngine, call: CallObserver) -> None:
        self.plan = plan
        self.engine = engine
        self.call = call
        options = plan.options
        self.candidates = {r.request_id: Candidate.of(r, options.n) for r in plan.requests}
        self.usage = CallUsage([len(plan.prompt)], options.output.cached_details)
        self._choices = {r.request_id: _Choice(tools.parser_for(options.tool_mode, options.tool_name),
                                               TokenTexts.for_output(engine.tokenizer, r.prompt_ids, r.params))
                         for r in plan.requests}

    def _response(self, choices: Sequence[openai_pb2.ChatChoice], usage: bool) -> openai_pb2.ChatCompleteResponse:
        p = self.plan
        obj = "chat.completion.chunk" if p.options.output.stream else "chat.completion"
        return openai_pb2.ChatCompleteResponse(id=p.id, object=obj, created=p.created, model=p.model,
                                               choices=choices, usage=self.usage.pb() if usage else None)

    async def respond(self, outputs: AsyncIterator[EngineOutput]) -> AsyncIterator[openai_pb2.ChatCompleteResponse]:
        output = self.plan.options.output
        if output.stream:
            for r in self.plan.requests:  # the role first, at once
                first = openai_pb2.ChatChoice(index=r.index, delta=openai_pb2.ChatMessage(role=ASSISTANT))
                if output.return_token_ids:
                    first.prompt_token_ids.extend(r.prompt_ids)
                yield self._response([first], usage=output.continuous_usage)
        async for out in outputs:
            self.call.output(out)
            candidate = self.candidates[out.request_id]
            candidate.add(out)
            self.usage.add(candidate, out)
            for choice in self._advance(candidate, out):
                if output.stream:
                    yield self._response([choice], usage=output.continuous_usage)
        if output.stream:
            if output.include_usage:
                yield self._response([], usage=True)
            return
        yield self._response([self._merged(c) for c in self.candidates.values()], usage=True)

    def _advance(self, candidate: Candidate, out: EngineOutput) -> list[openai_pb2.ChatChoice]:
        """The chunks one engine output makes: content, tool calls, then the finish (each only if there is one)."""
        state = self._choices[candidate.request.request_id]
        options = self.plan.options
        if options.logprobs is not None:
            texts = state.texts.add(out.token_ids, last=out.finish is not None)
            state.logprobs += chat_logprobs(self.engine.tokenizer, self.engine.grammar.token_bytes,
                                            out.output_logprobs, texts)
        pieces = [state.parser.feed(out.text)]
        if out.finish is not None:
            pieces.append(state.parser.finish())
        deltas: list[openai_pb2.ChatMessage] = []
        content = "".join(p.content for p in pieces)
        if content:
            state.content.append(content)
            deltas.append(openai_pb2.ChatMessage(content=content))
        calls = [self._tool_call(state, c) for p in pieces for c in p.calls]
        if calls:
            state.tool_calls += calls
            deltas.append(openai_pb2.ChatMessage(tool_calls=calls))
        chunks = [openai_pb2.ChatChoice(index=candidate.request.index, delta=d) for d in deltas]
        if out.finish is not None:
            last = openai_pb2.ChatChoice(index=candidate.request.index, delta=openai_pb2.ChatMessage())
            self._set_finish(last, state, out.finish)
            chunks.append(last)
        if out.hidden_states or out.routed_experts is not None:
            # New positions go out at once: on the first chunk, or on one of their own while the text is held back.
            if not chunks:
                chunks.append(openai_pb2.ChatChoice(index=candidate.request.index, delta=openai_pb2.ChatMessage()))
            set_model_outputs(chunks[0], out.hidden_states, [out.routed_experts] if out.routed_experts else [],
                              self.engine.model_info.experts)
        if chunks:  # logprobs and token ids ride on the first chunk that goes out
            if options.logprobs is not None:
                chunks[0].logprobs.content.extend(state.logprobs[state.logprobs_sent:])
                state.logprobs_sent = len(state.logprobs)
            if options.output.return_token_ids:
                chunks[0].token_ids.extend(candidate.token_ids[state.token_ids_sent:])
                state.token_ids_sent = len(candidate.token_ids)
        return chunks

    @staticmethod
    def _tool_call(state: _Choice, call: tools.ParsedCall) -> openai_pb2.ToolCall:
        index, state.calls = state.calls, state.calls + 1
        return openai_pb2.ToolCall(index=index, id=call.id, type="function",
                                   function=openai_pb2.FunctionCall(name=call.name, arguments=call.arguments))

    @staticmethod
    def _set_finish(choice: openai_pb2.ChatChoice, state: _Choice, finish: Finish) -> None:
        set_finish(choice, finish)
        if state.parser.called and choice.finish_reason == openai_pb2.COMPLETION_FINISH_REASON_STOP:
            # Ended by the call's own grammar or end tag: what matched is the tool-call machinery, not a stop.
            choice.finish_reason = openai_pb2.COMPLETION_FINISH_REASON_TOOL_CALLS
            choice.ClearField("matched_stop")

    def _merged(self, candidate: Candidate) -> openai_pb2.ChatChoice:
        """The whole answer of one choice (its chunks, merged as a client merges them)."""
        state = self._choices[candidate.request.request_id]
        message = openai_pb2.ChatMessage(role=ASSISTANT, tool_calls=state.tool_calls)
        if state.content:
            message.content = "".join(state.content)
        choice = openai_pb2.ChatChoice(index=candidate.request.index, message=message)
        if self.plan.options.output.return_token_ids:
            choice.prompt_token_ids.extend(candidate.request.prompt_ids)
            choice.token_ids.extend(candidate.token_ids)
        if self.plan.options.logprobs is not None:
            choice.logprobs.content.extend(state.logprobs)
        set_model_outputs(choice, candidate.hidden_states, candidate.routed, self.engine.model_info.experts)
        assert candidate.finish is not None, "every output of a completed call finished"
        self._set_finish(choice, state, candidate.finish)
        return choice
