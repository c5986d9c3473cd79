"""OpenAIService end to end without a model: the real servicer over a scripted engine (the real tokenizer, the real
OutputProcessor), called through the real Client and CLI. Covers what the small model cannot show: auto tool
calls parsed from the model's own text, best_of's ranking, engine errors, and the chat CLI's history."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from scripted_engine import EOS, FAIL, HANG, Scripted, ScriptedEngine, serving_openai
from transformers import PreTrainedTokenizerBase

from lmrpc.client import AsyncClient, Client, CompletionFinishReason, LmrpcError, merge_chat, merge_completion
from lmrpc.client.cli import main as cli_main
from lmrpc.server.engine.types import EngineRequest
from lmrpc.v1 import openai_pb2, openai_pb2_grpc

pytestmark = pytest.mark.timeout(60)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BEST_LOGPROBS = [-2.0, -0.5, -1.0, -3.0]  # candidate i's token logprob, for prompts asking BEST
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer: PreTrainedTokenizerBase) -> ScriptedEngine:
    def script(request: EngineRequest) -> Scripted:
        prompt = smollm2_tokenizer.decode(list(request.prompt_ids))
        candidate = request.index % request.params.n  # its number among its prompt's candidates
        if "WEATHER" in prompt:
            return Scripted("Let me look that up.\n" + CALL)
        if "BEST" in prompt:
            return Scripted(f" candidate {candidate}", BEST_LOGPROBS[candidate])
        if "FAIL" in prompt:
            return Scripted(FAIL)
        if "HANG" in prompt:
            return Scripted(HANG)
        return Scripted("Hello there.")

    return ScriptedEngine(smollm2_tokenizer, script)


@pytest.fixture(scope="module")
def target(engine: ScriptedEngine) -> Iterator[str]:
    with serving_openai(engine) as t:
        yield t


@pytest.fixture
def client(target: str) -> Iterator[Client]:
    with Client(target, timeout=30) as c:
        yield c


def test_auto_tool_call_streams_role_content_then_call(client: Client) -> None:
    chunks = list(client.chat("WEATHER in Paris?", tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0] is not None and deltas[0].role == "assistant" and deltas[0].content is None
    content = "".join(d.content or "" for d in deltas if d is not None)
    assert content == "Let me look that up."  # the call's text never shows as content
    call_chunks = [c for c in chunks if c.choices[0].delta is not None and c.choices[0].delta.tool_calls]
    [call_chunk] = call_chunks
    [call] = call_chunk.choices[0].delta.tool_calls  # type: ignore[union-attr]
    assert (call.index, call.function.name, json.loads(call.function.arguments)) == (0, "get_weather",
                                                                                     {"city": "Paris"})
    last = chunks[-1].choices[0]
    assert last.finish_reason is CompletionFinishReason.TOOL_CALLS and last.matched_stop is None
    assert chunks.index(call_chunk) > max(i for i, d in enumerate(deltas) if d is not None and d.content)

    merged = client.chat("WEATHER in Paris?", tools=TOOLS)
    s, m = merge_chat(chunks).choices[0], merged.choices[0]
    assert s.message.content == m.message.content == "Let me look that up."
    assert [(c.function.name, c.function.arguments) for c in s.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in m.message.tool_calls]
    assert m.finish_reason is CompletionFinishReason.TOOL_CALLS


def test_auto_tool_call_is_constrained_by_a_structural_tag(client: Client, engine: ScriptedEngine) -> None:
    client.chat("WEATHER?", tools=TOOLS)
    constraint = engine.requests[-1].params.constraint
    assert constraint is not None and constraint.kind == "structural_tag" and "<tool_call>" in constraint.text
    assert constraint.json_whitespace_flexible is False
    client.chat("WEATHER?", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    named = engine.requests[-1].params.constraint
    assert named is not None and named.kind == "json_schema" and json.loads(named.text)["required"] == ["city"]
    client.chat("WEATHER?", tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    assert "</tool_call>" in engine.requests[-1].params.stop  # ends at the first call
    client.chat("WEATHER?", tools=TOOLS, tool_choice="none")
    assert engine.requests[-1].params.constraint is None


def test_a_call_the_model_was_not_made_to_write_stays_content(client: Client) -> None:
    # tool_choice "none": nothing is parsed, even text that looks like a call.
    answer = client.chat("WEATHER?", tools=TOOLS, tool_choice="none")
    assert answer.choices[0].message.content == "Let me look that up.\n" + CALL
    assert answer.choices[0].finish_reason is CompletionFinishReason.STOP and answer.choices[0].matched_stop == EOS


def test_best_of_ranks_by_mean_logprob(client: Client, engine: ScriptedEngine) -> None:
    completion = client.complete(["BEST a", "BEST b"], n=2, best_of=4, logprobs=0, return_token_ids=True)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    # candidates 1 (-0.5) and 2 (-1.0) of each prompt, best first
    assert [c.text for c in completion.choices] == [" candidate 1", " candidate 2"] * 2
    for choice, expected in zip(completion.choices, [-0.5, -1.0] * 2, strict=True):
        assert choice.logprobs is not None and set(choice.logprobs.token_logprobs) == {expected}
    requests = engine.requests[-8:]
    assert [r.params.n for r in requests] == [4] * 8 and [r.share_prefill_with for r in requests[:4]] == [
        None] + [requests[0].request_id] * 3
    assert completion.usage is not None
    assert completion.usage.completion_tokens == sum(len(c.token_ids) for c in completion.choices) * 2


def test_best_of_without_logprobs_returns_none(client: Client, engine: ScriptedEngine) -> None:
    [first, second] = client.complete("BEST c", n=2, best_of=4).choices
    assert (first.text, second.text, first.logprobs) == (" candidate 1", " candidate 2", None)
    assert engine.requests[-1].logprobs is not None  # asked internally, to rank


def test_echo_with_logprobs_offsets(client: Client, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = "Café 🙂 say"
    [choice] = client.complete(prompt, echo=True, logprobs=1).choices
    assert choice.text == prompt + "Hello there."
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs[0] is None and lp.top_logprobs[0] == {}
    assert len(lp.tokens) == len(smollm2_tokenizer.encode(prompt)) + len(smollm2_tokenizer.encode("Hello there.")) + 1
    assert "".join(lp.tokens) == choice.text
    assert all(choice.text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens, strict=True))


def test_streamed_completion_merges_into_the_complete_one(client: Client) -> None:
    chunks = list(client.complete(["Say hi", "Say bye"], n=2, echo=True, logprobs=2, stream=True,
                                  return_token_ids=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    merged = client.complete(["Say hi", "Say bye"], n=2, echo=True, logprobs=2, return_token_ids=True)
    streamed = merge_completion(chunks)
    assert [(c.index, c.text, c.token_ids, c.prompt_token_ids, c.finish_reason, c.matched_stop, c.logprobs)
            for c in streamed.choices] == [(c.index, c.text, c.token_ids, c.prompt_token_ids, c.finish_reason,
                                            c.matched_stop, c.logprobs) for c in merged.choices]
    assert streamed.usage == merged.usage


def test_engine_error_fails_the_call(client: Client) -> None:
    with pytest.raises(LmrpcError) as err:
        client.complete("FAIL now")
    assert err.value.code == grpc.StatusCode.INTERNAL and "boom" in err.value.message


def test_leaving_a_stream_early_cancels_the_engine_requests(client: Client, engine: ScriptedEngine) -> None:
    chunks = client.chat("HANG on", n=2, stream=True)
    for chunk in chunks:  # the roles, then the first content: the engine is generating
        delta = chunk.choices[0].delta
        if delta is not None and delta.content:
            break
    assert len(engine.live) == 2
    chunks.close()  # cancels the call
    deadline = time.monotonic() + 10
    while engine.live and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.live == set()


def test_request_id_from_metadata_names_the_response(client: Client) -> None:
    answer = client.chat("Hi", metadata=[("x-request-id", "trace-42")])
    assert answer.id == "chatcmpl-trace-42"
    assert client.complete("Hi", rid="mine").id == "cmpl-mine"


def test_no_chat_template_is_failed_precondition(smollm2_tokenizer: PreTrainedTokenizerBase,
                                                 engine: ScriptedEngine) -> None:
    import copy

    bare = copy.deepcopy(smollm2_tokenizer)
    bare.chat_template = None
    with serving_openai(ScriptedEngine(bare, engine.script)) as target, grpc.insecure_channel(target) as channel:
        stub = openai_pb2_grpc.OpenAIServiceStub(channel)
        request = openai_pb2.ChatCompleteRequest(messages=[openai_pb2.ChatMessage(role="user", content="Hi")])
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ChatComplete(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--chat-template" in err.value.details()
        status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
        assert status is not None and status.details[0].Is(error_details_pb2.PreconditionFailure.DESCRIPTOR)
        # Completions need no template.
        [reply] = list(stub.Complete(openai_pb2.CompleteRequest(prompt=["Hi"]), timeout=30))
        assert reply.choices[0].text == "Hello there."


def test_chat_template_flag_replaces_the_models(engine: ScriptedEngine) -> None:
    with serving_openai(engine, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}") as target, \
            Client(target, timeout=30) as client:
        [choice] = client.chat("Hi", return_token_ids=True).choices
        assert client_text(engine, choice.prompt_token_ids) == "<user>Hi"


def client_text(engine: ScriptedEngine, ids: list[int]) -> str:
    return str(engine.tokenizer.decode(ids))


def test_async_client_complete_and_chat(target: str) -> None:
    async def run() -> None:
        async with AsyncClient(target, timeout=30) as client:
            completion = await client.complete([[5, 6, 7], [8, 9]], max_tokens=2)
            assert [c.text for c in completion.choices] == ["Hello there", "Hello there"]  # max_tokens 2
            assert all(c.finish_reason is CompletionFinishReason.LENGTH for c in completion.choices)
            chunks = [c async for c in await client.chat([{"role": "user", "content": [
                {"type": "text", "text": "Hi"}, {"type": "text", "text": "again"}]}], stream=True)]
            assert merge_chat(chunks).choices[0].message.content == "Hello there."

    asyncio.run(run())


def test_cli_chat_session_keeps_the_history(target: str, engine: ScriptedEngine, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("My name is Ann.\n\nWhat is my name?\n"))
    before = len(engine.requests)
    assert cli_main(["chat", "--target", target, "--system", "Be kind.", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello there.\nHello there.\n"
    assert err.count("finish: stop (matched 2)") == 2 and "usage: prompt" in err
    first, second = engine.requests[before:]
    prompt = client_text(engine, list(second.prompt_ids))
    assert prompt.startswith(client_text(engine, list(first.prompt_ids)))  # the first turn, then more
    assert "Be kind." in prompt and "My name is Ann.<|im_end|>\n<|im_start|>assistant\nHello there.<|im_end|>" \
        in prompt and prompt.endswith("What is my name?<|im_end|>\n<|im_start|>assistant\n")
    assert second.params.temperature == 0


def test_cli_chat_question_and_complete(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["chat", "Hi", "--target", target, "--max-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello there\n" and "finish: length" in err
    assert cli_main(["complete", "Hi", "Yo", "--target", target, "--n", "2", "--stream"]) == 0
    out, _ = capsys.readouterr()
    assert out.count("--- choice") == 4 and "Hello there." in out
    assert cli_main(["complete", "BEST x", "--target", target, "--best-of", "4", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert json.loads(out)["choices"][0]["text"] == " candidate 1"
    assert cli_main(["chat", "Hi", "--target", target, "--params", '{"n": 0}']) == 1
    _, err = capsys.readouterr()
    assert "INVALID_ARGUMENT" in err and "n: must be >= 1" in err
