"""Complete: a CompleteRequest planned into engine requests (prompts tokenized, suffix laid out, parameters
resolved), and the engine's outputs answered as OpenAI completions: chunks, or one message with best_of's best."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from lmrpc.server import statuses, validation
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineOutput, EngineRequest, LogprobOptions, PositionLogprobs, SamplingParams
from lmrpc.server.frontend import check_constraint
from lmrpc.server.openai import fim
from lmrpc.server.openai import validation as rules
from lmrpc.server.openai.choices import (
    CallUsage,
    Candidate,
    best,
    engine_requests,
    has_model_outputs,
    set_finish,
    set_model_outputs,
)
from lmrpc.server.openai.logprobs import CompletionLogprobsWriter, TokenTexts
from lmrpc.server.telemetry import CallObserver
from lmrpc.v1 import openai_pb2


@dataclass(frozen=True)
class CompletionPlan:
    """A checked CompleteRequest, ready for the engine."""

    id: str  # the response id, "cmpl-" + rid
    created: int  # arrival, seconds since the epoch
    model: str  # the served model's name
    options: rules.CompletionOptions  # n, best_of, echo, logprobs, output options
    prompts: tuple[tuple[int, ...], ...]  # each prompt's token ids (laid out for the suffix, if any)
    echo_texts: tuple[str, ...]  # what echo prepends to each prompt's choices ("" without echo)
    requests: tuple[EngineRequest, ...]  # prompt x best_of, prompt-major


async def plan(req: openai_pb2.CompleteRequest, engine: AsyncEngine, fim_tokens: fim.FimTokens | None, rid: str,
               use_model_defaults: bool, capacity: int, routed_enabled: bool) -> CompletionPlan:
    """Check and tokenize; raises RequestError naming the field. routed_enabled: the server returns routed experts
    (--enable-return-routed-experts)."""
    info = engine.model_info
    outputs = rules.model_outputs(req, info, routed_enabled)
    adapter_ref, adapter_field = rules.check_model(req.model, info.served_model_name, req.lora_path)
    options = rules.completion_options(req)
    num_prompts = len(req.prompt) or len(req.prompt_token_ids)
    validation.check_outputs(num_prompts * options.best_of, capacity, "best_of" if req.HasField("best_of") else "n")
    adapter = await validation.resolve_adapter(engine.lora, adapter_ref, adapter_field)
    if options.suffix and fim_tokens is None:
        raise statuses.invalid("suffix", "this model's tokenizer has no fill-in-the-middle tokens, so it cannot "
                                           "complete text before a suffix")
    prompts, echo_texts = await asyncio.to_thread(_tokenize, req, engine, fim_tokens, options)
    field = "prompt" if req.prompt else "prompt_token_ids"
    for i, ids in enumerate(prompts):
        rules.check_prompt(list(ids), f"{field}[{i}]", info, req)
    constraint = options.constraint
    params: list[SamplingParams] = []
    for ids in prompts:
        pb = rules.sampling_pb(req, req.max_tokens if req.HasField("max_tokens") else rules.COMPLETE_MAX_TOKENS,
                               constraint)
        params.append(validation.resolve_sampling(pb, rules.sampling_names("max_tokens"), info, use_model_defaults,
                                                  len(ids), "", False))
    if constraint is not None:  # one check: every prompt's params carry the same constraint
        checked = await check_constraint(engine, params[0], constraint.field)
        params = [replace(p, constraint=checked.constraint) for p in params]
    scored = options.logprobs is not None or options.best_of > options.n  # best_of ranks by logprobs
    logprobs = LogprobOptions(start_len=0 if options.echo and options.logprobs is not None else -1,
                              top_k=options.logprobs or 0) if scored else None
    requests = engine_requests(rid, prompts, params, options.best_of, logprobs, adapter, outputs)
    model = req.model if adapter else info.served_model_name  # "base:adapter" is answered as asked
    return CompletionPlan(id=f"cmpl-{rid}", created=int(time.time()), model=model, options=options,
                          prompts=prompts, echo_texts=echo_texts, requests=tuple(requests))


def _tokenize(req: openai_pb2.CompleteRequest, engine: AsyncEngine, fim_tokens: fim.FimTokens | None,
              options: rules.CompletionOptions) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    """(prompts' token ids, their echo texts); blocking."""
    tokenizer = engine.tokenizer
    suffix = list(tokenizer.encode(options.suffix, add_special_tokens=False)) if options.suffix else []
    prompts: list[tuple[int, ...]] = []
    echoes: list[str] = []
    if req.prompt:
        leading = fim.leading_special_ids(tokenizer) if fim_tokens is not None and options.suffix else []
        for text in req.prompt:
            if fim_tokens is not None and options.suffix:
                prefix = tokenizer.encode(text, add_special_tokens=False)
                prompts.append(tuple(fim.fim_prompt(fim_tokens, leading, prefix, suffix)))
            else:
                prompts.append(tuple(tokenizer.encode(text)))
            echoes.append(text if options.echo else "")
    else:
        for entry in req.prompt_token_ids:
            ids = list(entry.ids)
            prompts.append(tuple(fim.fim_prompt(fim_tokens, [], ids, suffix)) if fim_tokens is not None and suffix
                           else tuple(ids))
            # The prompt spelled out, special tokens included (validated ids only: decode of a bad id would fail).
            valid = all(0 <= t < engine.model_info.vocab_size for t in ids)
            echoes.append(str(tokenizer.decode(ids, skip_special_tokens=False)) if options.echo and valid else "")
    return tuple(prompts), tuple(echoes)


class CompletionStream:
    """Answers one planned call from its engine outputs."""

    def __init__(self, plan: CompletionPlan, engine: AsyncEngine, call: CallObserver) -> None:
        self.plan = plan
        self.engine = engine
        self.call = call
        options = plan.options
        self.candidates = {r.request_id: Candidate.of(r, options.best_of) for r in plan.requests}
        self.usage = CallUsage([len(p) for p in plan.prompts], options.output.cached_details)
        # Streamed choices keep their logprob state across chunks.
        self._writers: dict[str, CompletionLogprobsWriter] = {}
        self._texts: dict[str, TokenTexts] = {}

    def _response(self, choices: Sequence[openai_pb2.CompletionChoice], usage: bool) -> openai_pb2.CompleteResponse:
        p = self.plan
        return openai_pb2.CompleteResponse(id=p.id, object="text_completion", created=p.created, model=p.model,
                                           choices=choices, usage=self.usage.pb() if usage else None)

    async def respond(self, outputs: AsyncIterator[EngineOutput]) -> AsyncIterator[openai_pb2.CompleteResponse]:
        output = self.plan.options.output
        async for out in outputs:
            self.call.output(out)
            candidate = self.candidates[out.request_id]
            candidate.add(out)
            self.usage.add(candidate, out)
            if output.stream:
                choice = self._chunk(candidate, out)
                if choice is not None:
                    yield self._response([choice], usage=output.continuous_usage)
        if output.stream:
            if output.include_usage:
                yield self._response([], usage=True)
            return
        yield self._response(await asyncio.to_thread(self._merged), usage=True)

    def _chunk(self, candidate: Candidate, out: EngineOutput) -> openai_pb2.CompletionChoice | None:
        """What is new in a streamed choice (best_of == n here, so the choice is the candidate)."""
        options = self.plan.options
        first = candidate.request.request_id not in self._writers
        choice = openai_pb2.CompletionChoice(index=candidate.request.index, text=out.text)
        if first:
            self._writers[candidate.request.request_id] = CompletionLogprobsWriter(self.engine.tokenizer)
            choice.text = self.plan.echo_texts[candidate.prompt] + out.text
            if options.output.return_token_ids:
                choice.prompt_token_ids.extend(candidate.request.prompt_ids)
        if options.logprobs is not None:
            self._write_logprobs(candidate, out.input_logprobs if first else (), out.output_logprobs,
                                 out.token_ids, out.finish is not None, choice.logprobs)
        if options.output.return_token_ids:
            choice.token_ids.extend(out.token_ids)
        set_model_outputs(choice, out.hidden_states, [out.routed_experts] if out.routed_experts else [],
                          self.engine.model_info.experts)
        set_finish(choice, out.finish)
        has_logprobs = choice.HasField("logprobs") and len(choice.logprobs.tokens) > 0
        if not (first or choice.text or choice.token_ids or has_logprobs or has_model_outputs(choice)
                or out.finish is not None):
            return None
        return choice

    def _write_logprobs(self, candidate: Candidate, prompt_positions: Sequence[PositionLogprobs],
                        output_positions: Sequence[PositionLogprobs],
                        token_ids: Sequence[int], last: bool, into: openai_pb2.CompletionLogprobs) -> None:
        request_id = candidate.request.request_id
        writer = self._writers.setdefault(request_id, CompletionLogprobsWriter(self.engine.tokenizer))
        if prompt_positions:
            prompt_ids = [p.chosen.token_id for p in prompt_positions]
            writer.write(prompt_positions, TokenTexts.for_prompt(self.engine.tokenizer).add(prompt_ids, last=True),
                         into)
            # The prompt's token texts spell the echo text; the completion's start right after it.
            writer.offset = len(self.plan.echo_texts[candidate.prompt])
        texts = self._texts.get(request_id)
        if texts is None:
            texts = self._texts[request_id] = TokenTexts.for_output(
                self.engine.tokenizer, candidate.request.prompt_ids, candidate.request.params)
        writer.write(output_positions, texts.add(token_ids, last), into)

    def _merged(self) -> list[openai_pb2.CompletionChoice]:
        """Every prompt's n best choices (blocking: token texts are decoded here)."""
        options = self.plan.options
        by_prompt: dict[int, list[Candidate]] = {}
        for candidate in self.candidates.values():
            by_prompt.setdefault(candidate.prompt, []).append(candidate)
        choices = []
        for p in sorted(by_prompt):
            for rank, candidate in enumerate(best(sorted(by_prompt[p], key=lambda c: c.number), options.n)):
                choice = openai_pb2.CompletionChoice(
                    index=p * options.n + rank, text=self.plan.echo_texts[p] + candidate.text)
                if options.logprobs is not None:
                    self._write_logprobs(candidate, candidate.input_logprobs if options.echo else (),
                                         candidate.output_logprobs, candidate.token_ids, True, choice.logprobs)
                if options.output.return_token_ids:
                    choice.prompt_token_ids.extend(candidate.request.prompt_ids)
                    choice.token_ids.extend(candidate.token_ids)
                set_model_outputs(choice, candidate.hidden_states, candidate.routed, self.engine.model_info.experts)
                set_finish(choice, candidate.finish)
                choices.append(choice)
        return choices
