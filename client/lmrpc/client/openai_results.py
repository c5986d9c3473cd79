"""Typed results of Client.complete and Client.chat: completions, chat completions and their streamed chunks, decoded
from the lmrpc.v1 OpenAIService messages, and the merging of chunks into the answer they add up to."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from lmrpc.v1 import openai_pb2


class CompletionFinishReason(enum.Enum):
    """Why a choice ended (the values are the wire numbers of lmrpc.v1.CompletionFinishReason)."""

    UNSPECIFIED = 0  # not finished: a streamed chunk before the choice's last
    STOP = 1  # end of sequence, a stop string/token/regex, or complete structured output
    LENGTH = 2  # max_tokens reached, or the context is full
    TOOL_CALLS = 3  # the answer calls tools
    ABORT = 4  # aborted

    @classmethod
    def from_pb(cls, value: int) -> CompletionFinishReason:
        try:
            return cls(value)
        except ValueError:  # a newer server's reason
            return cls.UNSPECIFIED


def _matched(pb: openai_pb2.CompletionChoice | openai_pb2.ChatChoice) -> int | str | None:
    which = pb.WhichOneof("matched_stop")
    return None if which is None else getattr(pb, which)


@dataclass(frozen=True)
class CompletionUsage:
    """Token counts of a whole call."""

    prompt_tokens: int  # each prompt once
    completion_tokens: int  # every generated token (best_of's discarded candidates too)
    total_tokens: int  # the sum
    cached_tokens: int  # prompt tokens served from the prefix cache
    cached_tokens_details: dict[str, int] | None = None  # {"device": n, "host": n}, when asked for

    @classmethod
    def from_pb(cls, pb: openai_pb2.CompletionUsage) -> CompletionUsage:
        details = pb.prompt_tokens_details
        where = ({"device": details.cached_tokens_details.device, "host": details.cached_tokens_details.host}
                 if details.HasField("cached_tokens_details") else None)
        return cls(pb.prompt_tokens, pb.completion_tokens, pb.total_tokens, details.cached_tokens, where)


@dataclass
class CompletionLogprobs:
    """OpenAI's completions logprobs: one entry per token in each list."""

    tokens: list[str] = field(default_factory=list)  # the text each token adds to the choice's text
    token_logprobs: list[float | None] = field(default_factory=list)  # None: the first echoed prompt token
    top_logprobs: list[dict[str, float]] = field(default_factory=list)  # alternatives, token text -> logprob
    text_offset: list[int] = field(default_factory=list)  # where each token's text starts in the choice's text

    @classmethod
    def from_pb(cls, pb: openai_pb2.CompletionLogprobs) -> CompletionLogprobs:
        return cls(
            tokens=list(pb.tokens),
            token_logprobs=[None if v.WhichOneof("kind") == "null_value" else v.number_value
                            for v in pb.token_logprobs],
            top_logprobs=[{k: float(v) for k, v in json_format.MessageToDict(s).items()} for s in pb.top_logprobs],
            text_offset=list(pb.text_offset),
        )

    def extend(self, other: CompletionLogprobs) -> None:
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset


@dataclass
class CompletionChoice:
    """One completion (or, in a chunk, what is new in it)."""

    index: int  # prompt * n + i
    text: str = ""  # the text (a chunk: the new text)
    finish_reason: CompletionFinishReason = CompletionFinishReason.UNSPECIFIED  # set once finished
    matched_stop: int | str | None = None  # the token id or stop text that ended it
    logprobs: CompletionLogprobs | None = None  # with logprobs
    token_ids: list[int] = field(default_factory=list)  # with return_token_ids
    prompt_token_ids: list[int] = field(default_factory=list)  # with return_token_ids

    @classmethod
    def from_pb(cls, pb: openai_pb2.CompletionChoice) -> CompletionChoice:
        return cls(index=pb.index, text=pb.text, finish_reason=CompletionFinishReason.from_pb(pb.finish_reason),
                   matched_stop=_matched(pb),
                   logprobs=CompletionLogprobs.from_pb(pb.logprobs) if pb.HasField("logprobs") else None,
                   token_ids=list(pb.token_ids), prompt_token_ids=list(pb.prompt_token_ids))

    def add(self, chunk: CompletionChoice) -> None:
        self.text += chunk.text
        if chunk.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = CompletionLogprobs()
            self.logprobs.extend(chunk.logprobs)
        self.token_ids += chunk.token_ids
        self.prompt_token_ids += chunk.prompt_token_ids
        if chunk.finish_reason is not CompletionFinishReason.UNSPECIFIED:
            self.finish_reason, self.matched_stop = chunk.finish_reason, chunk.matched_stop


