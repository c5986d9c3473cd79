"""Issue 12's validation acceptance over a real server: every invalid field of CompleteRequest and ChatCompleteRequest
is answered with its status and a google.rpc.BadRequest naming the field (and the allowed range or values), and
the server keeps serving."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from lmrpc.client import Client
from lmrpc.v1 import openai_pb2, openai_pb2_grpc

pytestmark = pytest.mark.e2e

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
SERVED = "SmolLM2-135M-Instruct"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "Hi"}]

# name: (request JSON in OpenAI's shape, the status, the field the violation names)
COMPLETE_CASES: dict[str, tuple[dict[str, Any], grpc.StatusCode, str]] = {
    "no prompt": ({}, INVALID, "prompt"),
    "prompt and prompt_token_ids": ({"prompt": ["a"], "prompt_token_ids": [{"ids": [1]}]}, INVALID,
                                    "prompt_token_ids"),
    "empty prompt": ({"prompt": ["a", ""]}, INVALID, "prompt[1]"),
    "empty token prompt": ({"prompt_token_ids": [{"ids": []}]}, INVALID, "prompt_token_ids[0]"),
    "token outside vocab": ({"prompt_token_ids": [{"ids": [1, 49152]}]}, INVALID, "prompt_token_ids[0]"),
    "prompt longer than context": ({"prompt_token_ids": [{"ids": [100] * 8200}]}, INVALID, "prompt_token_ids[0]"),
    "max_tokens": ({"prompt": ["a"], "max_tokens": -1}, INVALID, "max_tokens"),
    "temperature": ({"prompt": ["a"], "temperature": -0.5}, INVALID, "temperature"),
    "top_p": ({"prompt": ["a"], "top_p": 0}, INVALID, "top_p"),
    "top_k": ({"prompt": ["a"], "top_k": 0}, INVALID, "top_k"),
    "min_p": ({"prompt": ["a"], "min_p": 1.5}, INVALID, "min_p"),
    "n": ({"prompt": ["a"], "n": 0}, INVALID, "n"),
    "n beyond capacity": ({"prompt": ["a"], "n": 100000}, INVALID, "n"),
    "best_of below n": ({"prompt": ["a"], "n": 3, "best_of": 2}, INVALID, "best_of"),
    "best_of streamed": ({"prompt": ["a"], "best_of": 3, "stream": True}, INVALID, "best_of"),
    "frequency_penalty": ({"prompt": ["a"], "frequency_penalty": 2.5}, INVALID, "frequency_penalty"),
    "presence_penalty": ({"prompt": ["a"], "presence_penalty": -3}, INVALID, "presence_penalty"),
    "repetition_penalty": ({"prompt": ["a"], "repetition_penalty": 2.5}, INVALID, "repetition_penalty"),
    "logprobs": ({"prompt": ["a"], "logprobs": 21}, INVALID, "logprobs"),
    "logit_bias value": ({"prompt": ["a"], "logit_bias": {"5": 200}}, INVALID, "logit_bias"),
    "logit_bias key": ({"prompt": ["a"], "logit_bias": {"49152": 1}}, INVALID, "logit_bias"),
    "empty stop": ({"prompt": ["a"], "stop": [""]}, INVALID, "stop"),
    "stop_token_ids": ({"prompt": ["a"], "stop_token_ids": [-1]}, INVALID, "stop_token_ids"),
    "stop_regex": ({"prompt": ["a"], "stop_regex": ["(unclosed"]}, INVALID, "stop_regex"),
    "min_tokens above max_tokens": ({"prompt": ["a"], "max_tokens": 4, "min_tokens": 8}, INVALID, "min_tokens"),
    "response_format type": ({"prompt": ["a"], "response_format": {"type": "yaml"}}, INVALID,
                             "response_format.type"),
    "json_schema without schema": ({"prompt": ["a"], "response_format": {"type": "json_schema"}}, INVALID,
                                   "response_format.json_schema.schema"),
    "two constraints": ({"prompt": ["a"], "response_format": {"type": "json_object"}, "regex": "a+"}, INVALID,
                        "regex"),
    "json_schema that does not compile": ({"prompt": ["a"], "json_schema": '{"type": "objekt"}'}, INVALID,
                                          "json_schema"),
    "regex that does not compile": ({"prompt": ["a"], "regex": "(abc"}, INVALID, "regex"),
    "json_whitespace_flexible alone": ({"prompt": ["a"], "json_whitespace_flexible": False}, INVALID,
                                       "json_whitespace_flexible"),
    "stream_options without stream": ({"prompt": ["a"], "stream_options": {"include_usage": True}}, INVALID,
                                      "stream_options"),
    "suffix without FIM tokens": ({"prompt": ["a"], "suffix": "b"}, INVALID, "suffix"),
    "unknown model": ({"prompt": ["a"], "model": "gpt-4"}, NOT_FOUND, "model"),
    "LoRA adapter": ({"prompt": ["a"], "model": f"{SERVED}:my-adapter"}, NOT_FOUND, "model"),
    "lora_path not loaded": ({"prompt": ["a"], "lora_path": "/adapters/a"}, NOT_FOUND, "lora_path"),
    "lora_path and model disagree": ({"prompt": ["a"], "model": f"{SERVED}:x", "lora_path": "y"}, INVALID,
                                     "lora_path"),
    "hidden_states_mode without return_hidden_states": ({"prompt": ["a"], "hidden_states_mode":
                                                         "HIDDEN_STATES_MODE_LAST"}, INVALID, "hidden_states_mode"),
    "return_routed_experts on a dense model": ({"prompt": ["a"], "return_routed_experts": True}, INVALID,
                                               "return_routed_experts"),
    "routed_experts_start_len without return_routed_experts": ({"prompt": ["a"], "routed_experts_start_len": 0},
                                                               INVALID, "routed_experts_start_len"),
}

CHAT_CASES: dict[str, tuple[dict[str, Any], grpc.StatusCode, str]] = {
    "no messages": ({}, INVALID, "messages"),
    "role": ({"messages": [{"role": "robot", "content": "Hi"}]}, INVALID, "messages[0].role"),
    "content and parts": ({"messages": [{"role": "user", "content": "a", "content_parts": [
        {"type": "text", "text": "b"}]}]}, INVALID, "messages[0].content_parts"),
    "part type": ({"messages": [{"role": "user", "content_parts": [{"type": "audio"}]}]}, INVALID,
                  "messages[0].content_parts[0].type"),
    "image part on a text-only model": ({"messages": [{"role": "user", "content_parts": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, INVALID,
        "messages[0].content_parts[0]"),
    "audio part on a text-only model": ({"messages": [{"role": "user", "content_parts": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}, INVALID,
        "messages[0].content_parts[0]"),
    "audio format": ({"messages": [{"role": "user", "content_parts": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "ogg"}}]}]}, INVALID,
        "messages[0].content_parts[0].input_audio.format"),
    "tool message without id": ({"messages": [*HI, {"role": "tool", "content": "22C"}]}, INVALID,
                                "messages[1].tool_call_id"),
    "tool_calls in a user message": ({"messages": [{"role": "user", "content": "Hi", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]}, INVALID, "messages[0].tool_calls"),
    "tool call arguments": ({"messages": [*HI, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{not json"}}]}]}, INVALID,
        "messages[1].tool_calls[0].function.arguments"),
    "max_tokens and max_completion_tokens": ({"messages": HI, "max_tokens": 4, "max_completion_tokens": 4},
                                             INVALID, "max_completion_tokens"),
    "max_completion_tokens": ({"messages": HI, "max_completion_tokens": -2}, INVALID, "max_completion_tokens"),
    "top_logprobs without logprobs": ({"messages": HI, "top_logprobs": 2}, INVALID, "top_logprobs"),
    "top_logprobs": ({"messages": HI, "logprobs": True, "top_logprobs": 25}, INVALID, "top_logprobs"),
    "tool name": ({"messages": HI, "tools": [{"function": {"name": "get weather"}}]}, INVALID,
                  "tools[0].function.name"),
    "tool type": ({"messages": HI, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, INVALID,
                  "tools[0].type"),
    "duplicate tools": ({"messages": HI, "tools": [TOOL, TOOL]}, INVALID, "tools"),
    "tool_choice type": ({"messages": HI, "tools": [TOOL], "tool_choice": {"type": "sometimes"}}, INVALID,
                         "tool_choice.type"),
    "tool_choice unknown function": ({"messages": HI, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, INVALID, "tool_choice.function.name"),
    "tool_choice without tools": ({"messages": HI, "tool_choice": {"type": "required"}}, INVALID, "tool_choice"),
    "tools and response_format": ({"messages": HI, "tools": [TOOL], "tool_choice": {"type": "required"},
                                   "response_format": {"type": "json_object"}}, INVALID, "tool_choice"),
    "tool schema that does not compile": ({"messages": HI, "tools": [{"function": {
        "name": "f", "parameters": {"type": "objekt"}}}], "tool_choice": {"type": "required"}}, INVALID, "tools"),
    "continue a user message": ({"messages": HI, "continue_final_message": True}, INVALID,
                                "continue_final_message"),
    "continue and add_generation_prompt": ({"messages": [*HI, {"role": "assistant", "content": "He"}],
                                            "continue_final_message": True, "add_generation_prompt": True},
                                           INVALID, "continue_final_message"),
    "chat_template_kwargs": ({"messages": HI, "chat_template_kwargs": {"tools": []}}, INVALID,
                             "chat_template_kwargs"),
    "temperature": ({"messages": HI, "temperature": -1}, INVALID, "temperature"),
    "seed with min_tokens": ({"messages": HI, "max_tokens": 2, "min_tokens": 3}, INVALID, "min_tokens"),
    "unknown model": ({"messages": HI, "model": "llama"}, NOT_FOUND, "model"),
    "lora_path not loaded": ({"messages": HI, "lora_path": "a"}, NOT_FOUND, "lora_path"),
    "return_routed_experts on a dense model": ({"messages": HI, "return_routed_experts": True}, INVALID,
                                               "return_routed_experts"),
}


@pytest.fixture(scope="module")
def stub(server: Any) -> Any:
    with grpc.insecure_channel(server.target) as channel:
        yield openai_pb2_grpc.OpenAIServiceStub(channel)


def _violations(error: grpc.RpcError) -> list[error_details_pb2.BadRequest.FieldViolation]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status details"
    found = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            found += list(bad.field_violations)
    return found


def _expect(call: Any, request: Any, code: grpc.StatusCode, field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(call(request, timeout=60))
    assert err.value.code() == code, err.value.details()
    violations = _violations(err.value)
    named = [v for v in violations if v.field == field]
    assert named, f"no violation names {field}: {[(v.field, v.description) for v in violations]}"
    assert all(v.description for v in named)


@pytest.mark.parametrize("case", list(COMPLETE_CASES))
def test_invalid_complete_field_is_named(stub: Any, case: str) -> None:
    payload, code, field = COMPLETE_CASES[case]
    _expect(stub.Complete, json_format.ParseDict(payload, openai_pb2.CompleteRequest()), code, field)


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_invalid_chat_field_is_named(stub: Any, case: str) -> None:
    payload, code, field = CHAT_CASES[case]
    _expect(stub.ChatComplete, json_format.ParseDict(payload, openai_pb2.ChatCompleteRequest()), code, field)


@pytest.mark.parametrize(("request_fields", "field", "allowed"), [
    ({"top_p": 2, "temperature": -1}, "top_p", "(0, 1]"),
    ({"top_p": 2, "temperature": -1}, "temperature", ">= 0"),
    ({"logprobs": 30}, "logprobs", "[0, 20]"),
    ({"n": 2, "best_of": 1}, "best_of", ">= n (2)"),
])
def test_descriptions_give_the_allowed_range(stub: Any, request_fields: dict[str, Any], field: str,
                                             allowed: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Complete(openai_pb2.CompleteRequest(prompt=["a"], **request_fields), timeout=60))
    described = {v.field: v.description for v in _violations(err.value)}
    assert allowed in described[field]


def test_server_still_serves_after_invalid_requests(client: Client) -> None:
    # Runs after the cases above (file order): every one of them was refused without harm.
    assert len(COMPLETE_CASES) + len(CHAT_CASES) >= 25
    [choice] = client.complete("Hello", max_tokens=2, temperature=0).choices
    assert choice.text
    assert client.chat("Hello", max_tokens=2).choices[0].message.content is not None
