"""A call closed mid-stream (a cancel, a passed deadline, a client gone: grpc closes the servicer's generator) aborts
its engine requests before the close returns, in every streaming RPC: GenerateService.Generate, OpenAIService's
Complete and ChatComplete, and SMG's worker Generate. Each servicer generator closes the generators it reads from;
one left to the event loop's finalizer (or, where a reference cycle holds it, to the cycle collector) would let the
engine go on decoding for nobody. The collector is off while a call closes, so only an explicit close can pass."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import AsyncMock, MagicMock

import pytest
from inprocess_service import running_engine
from smg_grpc_proto import sglang_scheduler_pb2 as sgl

from lmrpc.kernels import native
from lmrpc.server.config import EngineConfig, ServerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.frontend import Frontend
from lmrpc.server.generate.service import GenerateService
from lmrpc.server.openai.service import OpenAIService
from lmrpc.server.sglang.service import SglangWorkerService
from lmrpc.v1 import generate_pb2, openai_pb2

pytestmark = [pytest.mark.skipif(not native.available(), reason="the native model path"), pytest.mark.timeout(120)]

NEW = 500  # far more tokens than the test waits for: the request is still generating when its call closes


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Iterator[tuple[AsyncEngine, EngineConfig]]:
    yield from running_engine(str(tiny_llama_dir), "float32")


def context() -> MagicMock:
    """A servicer context of a call with no metadata and no deadline, from a live peer."""
    ctx = MagicMock()
    ctx.invocation_metadata.return_value = ()
    ctx.time_remaining.return_value = None
    ctx.peer.return_value = "ipv4:127.0.0.1:50000"
    ctx.code.return_value = None
    for name in ("send_initial_metadata", "abort", "abort_with_status", "write"):
        setattr(ctx, name, AsyncMock())
    return ctx


def generate(frontend: Frontend, root: Path) -> AsyncGenerator[Any, None]:
    request = generate_pb2.GenerateRequest(
        text=["Tell me a long story."], rid=["close-me"], stream=True,
        sampling_params=[generate_pb2.SamplingParams(max_new_tokens=NEW, ignore_eos=True)])
    return GenerateService(frontend).Generate(request, context())  # type: ignore[return-value]


def complete(frontend: Frontend, root: Path) -> AsyncGenerator[Any, None]:
    request = openai_pb2.CompleteRequest(prompt=["Tell me a long story."], rid="close-me", stream=True,
                                         max_tokens=NEW, ignore_eos=True)
    return OpenAIService(frontend, None).Complete(request, context())  # type: ignore[return-value]


def chat(frontend: Frontend, root: Path) -> AsyncGenerator[Any, None]:
    request = openai_pb2.ChatCompleteRequest(
        messages=[openai_pb2.ChatMessage(role="user", content="Tell me a long story.")], rid="close-me", stream=True,
        max_tokens=NEW, ignore_eos=True)
    return OpenAIService(frontend, None).ChatComplete(request, context())  # type: ignore[return-value]


def smg_generate(frontend: Frontend, root: Path) -> AsyncGenerator[Any, None]:
    ids = list(frontend.engine.tokenizer.encode("Tell me a long story."))
    request = sgl.GenerateRequest(
        request_id="close-me", tokenized=sgl.TokenizedInput(input_ids=ids), stream=True, logprob_start_len=-1,
        sampling_params=sgl.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1,
                                           max_new_tokens=NEW, ignore_eos=True))
    return SglangWorkerService(frontend, root).Generate(request, context())  # type: ignore[return-value]


@pytest.mark.parametrize("rpc", [generate, complete, chat, smg_generate], ids=lambda f: f.__name__)
async def test_closing_a_call_aborts_its_engine_requests_before_the_close_returns(
        tiny: tuple[AsyncEngine, EngineConfig], tmp_path: Path,
        rpc: Callable[[Frontend, Path], AsyncGenerator[Any, None]]) -> None:
    engine, config = tiny
    frontend = Frontend(engine, config, ServerConfig(host="127.0.0.1", port=0, max_queued_requests=8))
    call = rpc(frontend, tmp_path)
    for _ in range(3):  # a few streamed messages: the request is decoding
        await call.__anext__()
    assert engine.is_live("close-me")
    gc.disable()
    try:
        await call.aclose()  # what grpc does to a cancelled call's servicer generator
        assert not engine.is_live("close-me"), "the engine request outlived its call's close"
    finally:
        gc.enable()
    for _ in range(500):  # and the engine thread frees its pages within a step or two
        if engine.engine.kv.num_used_pages == 0 and engine.stats().num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.engine.kv.num_used_pages == 0 and engine.stats().num_running == 0
