"""Issue 12's acceptance for OpenAIService.ChatComplete over a real server with the real SmolLM2 model: the prompt is
the tokenizer's own chat template, the capital question is answered, tool calls parse and validate, streamed chat
merges into the non-streamed answer."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from transformers import PreTrainedTokenizerBase

from lmrpc.client import ChatCompletion, Client, CompletionFinishReason, merge_chat

pytestmark = pytest.mark.e2e

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}}]


def template_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
    assert isinstance(ids, list)
    return ids


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hello there!"}],  # the template adds its default system message
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "How are you? 🙂"}],
])
def test_prompt_equals_the_tokenizers_chat_template(client: Client, smollm2_tokenizer: PreTrainedTokenizerBase,
                                                    messages: list[dict[str, Any]]) -> None:
    answer = client.chat(messages, max_tokens=1, return_token_ids=True)
    [choice] = answer.choices
    assert choice.prompt_token_ids == template_ids(smollm2_tokenizer, messages, add_generation_prompt=True)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(choice.prompt_token_ids)


def test_continue_final_message_equals_the_tokenizers(client: Client,
                                                      smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3,"}]
    answer = client.chat(messages, max_tokens=1, continue_final_message=True, return_token_ids=True)
    expected = template_ids(smollm2_tokenizer, messages, continue_final_message=True)
    assert answer.choices[0].prompt_token_ids == expected


def test_capital_of_france_through_chat(client: Client) -> None:
    [choice] = client.chat("What is the capital of France?", max_tokens=32, temperature=0).choices
    assert "Paris" in (choice.message.content or ""), choice.message.content


def _weather_call(client: Client, tool_choice: str | dict[str, Any], max_tokens: int = 64,
                  parallel_tool_calls: bool = True) -> ChatCompletion:
    return client.chat("What is the weather like in Paris right now?", tools=TOOLS, tool_choice=tool_choice,
                       max_tokens=max_tokens, temperature=0, parallel_tool_calls=parallel_tool_calls)


# One call: with parallel calls allowed, this small model goes on calling get_weather for every unit until
# max_tokens (a list of calls that never ends is what "required" then allows).
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_constrained_tool_call_parses_and_validates(client: Client, tool_choice: str | dict[str, Any]) -> None:
    answer = _weather_call(client, tool_choice, parallel_tool_calls=False)
    [choice] = answer.choices
    assert choice.finish_reason is CompletionFinishReason.TOOL_CALLS, choice
    assert choice.message.content is None and choice.message.tool_calls
    for i, call in enumerate(choice.message.tool_calls):
        assert call.index == i and call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert len(choice.message.tool_calls) == 1
    assert choice.matched_stop is None  # the call's grammar ended it, not a stop


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_tool_choice_answers_or_calls_consistently(client: Client, parallel: bool) -> None:
    [choice] = _weather_call(client, "auto", parallel_tool_calls=parallel).choices
    calls = choice.message.tool_calls
    assert (choice.finish_reason is CompletionFinishReason.TOOL_CALLS) == bool(calls), choice
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert "<tool_call>" not in (choice.message.content or "")
    assert parallel or len(calls) <= 1


def test_none_tool_choice_answers_in_text(client: Client) -> None:
    [choice] = _weather_call(client, "none", max_tokens=8).choices
    assert choice.message.tool_calls == [] and choice.finish_reason is not CompletionFinishReason.TOOL_CALLS


def test_streamed_chat_chunks(client: Client) -> None:
    chunks = list(client.chat("Name two colors.", stream=True, max_tokens=8, temperature=0, logprobs=True,
                              return_token_ids=True, stream_options={"include_usage": True}))
    [first, *middle, last, usage] = chunks
    assert all(c.object == "chat.completion.chunk" and c.id == first.id for c in chunks)
    assert first.choices[0].delta is not None and first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content is None and first.choices[0].prompt_token_ids
    for c in middle:  # content deltas, each with its tokens' logprobs and ids
        [choice] = c.choices
        assert choice.delta is not None and choice.delta.role == "" and choice.delta.content
        assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids) >= 1
        assert choice.finish_reason is CompletionFinishReason.UNSPECIFIED and c.usage is None
    assert last.choices[0].finish_reason is not CompletionFinishReason.UNSPECIFIED
    assert usage.choices == [] and usage.usage is not None
    merged = merge_chat(chunks).choices[0]
    assert merged.message.role == "assistant" and merged.message.content
    assert usage.usage.completion_tokens == len(merged.token_ids)
    assert merged.logprobs is not None and len(merged.logprobs) == len(merged.token_ids)


def test_streamed_chat_equals_merged_chat(client: Client) -> None:
    ask: dict[str, Any] = {"max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2,
                           "return_token_ids": True}
    question = "Name three fruits and their colors."
    streamed = merge_chat(client.chat(question, stream=True, stream_options={"include_usage": True}, **ask))
    merged = client.chat(question, **ask)
    assert merged.object == "chat.completion"
    s, m = streamed.choices[0], merged.choices[0]
    assert s.message.content == m.message.content and s.message.role == m.message.role == "assistant"
    assert s.token_ids == m.token_ids and s.prompt_token_ids == m.prompt_token_ids
    assert s.finish_reason is m.finish_reason and s.matched_stop == m.matched_stop
    assert s.logprobs == m.logprobs
    assert streamed.usage is not None and merged.usage is not None
    assert (streamed.usage.prompt_tokens, streamed.usage.completion_tokens) == (
        merged.usage.prompt_tokens, merged.usage.completion_tokens)


def test_streamed_tool_call_equals_merged(client: Client) -> None:
    ask: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                           "max_tokens": 64, "temperature": 0}
    chunks = list(client.chat("What is the weather like in Rome?", stream=True, **ask))
    merged = client.chat("What is the weather like in Rome?", **ask)
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0] is not None and deltas[0].role == "assistant"
    assert any(d is not None and d.tool_calls for d in deltas)
    s, m = merge_chat(chunks).choices[0], merged.choices[0]
    assert s.finish_reason is m.finish_reason is CompletionFinishReason.TOOL_CALLS
    assert s.message.content == m.message.content
    calls = [[(c.index, c.function.name, c.function.arguments) for c in x.message.tool_calls] for x in (s, m)]
    assert calls[0] == calls[1] and calls[0]  # ids are fresh per call


def test_chat_logprobs(client: Client) -> None:
    [choice] = client.chat("Say something nice.", max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                           ignore_eos=True).choices
    assert choice.logprobs is not None and len(choice.logprobs) == 12
    for entry in choice.logprobs:
        assert len(entry.top_logprobs) == 3 and entry.logprob == entry.top_logprobs[0].logprob  # greedy
        assert entry.bytes == entry.top_logprobs[0].bytes
    assert "".join(e.token for e in choice.logprobs) == choice.message.content


def test_abort_by_rid_ends_the_answer_with_abort(client: Client) -> None:
    chunks = client.chat("Count from one to one thousand.", rid="openai-abort-me", stream=True, max_tokens=2000,
                         ignore_eos=True, temperature=0)
    for chunk in chunks:  # until the answer is under way
        if chunk.choices and chunk.choices[0].delta is not None and chunk.choices[0].delta.content:
            break
    assert client.abort("openai-abort-me") == ["openai-abort-me"]
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason is CompletionFinishReason.ABORT