@dataclass
class Completion:
    """A completion, or one streamed chunk of it."""

    id: str  # "cmpl-..."
    object: str  # "text_completion"
    created: int  # seconds since the epoch
    model: str  # the served model
    choices: list[CompletionChoice]  # prompt-major (a chunk: one, or none in a usage chunk)
    usage: CompletionUsage | None  # whole call (chunks: with stream_options)

    @classmethod
    def from_pb(cls, pb: openai_pb2.CompleteResponse) -> Completion:
        return cls(pb.id, pb.object, pb.created, pb.model, [CompletionChoice.from_pb(c) for c in pb.choices],
                   CompletionUsage.from_pb(pb.usage) if pb.HasField("usage") else None)


def merge_completion(chunks: Iterable[Completion]) -> Completion:
    """The completion that streamed chunks (or one complete message) add up to; choices ordered by index."""
    merged: Completion | None = None
    by_index: dict[int, CompletionChoice] = {}
    for chunk in chunks:
        if merged is None:
            merged = Completion(chunk.id, chunk.object, chunk.created, chunk.model, [], None)
        for c in chunk.choices:
            by_index.setdefault(c.index, CompletionChoice(c.index)).add(c)
        merged.usage = chunk.usage or merged.usage
    if merged is None:
        raise ValueError("no messages to merge")
    merged.choices = [by_index[i] for i in sorted(by_index)]
    return merged


@dataclass
class FunctionCall:
    """The function a tool call calls."""

    name: str  # the function's name
    arguments: str  # JSON text of its arguments


@dataclass
class ToolCall:
    """One call made by the assistant."""

    index: int  # its position among the message's calls
    id: str  # quoted by the tool message that answers it
    function: FunctionCall  # what is called
    type: str = "function"  # always "function"


@dataclass
class ChatMessage:
    """A message of the answer (or, in a chunk, what is new in it)."""

    role: str = ""  # "assistant" (a chunk: only on the first)
    content: str | None = None  # None: no text (an answer that only calls tools)
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls made

    @classmethod
    def from_pb(cls, pb: openai_pb2.ChatMessage) -> ChatMessage:
        return cls(pb.role, pb.content if pb.HasField("content") else None,
                   [ToolCall(c.index, c.id, FunctionCall(c.function.name, c.function.arguments), c.type or "function")
                    for c in pb.tool_calls])

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's JSON form, to send back as part of the conversation."""
        message: dict[str, Any] = {"role": self.role or "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                                                "arguments": c.function.arguments}}
                                     for c in self.tool_calls]
        return message

    def add(self, delta: ChatMessage) -> None:
        self.role = self.role or delta.role
        if delta.content is not None:
            self.content = (self.content or "") + delta.content
        for call in delta.tool_calls:
            known = next((c for c in self.tool_calls if c.index == call.index), None)
            if known is None:
                self.tool_calls.append(ToolCall(call.index, call.id, FunctionCall(call.function.name,
                                                                                  call.function.arguments), call.type))
            else:  # a later delta of the same call: more of its arguments
                known.id = known.id or call.id
                known.function.name = known.function.name or call.function.name
                known.function.arguments += call.function.arguments


@dataclass(frozen=True)
class ChatTopLogprob:
    """An alternative at one position."""

    token: str  # decoded on its own
    logprob: float  # its logprob
    bytes: bytes  # its own bytes


