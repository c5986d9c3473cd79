"""From OpenAI requests to engine requests and back: the fan-out (prompt x candidate), the engine outputs gathered
into candidates, best_of's choice of the best, finish reasons, and the call's usage."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lmrpc.server.engine.types import (
    AdapterRef,
    EngineOutput,
    EngineRequest,
    Finish,
    FinishReason,
    LogprobOptions,
    RoutedExperts,
    SamplingParams,
)
from lmrpc.server.models.types import ExpertsInfo, PromptMedia
from lmrpc.server.openai.validation import ModelOutputs
from lmrpc.server.pipeline import fanout
from lmrpc.server.pipeline.fanout import PromptPlan
from lmrpc.server.pipeline.gather import Gathered
from lmrpc.server.protos import hidden_pb, routed_pb
from lmrpc.v1 import openai_pb2

_STOP_REASONS = (FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.STOP_STRING, FinishReason.STOP_REGEX,
                 FinishReason.GRAMMAR_END)


class EngineFailure(Exception):
    """An output the engine ended with ERROR: the call fails with the engine's message, INVALID_ARGUMENT where the
    request caused it (Finish.request_fault: its grammar, its size), else INTERNAL."""

    def __init__(self, message: str, request_fault: bool) -> None:
        super().__init__(message)
        self.request_fault = request_fault


def engine_requests(rid: str, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], candidates: int,
                    logprobs: LogprobOptions | None, adapter: AdapterRef | None = None,
                    outputs: ModelOutputs | None = None, media: PromptMedia | None = None) -> list[EngineRequest]:
    """`candidates` outputs per prompt, prompt-major (pipeline/fanout.py): prompt p's are "rid/p/c" ("rid/p" for
    one), all under the call's rid."""
    plans = [PromptPlan(request_id=f"{rid}/{p}", rid=rid, prompt_ids=tuple(prompt), params=prompt_params,
                        samples=candidates, logprobs=logprobs, adapter=adapter, prompt_media=media,
                        hidden_states=outputs.hidden_states if outputs is not None else None,
                        routed_experts_from=outputs.routed_experts_from if outputs is not None else None)
             for p, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True))]
    return fanout.engine_requests(plans)


@dataclass
class Candidate(Gathered):
    """One engine output gathered so far (pipeline/gather.py), and where it stands in the call."""

    request: EngineRequest = field(kw_only=True)  # what was asked
    prompt: int = field(kw_only=True)  # the prompt's index in the call
    number: int = field(kw_only=True)  # the candidate's index among its prompt's

    @classmethod
    def of(cls, request: EngineRequest, candidates: int) -> Candidate:
        return cls(request=request, prompt=request.index // candidates, number=request.index % candidates)

    def add(self, out: EngineOutput) -> None:
        if out.finish is not None and out.finish.reason is FinishReason.ERROR:
            raise EngineFailure(out.finish.message or "the engine failed this request", out.finish.request_fault)
        super().add(out)

    @property
    def mean_logprob(self) -> float:
        """best_of's score: the mean logprob of the generated tokens (the stop token included); -inf if none."""
        scores = [p.chosen.logprob for p in self.output_logprobs if p.chosen.logprob is not None]
        return math.fsum(scores) / len(scores) if scores else -math.inf


def set_model_outputs(choice: openai_pb2.CompletionChoice | openai_pb2.ChatChoice, hidden_states: Sequence[bytes],
                      routed: Sequence[RoutedExperts], experts: ExpertsInfo | None) -> None:
    """A choice's hidden states and routed experts (the whole choice's, or a chunk's new ones) as GenerateService
    writes them."""
    choice.hidden_states.extend(hidden_pb(list(hidden_states)))
    pb = routed_pb(list(routed), experts)
    if pb is not None:
        choice.routed_experts.CopyFrom(pb)


def has_model_outputs(choice: openai_pb2.CompletionChoice | openai_pb2.ChatChoice) -> bool:
    return len(choice.hidden_states) > 0 or choice.HasField("routed_experts")


def best(candidates: Sequence[Candidate], n: int) -> list[Candidate]:
    """The n candidates with the highest mean token logprob, best first (ties: the earlier candidate)."""
    if len(candidates) == n:
        return list(candidates)
    return sorted(candidates, key=lambda c: (-c.mean_logprob, c.number))[:n]


def finish_reason(finish: Finish | None) -> openai_pb2.CompletionFinishReason.ValueType:
    if finish is None:
        return openai_pb2.COMPLETION_FINISH_REASON_UNSPECIFIED
    if finish.reason in _STOP_REASONS:
        return openai_pb2.COMPLETION_FINISH_REASON_STOP
    if finish.reason is FinishReason.LENGTH:
        return openai_pb2.COMPLETION_FINISH_REASON_LENGTH
    return openai_pb2.COMPLETION_FINISH_REASON_ABORT  # ERROR never gets here: it fails the call


def set_finish(choice: openai_pb2.CompletionChoice | openai_pb2.ChatChoice, finish: Finish | None) -> None:
    """finish_reason, and matched_stop for the stop reasons."""
    choice.finish_reason = finish_reason(finish)
    if finish is None or finish.reason not in _STOP_REASONS:
        return
    if finish.matched_token_id is not None:
        choice.matched_stop_token_id = finish.matched_token_id
    elif finish.matched_text is not None:
        choice.matched_stop_text = finish.matched_text


class CallUsage:
    """The call's token counts: each prompt once, every generated token (best_of's discarded candidates too)."""

    def __init__(self, prompt_lengths: Sequence[int], details: bool) -> None:
        self.prompt_tokens = sum(prompt_lengths)
        self.completion_tokens = 0
        self._cached: dict[int, int] = {}  # prompt index -> cached tokens of its candidate 0
        self._details = details  # report where cached tokens were kept

    def add(self, candidate: Candidate, out: EngineOutput) -> None:
        self.completion_tokens += len(out.token_ids)
        if out.usage is not None and candidate.number == 0:
            # Candidates 1.. are prefix-cache hits of candidate 0 by design: the prompt's figure is candidate 0's.
            self._cached[candidate.prompt] = out.usage.cached_tokens

    def pb(self) -> openai_pb2.CompletionUsage:
        cached = sum(self._cached.values())
        details = openai_pb2.PromptTokensDetails(cached_tokens=cached)
        if self._details:
            details.cached_tokens_details.CopyFrom(openai_pb2.CachedTokensDetails(device=cached, host=0))
        return openai_pb2.CompletionUsage(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens, prompt_tokens_details=details)
