"""What the engine sends back: one request's pending tokens, text and logprobs taken into an `EngineOutput`, and the
logprob entries named with their token text when the request asked for it. Pure functions of a `LiveRequest`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmrpc.server.engine import hidden_states, routed_experts
from lmrpc.server.engine.detokenizer import decode_token
from lmrpc.server.engine.live import LiveRequest
from lmrpc.server.engine.sequence import Sequence
from lmrpc.server.engine.types import EngineOutput, EngineRequest, Finish, PositionLogprobs, TokenLogprob, Usage

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def take(live: LiveRequest, finish: Finish | None) -> EngineOutput:
    """Everything pending for `live` (and, once, its prompt logprobs) as one output; the pending lists start over."""
    seq = live.seq
    input_logprobs: tuple[PositionLogprobs, ...] = ()
    if not live.prompt_logprobs_sent and (live.prompt_logprobs or finish is not None or live.pending_tokens):
        input_logprobs = tuple(live.prompt_logprobs)
        live.prompt_logprobs_sent = True
        live.prompt_logprobs = []
    out = EngineOutput(
        request_id=seq.request_id,
        token_ids=tuple(live.pending_tokens),
        text="".join(live.pending_text),
        output_logprobs=tuple(live.pending_logprobs),
        input_logprobs=input_logprobs,
        finish=finish,
        usage=usage(seq) if finish is not None else None,
        hidden_states=hidden_states.take(live, finish is not None),
        routed_experts=routed_experts.take(live),
        scheduled_at=live.scheduled_at,
    )
    live.pending_tokens, live.pending_text, live.pending_logprobs = [], [], []
    return out


def token_text(tokenizer: PreTrainedTokenizerBase, live: LiveRequest, token_id: int) -> str | None:
    """The token's text when the request's logprobs carry text, else None."""
    options = live.request.logprobs
    return decode_token(tokenizer, token_id) if options is not None and options.with_text else None


def with_text(tokenizer: PreTrainedTokenizerBase, live: LiveRequest, entry: PositionLogprobs) -> PositionLogprobs:
    """`entry` with every token named, when the request's logprobs carry text."""
    options = live.request.logprobs
    if options is None or not options.with_text:
        return entry

    def named(t: TokenLogprob) -> TokenLogprob:
        return TokenLogprob(t.token_id, t.logprob, decode_token(tokenizer, t.token_id))

    return PositionLogprobs(
        named(entry.chosen), tuple(named(t) for t in entry.top), tuple(named(t) for t in entry.requested)
    )


def usage(seq: Sequence) -> Usage:
    return Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens)


def final(request: EngineRequest, finish: Finish, seq: Sequence) -> EngineOutput:
    """The only output of a request that ends before it runs (refused, or nothing to generate)."""
    return EngineOutput(request.request_id, finish=finish, usage=usage(seq))