@dataclass(frozen=True)
class ChatTokenLogprob:
    """A generated token's logprob and alternatives."""

    token: str  # the text it adds to the content
    logprob: float  # its logprob
    bytes: bytes  # its own bytes
    top_logprobs: list[ChatTopLogprob]  # best first

    @classmethod
    def from_pb(cls, pb: openai_pb2.ChatTokenLogprob) -> ChatTokenLogprob:
        return cls(pb.token, pb.logprob, pb.bytes, [ChatTopLogprob(t.token, t.logprob, t.bytes)
                                                    for t in pb.top_logprobs])


@dataclass
class ChatChoice:
    """One answer (a chunk: what is new in it, in `delta`)."""

    index: int  # in [0, n)
    message: ChatMessage = field(default_factory=ChatMessage)  # the answer (merged)
    delta: ChatMessage | None = None  # a chunk's new part (None in a complete answer)
    finish_reason: CompletionFinishReason = CompletionFinishReason.UNSPECIFIED  # set once finished
    matched_stop: int | str | None = None  # the token id or stop text that ended it
    logprobs: list[ChatTokenLogprob] | None = None  # with logprobs
    token_ids: list[int] = field(default_factory=list)  # with return_token_ids
    prompt_token_ids: list[int] = field(default_factory=list)  # with return_token_ids

    @classmethod
    def from_pb(cls, pb: openai_pb2.ChatChoice) -> ChatChoice:
        return cls(
            index=pb.index, message=ChatMessage.from_pb(pb.message),
            delta=ChatMessage.from_pb(pb.delta) if pb.HasField("delta") else None,
            finish_reason=CompletionFinishReason.from_pb(pb.finish_reason), matched_stop=_matched(pb),
            logprobs=[ChatTokenLogprob.from_pb(t) for t in pb.logprobs.content] if pb.HasField("logprobs") else None,
            token_ids=list(pb.token_ids), prompt_token_ids=list(pb.prompt_token_ids),
        )

    def add(self, chunk: ChatChoice) -> None:
        self.message.add(chunk.delta if chunk.delta is not None else chunk.message)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        self.token_ids += chunk.token_ids
        self.prompt_token_ids += chunk.prompt_token_ids
        if chunk.finish_reason is not CompletionFinishReason.UNSPECIFIED:
            self.finish_reason, self.matched_stop = chunk.finish_reason, chunk.matched_stop


@dataclass
class ChatCompletion:
    """A chat completion, or one streamed chunk of it."""

    id: str  # "chatcmpl-..."
    object: str  # "chat.completion" or "chat.completion.chunk"
    created: int  # seconds since the epoch
    model: str  # the served model
    choices: list[ChatChoice]  # by index (a chunk: one, or none in a usage chunk)
    usage: CompletionUsage | None  # whole call (chunks: with stream_options)

    @classmethod
    def from_pb(cls, pb: openai_pb2.ChatCompleteResponse) -> ChatCompletion:
        return cls(pb.id, pb.object, pb.created, pb.model, [ChatChoice.from_pb(c) for c in pb.choices],
                   CompletionUsage.from_pb(pb.usage) if pb.HasField("usage") else None)

    @property
    def content(self) -> str | None:
        """The first choice's text."""
        return self.choices[0].message.content if self.choices else None


def merge_chat(chunks: Iterable[ChatCompletion]) -> ChatCompletion:
    """The chat completion that streamed chunks (or one complete message) add up to."""
    merged: ChatCompletion | None = None
    by_index: dict[int, ChatChoice] = {}
    for chunk in chunks:
        if merged is None:
            merged = ChatCompletion(chunk.id, "chat.completion", chunk.created, chunk.model, [], None)
        for c in chunk.choices:
            by_index.setdefault(c.index, ChatChoice(c.index)).add(c)
        merged.usage = chunk.usage or merged.usage
    if merged is None:
        raise ValueError("no messages to merge")
    merged.choices = [by_index[i] for i in sorted(by_index)]
    return merged
