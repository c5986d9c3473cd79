"""Prompts given as embeddings (GenerateRequest.input_embeds), through the real GenerateService and engine on an
in-process grpc.aio server: the embedding rows of some input_ids give bitwise the same tokens and logprobs as those
ids (greedy, seeded n > 1, structured output), on a tiny float32 Llama and on the real SmolLM2 as served by default;
a repeated embeddings prompt is a prefix-cache hit that never shares pages with the token prompt of the same rows;
bad embeddings are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from inprocess_service import engine_config, running_engine, served
from safetensors.torch import load_file
from status_details import violations

from lmrpc.kernels import native
from lmrpc.server.config import EngineConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.skipif(not native.available(), reason="bitwise equality rests on the native kernels")

NEW = 16
TOP = 5


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Iterator[tuple[AsyncEngine, EngineConfig]]:
    yield from running_engine(str(tiny_llama_dir), "float32")


def tiny_rows(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """The checkpoint's own embedding rows of ids [len(ids), hidden] (float32, read from the file, not the model)."""
    table = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    return table[torch.tensor(ids)].float()


def embeds_pb(rows: torch.Tensor) -> generate_pb2.PromptEmbeddings:
    return generate_pb2.PromptEmbeddings(positions=[generate_pb2.Embedding(values=r.tolist()) for r in rows])


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


Outcome = tuple[tuple[int, ...], tuple[tuple[float, tuple[tuple[int, float], ...]], ...], int]


async def generate(stub: generate_pb2_grpc.GenerateServiceStub, req: generate_pb2.GenerateRequest
                   ) -> dict[int, Outcome]:
    """index -> (tokens, per position (chosen logprob, top (id, logprob)), cached_tokens)."""
    out: dict[int, Outcome] = {}
    async for msg in stub.Generate(req):
        lps = tuple((p.chosen.logprob, tuple((t.token_id, t.logprob) for t in p.top)) for p in msg.output_logprobs)
        out[msg.index] = (tuple(msg.token_ids), lps, msg.usage.cached_tokens)
    return out


def request(sampling: generate_pb2.SamplingParams, *, ids: list[int] | None = None,
            rows: torch.Tensor | None = None) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(sampling_params=[sampling], return_logprob=True, top_logprobs_num=TOP)
    if ids is not None:
        req.input_ids.append(generate_pb2.TokenIds(ids=ids))
    if rows is not None:
        req.input_embeds.append(embeds_pb(rows))
    return req


def greedy() -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


async def test_embeddings_of_ids_give_bitwise_the_same_output(tiny: tuple[AsyncEngine, EngineConfig],
                                                               tiny_llama_dir: Path) -> None:
    engine, config = tiny
    ids = prompt_ids(1, 37)  # two full pages and a partial one
    rows = tiny_rows(tiny_llama_dir, ids)
    async with served(engine, config) as stub:
        by_ids = (await generate(stub, request(greedy(), ids=ids)))[0]
        by_rows = (await generate(stub, request(greedy(), rows=rows)))[0]
        assert len(by_ids[0]) == NEW
        assert by_rows[:2] == by_ids[:2]  # tokens and every logprob, bitwise
        # The token prompt's pages are cached, but an embeddings prompt never matches them.
        assert by_rows[2] == 0
        again = (await generate(stub, request(greedy(), rows=rows)))[0]
        assert again[2] == len(ids) - 1  # all but the last position, whose logits must be computed
        assert again[:2] == by_ids[:2]  # reused K/V give the same bits


