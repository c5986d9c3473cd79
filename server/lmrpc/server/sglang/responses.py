"""lmrpc's `EngineOutput` deltas -> SMG's GenerateResponse messages.

Streamed, each delta with tokens is a `GenerateStreamChunk` (its new token ids, cumulative counts, its output index),
and each output ends with one `GenerateComplete` carrying all its tokens, logprobs and counts; merged (stream
unset), each output is one `GenerateComplete`. SGLang's finish reasons are strings: every way lmrpc stops a
sequence on a token, a string, a pattern or a grammar is "stop", with the token that ended it in
`matched_token_id` (`matched_stop_str` for a string); an engine error is the call's status, not a finish reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as sgl

from lmrpc.server.engine.types import EngineOutput, Finish, FinishReason, PositionLogprobs, TokenLogprob
from lmrpc.server.pipeline.gather import Gathered

_REASONS = {FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}  # every other reason is "stop"


class OutputFailed(Exception):
    """An output ended in an engine error: the call ends with this status (the request's own fault:
    INVALID_ARGUMENT, which SMG answers 400; else INTERNAL)."""

    def __init__(self, finish: Finish) -> None:
        super().__init__(finish.message or "generation failed")
        self.code = grpc.StatusCode.INVALID_ARGUMENT if finish.request_fault else grpc.StatusCode.INTERNAL


def _top(entries: Sequence[TokenLogprob]) -> sgl.TopLogProbs:
    return sgl.TopLogProbs(values=[t.logprob if t.logprob is not None else 0.0 for t in entries],
                           token_ids=[t.token_id for t in entries])


def output_logprobs(positions: Sequence[PositionLogprobs]) -> sgl.OutputLogProbs | None:
    """One entry per output token: its logprob, its top alternatives, the requested ids' logprobs (None: none)."""
    if not positions:
        return None
    return sgl.OutputLogProbs(
        token_logprobs=[p.chosen.logprob if p.chosen.logprob is not None else 0.0 for p in positions],
        token_ids=[p.chosen.token_id for p in positions],
        top_logprobs=[_top(p.top) for p in positions],
        token_ids_logprobs=[_top(p.requested) for p in positions if p.requested],
    )


def input_logprobs(positions: Sequence[PositionLogprobs]) -> sgl.InputLogProbs | None:
    """Prompt logprobs from logprob_start_len on; the first prompt token's is absent (nothing predicts it)."""
    if not positions:
        return None
    return sgl.InputLogProbs(
        token_logprobs=[sgl.InputTokenLogProb() if p.chosen.logprob is None
                        else sgl.InputTokenLogProb(value=p.chosen.logprob) for p in positions],
        token_ids=[p.chosen.token_id for p in positions],
        top_logprobs=[_top(p.top) for p in positions],
    )


@dataclass
class OutputState(Gathered):
    """What one output index has produced so far (pipeline/gather.py), and where it stands in the call."""

    index: int = field(kw_only=True)  # the output index (sample) in the call
    prompt_tokens: int = field(kw_only=True)  # the prompt's length


def _complete(rid: str, state: OutputState, out: EngineOutput, finish: Finish) -> sgl.GenerateResponse:
    usage = out.usage
    complete = sgl.GenerateComplete(
        output_ids=state.token_ids, finish_reason=_REASONS.get(finish.reason, "stop"),
        prompt_tokens=usage.prompt_tokens if usage is not None else state.prompt_tokens,
        completion_tokens=usage.completion_tokens if usage is not None else len(state.token_ids),
        cached_tokens=usage.cached_tokens if usage is not None else 0,
        output_logprobs=output_logprobs(state.output_logprobs), input_logprobs=input_logprobs(state.input_logprobs),
        index=state.index,
    )
    if finish.matched_token_id is not None:
        complete.matched_token_id = finish.matched_token_id
    elif finish.matched_text is not None:
        complete.matched_stop_str = finish.matched_text
    return sgl.GenerateResponse(request_id=rid, complete=complete)


def responses(rid: str, state: OutputState, out: EngineOutput, stream: bool) -> list[sgl.GenerateResponse]:
    """The messages one delta of `state`'s output makes (after adding it to `state`). Raises OutputFailed for an
    engine error."""
    state.add(out)
    msgs: list[sgl.GenerateResponse] = []
    if stream and (out.token_ids or out.input_logprobs):
        msgs.append(sgl.GenerateResponse(request_id=rid, chunk=sgl.GenerateStreamChunk(
            token_ids=out.token_ids, prompt_tokens=state.prompt_tokens, completion_tokens=len(state.token_ids),
            cached_tokens=out.usage.cached_tokens if out.usage is not None else 0,
            output_logprobs=output_logprobs(out.output_logprobs), input_logprobs=input_logprobs(out.input_logprobs),
            index=state.index)))
    finish = out.finish
    if finish is not None:
        if finish.reason is FinishReason.ERROR:
            raise OutputFailed(finish)
        msgs.append(_complete(rid, state, out, finish))
    return msgs
