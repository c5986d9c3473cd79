"""Typed results of the lmrpc client: plain dataclasses decoded from the lmrpc.v1 messages.

Users of the client never need to touch protobuf objects: every RPC answer is turned into one of these.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from lmrpc.v1 import generate_pb2


class FinishReason(enum.Enum):
    """Why an output ended (mirrors lmrpc.v1.FinishReason; the values are the wire numbers)."""

    UNSPECIFIED = 0  # not finished yet
    LENGTH = 1  # max_new_tokens reached, or the context is full
    EOS = 2  # the model's end-of-sequence token
    STOP_TOKEN = 3  # one of stop_token_ids
    STOP_STRING = 4  # one of the stop strings
    STOP_REGEX = 5  # one of the stop regular expressions
    GRAMMAR_END = 6  # the structured-output grammar is complete
    ABORT = 7  # aborted, cancelled, deadline passed or server shutdown
    ERROR = 8  # the request failed inside the server

    @classmethod
    def from_pb(cls, value: int) -> FinishReason:
        try:
            return cls(value)
        except ValueError:  # a newer server's reason this client does not know yet
            return cls.UNSPECIFIED


class ServingStatus(enum.Enum):
    """grpc.health.v1 serving status (the values are the wire numbers)."""

    UNKNOWN = 0
    SERVING = 1
    NOT_SERVING = 2
    SERVICE_UNKNOWN = 3


@dataclass(frozen=True)
class Finish:
    """Why one output ended, and what matched."""

    reason: FinishReason  # the reason
    matched: int | str | None = None  # the token id (EOS / stop token) or the stop string / regex pattern
    message: str = ""  # explanation, set for ERROR and ABORT

    @classmethod
    def from_pb(cls, pb: generate_pb2.Finish) -> Finish:
        which = pb.WhichOneof("matched")
        matched: int | str | None = None
        if which == "matched_token_id":
            matched = pb.matched_token_id
        elif which == "matched_text":
            matched = pb.matched_text
        return cls(reason=FinishReason.from_pb(pb.reason), matched=matched, message=pb.message)


@dataclass(frozen=True)
class Usage:
    """Token counts of one output."""

    prompt_tokens: int  # prompt as tokenized, special tokens included
    completion_tokens: int  # generated tokens, a stop token included
    cached_tokens: int  # prompt tokens served from the prefix cache

    @classmethod
    def from_pb(cls, pb: generate_pb2.Usage) -> Usage:
        return cls(prompt_tokens=pb.prompt_tokens, completion_tokens=pb.completion_tokens,
                   cached_tokens=pb.cached_tokens)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability."""

    token_id: int  # the token
    logprob: float | None  # natural-log probability; None where nothing predicts the position
    text: str = ""  # the token decoded on its own, when return_text_in_logprobs was set

    @classmethod
    def from_pb(cls, pb: generate_pb2.TokenLogprob) -> TokenLogprob:
        return cls(token_id=pb.token_id, logprob=pb.logprob if pb.HasField("logprob") else None, text=pb.text)


@dataclass(frozen=True)
class PositionLogprobs:
    """The logprobs at one position."""

    chosen: TokenLogprob | None  # the token at this position
    top: list[TokenLogprob] = field(default_factory=list)  # top_logprobs_num best alternatives, best first
    requested: list[TokenLogprob] = field(default_factory=list)  # the token_ids_logprob ids, in request order

    @classmethod
    def from_pb(cls, pb: generate_pb2.PositionLogprobs) -> PositionLogprobs:
        return cls(
            chosen=TokenLogprob.from_pb(pb.chosen) if pb.HasField("chosen") else None,
            top=[TokenLogprob.from_pb(t) for t in pb.top],
            requested=[TokenLogprob.from_pb(t) for t in pb.requested],
        )


@dataclass(frozen=True)
class GenerateDelta:
    """One streamed message: what is new for one output index."""

    index: int  # output index, prompt-major: prompt_index * n + sample_index
    rid: str  # request id of the prompt this output belongs to
    text: str  # new text
    token_ids: list[int]  # new token ids
    output_logprobs: list[PositionLogprobs]  # logprobs of the new tokens (return_logprob)
    input_logprobs: list[PositionLogprobs]  # prompt logprobs, on an index's first message only
    finish: Finish | None  # set on an index's last message only
    usage: Usage | None  # set on an index's last message only

    @classmethod
    def from_pb(cls, pb: generate_pb2.GenerateResponse) -> GenerateDelta:
        return cls(
            index=pb.index,
            rid=pb.rid,
            text=pb.text,
            token_ids=list(pb.token_ids),
            output_logprobs=[PositionLogprobs.from_pb(p) for p in pb.output_logprobs],
            input_logprobs=[PositionLogprobs.from_pb(p) for p in pb.input_logprobs],
            finish=Finish.from_pb(pb.finish) if pb.HasField("finish") else None,
            usage=Usage.from_pb(pb.usage) if pb.HasField("usage") else None,
        )


