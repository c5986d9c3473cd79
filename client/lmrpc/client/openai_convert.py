"""Python values in OpenAI's shapes -> lmrpc.v1 CompleteRequest / ChatCompleteRequest.

The keyword arguments of Client.complete and Client.chat are the requests' fields, spelled and shaped as in
OpenAI's JSON: a prompt may be a string, strings, token ids or lists of token ids; stop a string or strings;
tool_choice "auto" or {"type": "function", "function": {"name": ...}}; a message's content a string or a list of
parts. They are normalized to the proto's shapes and parsed with protobuf's JSON parser, so an unknown name or a
wrong type is a ValueError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, Union

from google.protobuf import json_format

from lmrpc.v1 import openai_pb2

Prompt = Union[str, Sequence[str], Sequence[int], Sequence[Sequence[int]]]  # noqa: UP007 (runtime alias, py3.10)
MessageLike = Union[Mapping[str, Any], openai_pb2.ChatMessage]  # noqa: UP007


class _SamplingFields(TypedDict, total=False):
    """The fields both requests share (see proto/lmrpc/v1/openai.proto for defaults and ranges)."""

    model: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    n: int
    seed: int
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    response_format: Mapping[str, Any]
    json_schema: str | Mapping[str, Any]
    regex: str
    ebnf: str
    stream_options: Mapping[str, bool]
    logit_bias: Mapping[int, float]
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    stop_regex: Sequence[str]
    min_tokens: int
    lora_path: str
    return_hidden_states: bool
    hidden_states_mode: str | int  # "HIDDEN_STATES_MODE_LAST" (or its number): the last position only
    return_routed_experts: bool
    routed_experts_start_len: int
    return_cached_tokens_details: bool
    return_token_ids: bool
    json_whitespace_flexible: bool
    rid: str
    priority: int


class CompleteParams(_SamplingFields, total=False):
    """Client.complete's keyword arguments: CompleteRequest's fields."""

    suffix: str
    echo: bool
    logprobs: int
    best_of: int


class ChatParams(_SamplingFields, total=False):
    """Client.chat's keyword arguments: ChatCompleteRequest's fields."""

    max_completion_tokens: int
    logprobs: bool
    top_logprobs: int
    tools: Sequence[Mapping[str, Any]]
    tool_choice: str | Mapping[str, Any]
    parallel_tool_calls: bool
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: Mapping[str, Any]


def build_complete_request(prompt: Prompt, params: Mapping[str, Any], stream: bool) -> openai_pb2.CompleteRequest:
    payload = _common(params, stream)
    items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
    if not items:
        raise ValueError("prompt must not be empty")
    if all(isinstance(p, str) for p in items):
        payload["prompt"] = items
    elif all(isinstance(p, int) for p in items):
        payload["prompt_token_ids"] = [{"ids": items}]  # one prompt of token ids
    elif all(isinstance(p, Sequence) and not isinstance(p, str) and all(isinstance(t, int) for t in p)
             for p in items):
        payload["prompt_token_ids"] = [{"ids": list(p)} for p in items]
    else:
        raise TypeError("prompt must be a string, strings, token ids, or lists of token ids")
    return _parse(payload, openai_pb2.CompleteRequest())


def build_chat_request(messages: str | Sequence[MessageLike], params: Mapping[str, Any],
                       stream: bool) -> openai_pb2.ChatCompleteRequest:
    """A lone string is one user message."""
    payload = _common(params, stream)
    listed = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
    payload["messages"] = [_message(m) for m in listed]
    choice = payload.get("tool_choice")
    if isinstance(choice, str):
        payload["tool_choice"] = {"type": choice}  # OpenAI's string forms
    return _parse(payload, openai_pb2.ChatCompleteRequest())


def message_dict(message: MessageLike) -> dict[str, Any]:
    """A message in OpenAI's JSON form (what chat() takes back, e.g. an answer appended to the history)."""
    if isinstance(message, openai_pb2.ChatMessage):
        return json_format.MessageToDict(message, preserving_proto_field_name=True)
    return dict(message)


def _common(params: Mapping[str, Any], stream: bool) -> dict[str, Any]:
    payload = {k: v for k, v in params.items() if v is not None}
    if isinstance(payload.get("stop"), str):
        payload["stop"] = [payload["stop"]]
    if isinstance(payload.get("json_schema"), Mapping):
        payload["json_schema"] = json.dumps(payload["json_schema"])
    if "logit_bias" in payload:
        payload["logit_bias"] = {str(k): v for k, v in payload["logit_bias"].items()}
    payload["stream"] = stream
    return payload


def _message(message: MessageLike) -> dict[str, Any]:
    m = message_dict(message)
    content = m.get("content")
    if content is None:
        m.pop("content", None)
    elif not isinstance(content, str):  # OpenAI's list of parts
        m["content_parts"] = list(content)
        del m["content"]
    return m


def _parse(payload: dict[str, Any], into: Any) -> Any:
    try:
        return json_format.ParseDict(payload, into)
    except json_format.ParseError as e:  # unknown field, wrong type: name it as protobuf does
        raise ValueError(str(e)) from None
