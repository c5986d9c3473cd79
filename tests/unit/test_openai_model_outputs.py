"""OpenAIService's return_hidden_states and return_routed_experts through the real services and engine on an
in-process server: Complete's and ChatComplete's hidden states equal GenerateService's for the same prompt ids
bitwise (ALL and LAST); streamed pieces concatenate to the merged choice; routed experts through ChatComplete and
Complete on the tiny MoE checkpoint equal GenerateService's; the refusals are GenerateService's (FAILED_PRECONDITION
without --enable-return-routed-experts, INVALID_ARGUMENT on a dense model, a mode or start without its flag, a start
past the prompt)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message
from inprocess_service import running_engine, served_both

from lmrpc.kernels import native
from lmrpc.server.config import EngineConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.v1 import generate_pb2, generate_pb2_grpc, openai_pb2, openai_pb2_grpc

pytestmark = pytest.mark.skipif(not native.available(), reason="the native model path")

NEW = 8
LAST = generate_pb2.HIDDEN_STATES_MODE_LAST
MESSAGES = [openai_pb2.ChatMessage(role="user", content="Name three colours.")]
Choice = openai_pb2.CompletionChoice | openai_pb2.ChatChoice


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Iterator[tuple[AsyncEngine, EngineConfig]]:
    yield from running_engine(str(tiny_llama_dir), "float32")


@pytest.fixture(scope="module")
def moe(tiny_moe_dir: Path) -> Iterator[tuple[AsyncEngine, EngineConfig]]:
    yield from running_engine(str(tiny_moe_dir), "float32")


def generate_request(ids: Sequence[int], *, mode: int = 0, routed: bool = False) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        input_ids=[generate_pb2.TokenIds(ids=list(ids))], return_hidden_states=not routed,
        hidden_states_mode=mode,  # type: ignore[arg-type]
        return_routed_experts=routed,
        sampling_params=[generate_pb2.SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)])


def complete_request(ids: Sequence[int], *, stream: bool = False, **fields: object) -> openai_pb2.CompleteRequest:
    return openai_pb2.CompleteRequest(prompt_token_ids=[generate_pb2.TokenIds(ids=list(ids))], max_tokens=NEW,
                                      temperature=0.0, ignore_eos=True, stream=stream, **fields)  # type: ignore[arg-type]


def chat_request(*, stream: bool = False, **fields: object) -> openai_pb2.ChatCompleteRequest:
    return openai_pb2.ChatCompleteRequest(messages=MESSAGES, max_tokens=NEW, temperature=0.0, ignore_eos=True,
                                          stream=stream, return_token_ids=True, **fields)  # type: ignore[arg-type]


def rows(items: Sequence[Message]) -> np.ndarray:
    """The hidden states of messages or choices, concatenated: [positions, hidden] float32."""
    return np.array([list(e.values) for m in items for e in m.hidden_states], dtype=np.float32)  # type: ignore[attr-defined]


def experts(items: Sequence[Message]) -> tuple[np.ndarray, list[int]]:
    """The routed experts of messages or choices, concatenated [positions, moe layers, top_k], and each piece's
    start position."""
    pieces = [m.routed_experts for m in items if m.HasField("routed_experts")]
    data = np.concatenate([np.frombuffer(p.data, dtype="<i4").reshape(tuple(p.shape)) for p in pieces])
    return data, [p.start_position for p in pieces]


def choices(responses: Sequence[openai_pb2.CompleteResponse | openai_pb2.ChatCompleteResponse]) -> list[Choice]:
    return [c for r in responses for c in r.choices]


async def generate(stub: generate_pb2_grpc.GenerateServiceStub, req: generate_pb2.GenerateRequest
                   ) -> generate_pb2.GenerateResponse:
    [msg] = [m async for m in stub.Generate(req)]
    return msg


async def complete(stub: openai_pb2_grpc.OpenAIServiceStub, req: openai_pb2.CompleteRequest
                   ) -> list[openai_pb2.CompleteResponse]:
    return [m async for m in stub.Complete(req)]


async def chat(stub: openai_pb2_grpc.OpenAIServiceStub, req: openai_pb2.ChatCompleteRequest
               ) -> list[openai_pb2.ChatCompleteResponse]:
    return [m async for m in stub.ChatComplete(req)]


async def test_complete_hidden_states_equal_generate(tiny: tuple[AsyncEngine, EngineConfig]) -> None:
    engine, config = tiny
    ids = list(range(300, 337))  # 37 tokens: two full pages and a partial one
    async with served_both(engine, config) as (gen, oai):
        reference = await generate(gen, generate_request(ids))
        [merged] = await complete(oai, complete_request(ids, return_hidden_states=True))
        streamed = await complete(oai, complete_request(ids, stream=True, return_hidden_states=True))
        [last] = await complete(oai, complete_request(ids, return_hidden_states=True, hidden_states_mode=LAST))
        echoed = await complete(oai, complete_request(ids, return_hidden_states=True, echo=True))
    full = rows([reference])
    assert full.shape == (len(ids) + NEW - 1, 64)
    [choice] = merged.choices
    assert choice.text == reference.text and np.array_equal(rows([choice]), full)  # bitwise
    pieces = choices(streamed)
    assert len([c for c in pieces if c.hidden_states]) > 2  # new positions as they come, not all at the end
    assert np.array_equal(rows(pieces), full)
    assert len(last.choices[0].hidden_states) == 1 and np.array_equal(rows(last.choices), full[-1:])
    assert np.array_equal(rows(choices(echoed)), full)  # echo changes the text only


async def test_chat_hidden_states_equal_generate(tiny: tuple[AsyncEngine, EngineConfig]) -> None:
    engine, config = tiny
    async with served_both(engine, config) as (gen, oai):
        [merged] = await chat(oai, chat_request(return_hidden_states=True))
        prompt = list(merged.choices[0].prompt_token_ids)
        reference = await generate(gen, generate_request(prompt))
        reference_last = await generate(gen, generate_request(prompt, mode=LAST))
        streamed = await chat(oai, chat_request(stream=True, return_hidden_states=True))
        [last] = await chat(oai, chat_request(return_hidden_states=True, hidden_states_mode=LAST))
        last_streamed = await chat(oai, chat_request(stream=True, return_hidden_states=True,
                                                     hidden_states_mode=LAST))
    full = rows([reference])
    [choice] = merged.choices
    assert list(choice.token_ids) == list(reference.token_ids)
    assert full.shape == (len(prompt) + NEW - 1, 64) and np.array_equal(rows([choice]), full)
    assert np.array_equal(rows(choices(streamed)), full)
    assert np.array_equal(rows(last.choices), rows([reference_last])) and len(last.choices[0].hidden_states) == 1
    assert np.array_equal(rows(last.choices), full[-1:])
    assert [n for n in (len(c.hidden_states) for c in choices(last_streamed)) if n] == [1]  # one chunk, one row
    assert np.array_equal(rows(choices(last_streamed)), full[-1:])


async def test_routed_experts_through_chat_and_complete(moe: tuple[AsyncEngine, EngineConfig]) -> None:
    engine, config = moe
    enabled = replace(config, enable_return_routed_experts=True)
    async with served_both(engine, enabled) as (gen, oai):
        [merged] = await chat(oai, chat_request(return_routed_experts=True))
        prompt = list(merged.choices[0].prompt_token_ids)
        reference = await generate(gen, generate_request(prompt, routed=True))
        streamed = await chat(oai, chat_request(stream=True, return_routed_experts=True))
        tail_request = generate_request(prompt, routed=True)
        tail_request.routed_experts_start_len = 5
        tail_reference = await generate(gen, tail_request)
        [tail] = await chat(oai, chat_request(return_routed_experts=True, routed_experts_start_len=5))
        [completed] = await complete(oai, complete_request(prompt, return_routed_experts=True))
        completed_streamed = await complete(oai, complete_request(prompt, stream=True, return_routed_experts=True))
    want, _ = experts([reference])
    assert want.shape == (len(prompt) + NEW - 1, 2, 2)
    [choice] = merged.choices
    assert list(choice.token_ids) == list(reference.token_ids)
    got, starts = experts([choice])
    assert starts == [0] and np.array_equal(got, want)
    assert list(choice.routed_experts.shape) == [len(prompt) + NEW - 1, 2, 2]
    got, starts = experts(choices(streamed))
    assert np.array_equal(got, want) and len(starts) > 2
    assert starts == sorted(starts) and starts[0] == 0  # each piece starts where the previous one ended
    got, starts = experts(tail.choices)
    assert starts == [5] and np.array_equal(got, experts([tail_reference])[0]) and np.array_equal(got, want[5:])
    assert np.array_equal(experts(completed.choices)[0], want)
    assert np.array_equal(experts(choices(completed_streamed))[0], want)


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:  # type: ignore[attr-defined]
            pass
    return info.value


async def test_refusals_are_generate_services(moe: tuple[AsyncEngine, EngineConfig],
                                              tiny: tuple[AsyncEngine, EngineConfig]) -> None:
    engine, config = moe
    async with served_both(engine, config) as (_, oai):  # without --enable-return-routed-experts
        for call in (oai.ChatComplete(chat_request(return_routed_experts=True)),
                     oai.Complete(complete_request([300, 301], return_routed_experts=True))):
            err = await refused(call)
            assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "--enable-return-routed-experts" in (err.details() or "")
    async with served_both(engine, replace(config, enable_return_routed_experts=True)) as (_, oai):
        for call, field in (
            (oai.Complete(complete_request([300, 301], routed_experts_start_len=1)), "routed_experts_start_len"),
            (oai.Complete(complete_request([300, 301], return_routed_experts=True, routed_experts_start_len=3)),
             "routed_experts_start_len"),
            (oai.ChatComplete(chat_request(return_routed_experts=True, routed_experts_start_len=10_000)),
             "routed_experts_start_len"),
            (oai.ChatComplete(chat_request(hidden_states_mode=LAST)), "hidden_states_mode"),
        ):
            err = await refused(call)
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and field in (err.details() or ""), err
    dense, dense_config = tiny
    async with served_both(dense, replace(dense_config, enable_return_routed_experts=True)) as (_, oai):
        err = await refused(oai.ChatComplete(chat_request(return_routed_experts=True)))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "return_routed_experts" in (err.details() or "") and "no experts" in (err.details() or "")
