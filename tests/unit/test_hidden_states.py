"""Final-layer hidden states (GenerateRequest.return_hidden_states) through the real GenerateService and engine:
equal to transformers' normalized last hidden state for SmolLM2 in float32 at prompt and output positions; the
streamed pieces concatenate to the merged list bitwise; LAST mode is exactly one vector (the last of ALL's); every
prompt position is returned even after the prompt was cached; after preemption and recompute no position repeats."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from inprocess_service import engine_config, running_engine, served
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmrpc.kernels import native
from lmrpc.server.config import EngineConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.skipif(not native.available(), reason="the native model path")

NEW = 8
LAST = generate_pb2.HIDDEN_STATES_MODE_LAST


def request(ids: list[int], *, stream: bool = False, mode: int = 0, new: int = NEW) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        input_ids=[generate_pb2.TokenIds(ids=ids)], stream=stream, return_hidden_states=True,
        hidden_states_mode=mode,  # type: ignore[arg-type]
        sampling_params=[generate_pb2.SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)],
    )


async def call(stub: generate_pb2_grpc.GenerateServiceStub, req: generate_pb2.GenerateRequest
               ) -> list[generate_pb2.GenerateResponse]:
    return [msg async for msg in stub.Generate(req)]


def rows(msgs: list[generate_pb2.GenerateResponse]) -> np.ndarray:
    """The hidden states of all messages, concatenated: [positions, hidden] float32."""
    return np.array([list(e.values) for m in msgs for e in m.hidden_states], dtype=np.float32)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Iterator[tuple[AsyncEngine, EngineConfig]]:
    yield from running_engine(str(tiny_llama_dir), "float32")


async def test_smollm2_float32_equals_transformers(smollm2_tokenizer: PreTrainedTokenizerBase,
                                                  smollm2_transformers: Callable[[], PreTrainedModel]) -> None:
    config = engine_config(None, "float32", quantization="none")  # the GGUF's weights dequantized, dense float32
    engine = AsyncEngine.start(config)
    try:
        ids = list(smollm2_tokenizer.encode("The capital of France is Paris, and the capital of Italy is"))
        async with served(engine, config) as stub:
            [msg] = await call(stub, request(ids))
    finally:
        engine.shutdown()
    out = list(msg.token_ids)
    ours = rows([msg])  # [P + NEW - 1, 576]
    assert len(out) == NEW and ours.shape == (len(ids) + NEW - 1, 576)
    assert msg.usage.prompt_tokens == len(ids) and msg.usage.completion_tokens == NEW
    hf = smollm2_transformers()
    with torch.inference_mode():
        result = hf(input_ids=torch.tensor([ids + out[:-1]]), output_hidden_states=True)
        # What the output projection reads: transformers' logits are its product with these rows.
        assert torch.equal(result.logits[0], hf.lm_head(result.hidden_states[-1])[0])
    theirs = result.hidden_states[-1][0].numpy()  # [P + NEW - 1, 576], after the final norm
    diff = np.abs(ours - theirs)
    assert diff[: len(ids)].max() <= 1e-4, diff[: len(ids)].max()  # prompt positions
    assert diff[len(ids) :].max() <= 1e-4, diff[len(ids) :].max()  # output positions


async def test_streamed_pieces_concatenate_to_merged_and_last_is_one(tiny: tuple[AsyncEngine, EngineConfig]
                                                                     ) -> None:
    engine, config = tiny
    ids = list(range(300, 337))  # 37 tokens: two full pages and a partial one
    async with served(engine, config) as stub:
        [merged] = await call(stub, request(ids))
        streamed = await call(stub, request(ids, stream=True))
        [last] = await call(stub, request(ids, mode=LAST))
        last_streamed = await call(stub, request(ids, mode=LAST, stream=True))
        # The prompt is cached by now: ALL mode still computes and returns every prompt position.
        [again] = await call(stub, request(ids))
    full = rows([merged])
    assert full.shape == (len(ids) + NEW - 1, 64)
    assert np.array_equal(rows(streamed), full)  # bitwise
    assert len(streamed) > 2
    # Each streamed message carries only its new positions: the first the prompt's (and its token's), then one
    # per token (the last sampled token has none).
    assert len(streamed[0].hidden_states) == len(ids) + len(streamed[0].token_ids) - 1
    assert all(len(m.hidden_states) == len(m.token_ids) for m in streamed[1:])
    assert len(last.hidden_states) == 1 and np.array_equal(rows([last]), full[-1:])
    assert [len(m.hidden_states) for m in last_streamed] == [0] * (len(last_streamed) - 1) + [1]
    assert np.array_equal(rows(last_streamed), full[-1:])
    assert again.usage.cached_tokens == 0 and np.array_equal(rows([again]), full)


async def test_recompute_after_preemption_repeats_no_position(tiny_llama_dir: Path,
                                                              tiny: tuple[AsyncEngine, EngineConfig]) -> None:
    """A pool of 6 pages for four 40-token outputs: sequences are preempted and recomputed; their hidden states are
    still each position once, equal to the run alone."""
    engine, config = tiny
    prompts = [list(range(1000 + 50 * i, 1000 + 50 * i + 24)) for i in range(4)]
    async with served(engine, config) as stub:
        alone = [rows(await call(stub, request(p, new=16))) for p in prompts]
    small = engine_config(str(tiny_llama_dir), "float32", kv_tokens=96)
    cramped = AsyncEngine.start(small)
    try:
        async with served(cramped, small) as stub:
            batch = generate_pb2.GenerateRequest(
                input_ids=[generate_pb2.TokenIds(ids=p) for p in prompts], return_hidden_states=True,
                sampling_params=[generate_pb2.SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)])
            msgs = await call(stub, batch)
    finally:
        cramped.shutdown()
    for msg in msgs:
        assert np.array_equal(rows([msg]), alone[msg.index])


async def test_mode_without_the_flag_is_invalid(tiny: tuple[AsyncEngine, EngineConfig]) -> None:
    engine, config = tiny
    req = request([300, 301], mode=LAST)
    req.return_hidden_states = False
    async with served(engine, config) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(stub, req)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "hidden_states_mode" in (info.value.details() or "")
