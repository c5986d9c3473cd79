"""The engine's domain types as lmrpc.v1 messages: the conversions GenerateService and OpenAIService both write
(logprobs, hidden states, routed experts, finish and usage, adapters). No service owns them, so neither service
imports the other."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lmrpc.server.engine.types import Finish, PositionLogprobs, RoutedExperts, TokenLogprob, Usage
from lmrpc.server.lora.registry import AdapterInfo
from lmrpc.server.models.types import ExpertsInfo
from lmrpc.v1 import generate_pb2


def token_pb(t: TokenLogprob) -> generate_pb2.TokenLogprob:
    pb = generate_pb2.TokenLogprob(token_id=t.token_id, text=t.text or "")
    if t.logprob is not None:
        pb.logprob = t.logprob
    return pb


def position_pb(p: PositionLogprobs) -> generate_pb2.PositionLogprobs:
    return generate_pb2.PositionLogprobs(
        chosen=token_pb(p.chosen), top=[token_pb(t) for t in p.top], requested=[token_pb(t) for t in p.requested]
    )


def hidden_pb(rows: Sequence[bytes]) -> list[generate_pb2.Embedding]:
    """float32 little-endian rows -> Embedding messages (the values as sent: float32 on the wire too)."""
    return [generate_pb2.Embedding(values=np.frombuffer(r, dtype="<f4").tolist()) for r in rows]


def routed_pb(pieces: Sequence[RoutedExperts], info: ExpertsInfo | None) -> generate_pb2.RoutedExperts | None:
    """Consecutive pieces -> one RoutedExperts message [positions, moe layers, top_k] (None: no pieces)."""
    if not pieces or info is None:
        return None
    rows = sum(p.num_positions for p in pieces)
    return generate_pb2.RoutedExperts(data=b"".join(p.data for p in pieces), shape=[rows, info.num_layers, info.top_k],
                                      start_position=pieces[0].start_position)


def set_finish(msg: generate_pb2.GenerateResponse, finish: Finish | None, usage: Usage | None) -> None:
    """A GenerateResponse's finish (reason, message, what matched) and usage, where the output has them."""
    if finish is not None:
        msg.finish.reason = finish.reason.value  # type: ignore[assignment]
        msg.finish.message = finish.message
        if finish.matched_token_id is not None:
            msg.finish.matched_token_id = finish.matched_token_id
        elif finish.matched_text is not None:
            msg.finish.matched_text = finish.matched_text
    if usage is not None:
        msg.usage.CopyFrom(generate_pb2.Usage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens))


def adapter_pb(a: AdapterInfo) -> generate_pb2.LoraAdapter:
    return generate_pb2.LoraAdapter(name=a.name, path=a.path, rank=a.rank, scale=a.scale,
                                    target_modules=a.target_modules, in_use=a.in_use)