@dataclass
class GenerateResult:
    """One complete output (one prompt x one sample)."""

    index: int  # output index, prompt-major: prompt_index * n + sample_index
    rid: str  # request id of the prompt
    text: str = ""  # the whole output text
    token_ids: list[int] = field(default_factory=list)  # all output token ids, a stop token included
    finish: Finish = field(default_factory=lambda: Finish(FinishReason.UNSPECIFIED))  # why it ended
    usage: Usage | None = None  # token counts (None only if the stream broke off)
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)  # per output token
    input_logprobs: list[PositionLogprobs] = field(default_factory=list)  # per prompt position from logprob_start_len

    @property
    def finish_reason(self) -> FinishReason:
        return self.finish.reason

    def add(self, delta: GenerateDelta) -> None:
        """Append a streamed delta (or take a complete message) for this index."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.output_logprobs.extend(delta.output_logprobs)
        self.input_logprobs.extend(delta.input_logprobs)
        if delta.finish is not None:
            self.finish = delta.finish
        if delta.usage is not None:
            self.usage = delta.usage


def merge(deltas: Iterable[GenerateDelta]) -> list[GenerateResult]:
    """Merge the messages of a Generate stream (streamed deltas or complete messages) into one result per index,
    ordered by index."""
    by_index: dict[int, GenerateResult] = {}
    for delta in deltas:
        result = by_index.get(delta.index)
        if result is None:
            result = by_index[delta.index] = GenerateResult(index=delta.index, rid=delta.rid)
        result.add(delta)
    return [by_index[i] for i in sorted(by_index)]


@dataclass(frozen=True)
class ModelInfo:
    """The served model's description."""

    model_path: str  # where the weights were loaded from
    served_model_name: str  # the name clients may show
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_context_length: int  # longest prompt + output, in tokens
    eos_token_ids: list[int]  # end-of-sequence token ids
    default_sampling_params: dict[str, Any]  # the resolved defaults, keyed by SamplingParams field name
    architecture: str  # e.g. "LlamaForCausalLM"
    dtype: str  # e.g. "bfloat16"
    device: str  # e.g. "cpu"
    quantization: str = "none"  # how the linear weights are stored: "none", "int8" or "int4"
    weight_formats: list[str] = field(default_factory=list)  # e.g. ["q4_1", "q8_0"]
    lora_adapters: list[str] = field(default_factory=list)  # names of the loaded LoRA adapters (list_lora_adapters)
    # What one request may ask for, keyed by RequestLimits field name (e.g. "max_logit_bias"); empty from servers
    # that do not report them
    limits: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, pb: generate_pb2.GetModelInfoResponse) -> ModelInfo:
        defaults = json_format.MessageToDict(pb.default_sampling_params, preserving_proto_field_name=True)
        return cls(
            model_path=pb.model_path,
            served_model_name=pb.served_model_name,
            vocab_size=pb.vocab_size,
            max_context_length=pb.max_context_length,
            eos_token_ids=list(pb.eos_token_ids),
            default_sampling_params=defaults,
            architecture=pb.architecture,
            dtype=pb.dtype,
            device=pb.device,
            quantization=pb.quantization or "none",
            weight_formats=list(pb.weight_formats),
            lora_adapters=[a.name for a in pb.lora_adapters],
            limits={f.name: getattr(pb.limits, f.name) for f in pb.limits.DESCRIPTOR.fields}
            if pb.HasField("limits") else {},
        )


@dataclass(frozen=True)
class Load:
    """How loaded the server is (GetLoad): now, and over the last minute."""

    running_outputs: int  # outputs holding KV-cache pages (paused ones included)
    waiting_outputs: int  # outputs waiting for admission (preempted ones included)
    paused_outputs: int  # outputs not scheduled because their client is not reading
    kv_cache_usage: float  # share of KV pages held by live outputs, [0, 1]
    kv_cache_pages: int  # pages in the KV cache
    kv_cache_used_pages: int  # pages held by live outputs
    generation_tokens_per_second: float  # over the last minute
    prompt_tokens_per_second: float  # prompt tokens computed, over the last minute
    queue_time_p50_seconds: float  # median arrival -> first step, over the last minute
    resident_memory_bytes: int  # the server process's RSS
    memory_limit_bytes: int  # the container's memory limit, else the host's available memory at start; 0: unknown
    max_running_outputs: int  # --max-running-requests

    @classmethod
    def from_pb(cls, pb: generate_pb2.GetLoadResponse) -> Load:
        return cls(**{f.name: getattr(pb, f.name) for f in dataclasses.fields(cls)})