async def test_seeded_n_samples_and_structured_output(tiny: tuple[AsyncEngine, EngineConfig],
                                                      tiny_llama_dir: Path) -> None:
    engine, config = tiny
    ids = prompt_ids(2, 21)
    rows = tiny_rows(tiny_llama_dir, ids)
    seeded = generate_pb2.SamplingParams(max_new_tokens=NEW, temperature=1.0, sampling_seed=11, n=3,
                                         ignore_eos=True)
    pattern = r"[a-z]{3,8}-[0-9]{2}"
    constrained = generate_pb2.SamplingParams(max_new_tokens=NEW, temperature=0.0, regex=pattern)
    async with served(engine, config) as stub:
        samples_ids = await generate(stub, request(seeded, ids=ids))
        samples_rows = await generate(stub, request(seeded, rows=rows))
        assert sorted(samples_rows) == [0, 1, 2]
        for i in range(3):
            assert samples_rows[i][:2] == samples_ids[i][:2]
        assert len({samples_rows[i][0] for i in range(3)}) > 1  # the samples differ from each other
        # Samples 1..2 reuse sample 0's prompt pages through the prefix cache.
        assert all(samples_rows[i][2] >= 16 for i in (1, 2))
        text_req = request(constrained, rows=rows)
        text_req.return_logprob = False
        async for msg in stub.Generate(text_req):
            assert re.fullmatch(pattern, msg.text), msg.text
        assert (await generate(stub, request(constrained, rows=rows)))[0][:2] == \
            (await generate(stub, request(constrained, ids=ids)))[0][:2]


async def test_real_model_as_served_by_default() -> None:
    """SmolLM2 as served by default (bfloat16, its own Q8_0 embedding rows dequantized to float32)."""
    config = engine_config(None, "auto")
    engine = AsyncEngine.start(config)
    try:
        ids = prompt_ids(3, 29)
        rows = engine.engine.executor.model.embed(torch.tensor(ids))  # [29, 576] the rows the model reads
        async with served(engine, config) as stub:
            by_ids = (await generate(stub, request(greedy(), ids=ids)))[0]
            by_rows = (await generate(stub, request(greedy(), rows=rows)))[0]
        assert len(by_ids[0]) == NEW and by_rows[:2] == by_ids[:2]
    finally:
        engine.shutdown()


async def test_bad_embeddings_are_invalid_argument_naming_the_field(tiny: tuple[AsyncEngine, EngineConfig],
                                                                    tiny_llama_dir: Path) -> None:
    engine, config = tiny
    rows = tiny_rows(tiny_llama_dir, [100, 200, 300])  # [3, 64]
    nan = rows.clone()
    nan[1, 5] = float("nan")
    inf = rows.clone()
    inf[2, 0] = float("inf")
    both = request(greedy(), ids=[100, 200], rows=rows)
    lp = request(greedy(), rows=rows)
    lp.logprob_start_len = 0
    cases: list[tuple[generate_pb2.GenerateRequest, str, str]] = [
        (request(greedy(), rows=rows[:, :63]), "input_embeds[0].positions[0].values", "hidden size is 64"),
        (request(greedy(), rows=nan), "input_embeds[0].positions[1].values", "finite"),
        (request(greedy(), rows=inf), "input_embeds[0].positions[2].values", "finite"),
        (request(greedy(), rows=rows[:0]), "input_embeds[0].positions", "must not be empty"),
        (both, "input_embeds", "exactly one of text, input_ids or input_embeds"),
        (lp, "logprob_start_len", "prompt logprobs"),
        (request(greedy(), rows=torch.zeros(4096, 64)), "input_embeds[0].positions", "the context holds 4096"),
    ]
    async with served(engine, config) as stub:
        for req, field, words in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(req):
                    pass
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            found = violations(info.value)
            assert field in found and words in found[field], found
        # Nothing leaked: every page is free or cached once the refused calls are gone.
        stats = engine.stats()
        assert stats.num_used_pages == 0 and stats.num_running == 0
        # A good request still works afterwards.
        assert len((await generate(stub, request(greedy(), rows=rows)))[0][0]) == NEW


async def test_model_info_tells_the_hidden_size(tiny: tuple[AsyncEngine, EngineConfig]) -> None:
    engine, config = tiny
    async with served(engine, config) as stub:
        info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
    assert info.hidden_size == 64 and info.accepts_input_embeds
