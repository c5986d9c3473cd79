"""The client's OpenAI side without a server: OpenAI-shaped arguments -> requests, and chunks -> merged answers."""

from __future__ import annotations

import pytest
from google.protobuf import json_format

from lmrpc.client import ChatCompletion, ChatMessage, CompletionFinishReason, merge_chat
from lmrpc.client.openai_convert import build_chat_request, build_complete_request
from lmrpc.client.openai_results import ChatChoice, FunctionCall, ToolCall
from lmrpc.v1 import openai_pb2


def test_prompt_forms() -> None:
    assert list(build_complete_request("a", {}, False).prompt) == ["a"]
    assert list(build_complete_request(["a", "b"], {}, False).prompt) == ["a", "b"]
    assert [list(p.ids) for p in build_complete_request([1, 2], {}, False).prompt_token_ids] == [[1, 2]]
    assert [list(p.ids) for p in build_complete_request([[1], [2, 3]], {}, False).prompt_token_ids] == [[1], [2, 3]]
    for bad in ([1, "a"], [[1], 2], []):
        with pytest.raises((TypeError, ValueError)):
            build_complete_request(bad, {}, False)  # type: ignore[arg-type]


def test_complete_fields_in_openai_shapes() -> None:
    request = build_complete_request("a", {
        "max_tokens": 5, "temperature": 0, "stop": "\n", "logit_bias": {50256: -100}, "seed": 3, "top_p": None,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        "stream_options": {"include_usage": True}}, True)
    assert request.max_tokens == 5 and request.HasField("temperature") and request.temperature == 0
    assert not request.HasField("top_p")  # None: unset, the server's default
    assert list(request.stop) == ["\n"] and dict(request.logit_bias) == {50256: -100.0}
    assert request.seed == 3 and request.stream and request.stream_options.include_usage
    assert json_format.MessageToDict(request.response_format.json_schema.schema) == {"type": "object"}
    assert build_complete_request("a", {"json_schema": {"type": "object"}}, False).json_schema == '{"type": "object"}'
    with pytest.raises(ValueError, match="max_token"):
        build_complete_request("a", {"max_token": 5}, False)


def test_chat_messages_and_tools_in_openai_shapes() -> None:
    request = build_chat_request([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
        ChatMessage("assistant", "Done.").to_dict(),
    ], {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}, False)
    system, user, assistant, tool, answer = request.messages
    assert system.content == "Be brief." and user.content_parts[0].text == "Hi" and not user.HasField("content")
    assert not assistant.HasField("content") and assistant.tool_calls[0].function.name == "f"
    assert tool.tool_call_id == "c1" and answer.content == "Done."
    assert request.tool_choice.type == "required" and request.tools[0].function.name == "f"
    named = build_chat_request("Hi", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, False)
    assert named.messages[0].role == "user" and named.tool_choice.function.name == "f"


def test_chat_chunks_merge_like_openai() -> None:
    def chunk(**delta: object) -> ChatCompletion:
        return ChatCompletion.from_pb(openai_pb2.ChatCompleteResponse(
            id="x", object="chat.completion.chunk", choices=[openai_pb2.ChatChoice(
                index=0, delta=openai_pb2.ChatMessage(**delta))]))  # type: ignore[arg-type]

    call = openai_pb2.ToolCall(index=0, id="c1", type="function",
                               function=openai_pb2.FunctionCall(name="f", arguments='{"a": '))
    more = openai_pb2.ToolCall(index=0, function=openai_pb2.FunctionCall(arguments="1}"))
    end = ChatCompletion.from_pb(openai_pb2.ChatCompleteResponse(id="x", choices=[
        openai_pb2.ChatChoice(index=0, delta=openai_pb2.ChatMessage(), finish_reason=3)]))
    merged = merge_chat([chunk(role="assistant"), chunk(content="Hel"), chunk(content="lo"),
                         chunk(tool_calls=[call]), chunk(tool_calls=[more]), end])
    assert merged.object == "chat.completion"
    [choice] = merged.choices
    assert choice.message == ChatMessage("assistant", "Hello", [ToolCall(0, "c1", FunctionCall("f", '{"a": 1}'))])
    assert choice.finish_reason is CompletionFinishReason.TOOL_CALLS
    assert ChatChoice(0).message.content is None  # no content delta: null, not ""
