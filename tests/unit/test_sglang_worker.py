"""SMG's worker service (sglang.grpc.scheduler.SglangScheduler) over the real engine on an in-process server, called
with smg-grpc-proto's own stubs: registration (HealthCheck, GetModelInfo, GetServerInfo), Generate equal to lmrpc's
own Generate on the same ids (merged and streamed), n=2 indices, logprobs, stop_token_ids with matched_token_id,
Abort and cancel freeing the pages, validation and admission statuses, GetLoads' figures, the GetTokenizer zip
loaded by transformers, API keys, UNIMPLEMENTED with a message for what is not served; SubscribeKvEvents' stored
blocks for a prompt's full pages (chained, with load records) and `cleared` after FlushCache, which refuses while a
request runs unless told to wait."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import zipfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from inprocess_service import running_engine
from smg_grpc_proto import sglang_scheduler_pb2 as sgl
from smg_grpc_proto import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import common_pb2
from transformers import AutoTokenizer

from lmrpc.kernels import native
from lmrpc.server.auth import ApiKeys, AuthInterceptor
from lmrpc.server.config import EngineConfig, ServerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.frontend import Frontend
from lmrpc.server.generate.service import GenerateService
from lmrpc.server.sglang.service import SglangWorkerService
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

pytestmark = [pytest.mark.skipif(not native.available(), reason="the native model path"), pytest.mark.timeout(120)]

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@dataclass
class Worker:
    sglang: Any  # sgl_grpc.SglangSchedulerStub on an aio channel (its generated types are the sync ones)
    lmrpc: Any  # generate_pb2_grpc.GenerateServiceStub on the same channel
    engine: AsyncEngine


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Iterator[tuple[AsyncEngine, EngineConfig]]:
    yield from running_engine(str(tiny_llama_dir), "float32")


@asynccontextmanager
async def serving(engine: AsyncEngine, config: EngineConfig, root: Path, *, max_queued: int = 256,
                  interceptors: tuple[grpc.aio.ServerInterceptor, ...] = (),
                  metadata: tuple[tuple[str, str], ...] = ()) -> AsyncIterator[Worker]:
    """Both GenerateService and the SMG worker service over one frontend, as the server runs them."""
    frontend = Frontend(engine, config, ServerConfig(host="127.0.0.1", port=0, max_queued_requests=max_queued))
    server = grpc.aio.server(interceptors=interceptors)
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateService(frontend), server)
    sgl_grpc.add_SglangSchedulerServicer_to_server(SglangWorkerService(frontend, root), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Worker(sgl_grpc.SglangSchedulerStub(channel), generate_pb2_grpc.GenerateServiceStub(channel), engine)
    finally:
        await server.stop(grace=None)


@pytest.fixture
async def worker(tiny: tuple[AsyncEngine, EngineConfig], tmp_path: Path) -> AsyncIterator[Worker]:
    async with serving(*tiny, tmp_path) as w:
        yield w


def ids_of(engine: AsyncEngine, text: str = PROMPT) -> list[int]:
    return list(engine.tokenizer.encode(text))


def smg_request(ids: list[int], *, rid: str = "smg-1", stream: bool = False, **sampling: object
                ) -> sgl.GenerateRequest:
    """As SMG sends one: semantic defaults in every scalar, temperature 0 for greedy (the scalar's zero)."""
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "n": 1, **sampling}
    return sgl.GenerateRequest(request_id=rid, tokenized=sgl.TokenizedInput(input_ids=ids), stream=stream,
                               logprob_start_len=-1, sampling_params=sgl.SamplingParams(**params))


async def call(w: Worker, req: sgl.GenerateRequest) -> list[sgl.GenerateResponse]:
    return [m async for m in w.sglang.Generate(req)]


async def lmrpc_tokens(w: Worker, ids: list[int], new: int, **fields: object) -> generate_pb2.GenerateResponse:
    req = generate_pb2.GenerateRequest(
        input_ids=[generate_pb2.TokenIds(ids=ids)], **fields,  # type: ignore[arg-type]
        sampling_params=[generate_pb2.SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)])
    [msg] = [m async for m in w.lmrpc.Generate(req)]
    return msg


async def wait_pages_free(engine: AsyncEngine) -> None:
    for _ in range(500):
        if engine.engine.kv.num_used_pages == 0 and not engine.is_live("smg-1"):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{engine.engine.kv.num_used_pages} KV pages still held")


async def test_registration(worker: Worker) -> None:
    health = await worker.sglang.HealthCheck(sgl.HealthCheckRequest())
    assert health.healthy
    info = await worker.sglang.GetModelInfo(sgl.GetModelInfoRequest())
    model = worker.engine.model_info
    assert (info.served_model_name, info.max_context_length, list(info.eos_token_ids), info.is_generation) == (
        model.served_model_name, model.max_context_length, list(model.eos_token_ids), True)
    assert set(json.loads(info.default_sampling_params_json)) == {"temperature", "top_p", "top_k", "min_p",
                                                                   "repetition_penalty"}
    directory = Path(info.tokenizer_path)
    names = {p.name for p in directory.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert json.loads((directory / "generation_config.json").read_text())["eos_token_id"] == 2
    server = await worker.sglang.GetServerInfo(sgl.GetServerInfoRequest())
    args = dict(server.server_args)
    assert (args["max_running_requests"], args["context_length"], args["page_size"]) == (16, 4096, 16)
    limits = worker.engine.scheduler_config  # the budgets in force (sized to the model when not given)
    assert (args["max_prefill_tokens"], args["chunked_prefill_size"]) == (limits.max_batched_tokens,
                                                                          limits.max_prefill_chunk)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await worker.sglang.Embed(sgl.EmbedRequest())
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_greedy_equals_lmrpc_generate_merged_and_streamed(worker: Worker) -> None:
    ids = ids_of(worker.engine)
    expected = await lmrpc_tokens(worker, ids, 12)
    [done] = await call(worker, smg_request(ids, max_new_tokens=12, ignore_eos=True))
    complete = done.complete
    assert done.request_id == "smg-1" and list(complete.output_ids) == list(expected.token_ids)
    assert (complete.finish_reason, complete.prompt_tokens, complete.completion_tokens) == ("length", len(ids), 12)
    streamed = await call(worker, smg_request(ids, rid="smg-2", stream=True, max_new_tokens=12, ignore_eos=True))
    chunks = [m.chunk for m in streamed if m.HasField("chunk")]
    completes = [m.complete for m in streamed if m.HasField("complete")]
    assert [t for c in chunks for t in c.token_ids] == list(expected.token_ids)
    assert [c.completion_tokens for c in chunks] == list(range(1, 13)) and chunks[0].prompt_tokens == len(ids)
    assert len(completes) == 1 and streamed[-1].HasField("complete")
    assert list(completes[0].output_ids) == list(expected.token_ids)
    assert completes[0].cached_tokens > 0  # the same prompt again: served from the prefix cache


async def test_absent_max_new_tokens_is_the_workers_default(worker: Worker) -> None:
    [done] = await call(worker, smg_request(ids_of(worker.engine), ignore_eos=True))
    assert done.complete.completion_tokens == 128


async def test_n2_streams_indices_and_one_complete_each(worker: Worker) -> None:
    msgs = await call(worker, smg_request(ids_of(worker.engine), stream=True, n=2, temperature=1.0,
                                          max_new_tokens=6, ignore_eos=True))
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    completes = {m.complete.index: m.complete for m in msgs if m.HasField("complete")}
    assert sorted(completes) == [0, 1] and len([m for m in msgs if m.HasField("complete")]) == 2
    for index, complete in completes.items():
        assert [t for c in chunks if c.index == index for t in c.token_ids] == list(complete.output_ids)
        assert len(complete.output_ids) == 6


async def test_logprobs_equal_lmrpc_generate(worker: Worker) -> None:
    ids = ids_of(worker.engine)
    expected = await lmrpc_tokens(worker, ids, 5, return_logprob=True, top_logprobs_num=3)
    req = smg_request(ids, max_new_tokens=5, ignore_eos=True)
    req.return_logprob, req.top_logprobs_num = True, 3
    [done] = await call(worker, req)
    lp = done.complete.output_logprobs
    assert list(lp.token_ids) == list(expected.token_ids)
    assert list(lp.token_logprobs) == pytest.approx([p.chosen.logprob for p in expected.output_logprobs], abs=0)
    assert [list(t.token_ids) for t in lp.top_logprobs] == [[e.token_id for e in p.top]
                                                             for p in expected.output_logprobs]
    assert all(len(t.values) == 3 for t in lp.top_logprobs)


async def test_stop_token_ids_end_with_matched_token_id(worker: Worker) -> None:
    ids = ids_of(worker.engine)
    tokens = list((await lmrpc_tokens(worker, ids, 16)).token_ids)
    # a token past the first at its first occurrence (the random model may repeat one token: then the first)
    at = next((i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i]), 0)
    [done] = await call(worker, smg_request(ids, max_new_tokens=16, stop_token_ids=[tokens[at]]))
    c = done.complete
    assert (c.finish_reason, c.WhichOneof("matched_stop"), c.matched_token_id) == ("stop", "matched_token_id",
                                                                                   tokens[at])
    assert list(c.output_ids) == tokens[:at + 1]


async def test_abort_ends_the_stream_and_frees_the_pages(worker: Worker) -> None:
    stream = worker.sglang.Generate(smg_request(ids_of(worker.engine), stream=True, max_new_tokens=3000,
                                                ignore_eos=True))
    first = await stream.read()
    assert first.HasField("chunk")
    aborted = await worker.sglang.Abort(sgl.AbortRequest(request_id="smg-1", reason="client gone"))
    assert aborted.success
    rest = []  # the gateway keeps reading: the stream must end by itself
    while (msg := await stream.read()) is not grpc.aio.EOF:
        rest.append(msg)
    assert rest[-1].HasField("complete") and rest[-1].complete.finish_reason == "abort"
    await wait_pages_free(worker.engine)
    missing = await worker.sglang.Abort(sgl.AbortRequest(request_id="smg-1"))
    assert not missing.success


async def test_cancel_frees_the_pages(worker: Worker) -> None:
    stream = worker.sglang.Generate(smg_request(ids_of(worker.engine), stream=True, max_new_tokens=3000,
                                                ignore_eos=True))
    assert (await stream.read()).HasField("chunk")
    stream.cancel()
    await wait_pages_free(worker.engine)


@pytest.mark.parametrize(("fields", "named"), [
    ({"top_p": 1.5}, "sampling_params.top_p"),
    ({"regex": "("}, "sampling_params.regex"),
    ({"n": 1000}, "sampling_params.n"),
    ({"min_new_tokens": 9, "max_new_tokens": 4}, "sampling_params.min_new_tokens"),
    ({"logit_bias": {"x": 1.0}}, "sampling_params.logit_bias"),
    ({"stop_token_ids": [10**6]}, "sampling_params.stop_token_ids"),
])
async def test_invalid_sampling_is_invalid_argument(worker: Worker, fields: dict[str, object], named: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(worker, smg_request(ids_of(worker.engine), **fields))  # type: ignore[arg-type]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in (err.value.details() or "")


async def test_invalid_prompts_are_invalid_argument(worker: Worker) -> None:
    for req in (smg_request([]), smg_request([10**6]), sgl.GenerateRequest(request_id="x"),
                smg_request(list(range(5000)))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(worker, req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req


async def test_full_server_is_resource_exhausted_and_loads_show_it(tiny: tuple[AsyncEngine, EngineConfig],
                                                                   tmp_path: Path) -> None:
    async with serving(*tiny, tmp_path, max_queued=0) as w:  # 16 outputs running or queued at most
        busy = w.sglang.Generate(smg_request(ids_of(w.engine), stream=True, n=16, temperature=1.0,
                                             max_new_tokens=3000, ignore_eos=True))
        assert (await busy.read()).HasField("chunk")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(w, smg_request(ids_of(w.engine), rid="smg-2", max_new_tokens=2))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        loads = await w.sglang.GetLoads(sgl.GetLoadsRequest())
        [load] = loads.loads
        assert load.num_running_reqs + load.num_waiting_reqs == 16 and load.max_running_requests == 16
        assert 0 < load.token_usage <= 1 and load.num_used_tokens > 0 and load.max_total_num_tokens == 8192
        assert loads.aggregate.total_reqs == 16
        busy.cancel()
        await wait_pages_free(w.engine)
        await asyncio.sleep(1.1)  # a second of history for the rate
        [idle] = (await w.sglang.GetLoads(sgl.GetLoadsRequest())).loads
        assert (idle.num_running_reqs, idle.num_waiting_reqs, idle.token_usage) == (0, 0, 0.0)
        assert idle.gen_throughput > 0


async def test_get_tokenizer_zip_loads_in_transformers(worker: Worker, tmp_path: Path) -> None:
    chunks = [c async for c in worker.sglang.GetTokenizer(common_pb2.GetTokenizerRequest())]
    data = b"".join(c.data for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert len(z.namelist()) <= 50
        z.extractall(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded.encode(PROMPT) == ids_of(worker.engine)
    messages = [{"role": "user", "content": "Hi"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == worker.engine.tokenizer.apply_chat_template(
        messages, tokenize=False)


async def test_api_keys_cover_the_worker_service(tiny: tuple[AsyncEngine, EngineConfig], tmp_path: Path) -> None:
    async with serving(*tiny, tmp_path, interceptors=(AuthInterceptor(ApiKeys.of(["k1"])),)) as w:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await w.sglang.HealthCheck(sgl.HealthCheckRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = await w.sglang.HealthCheck(sgl.HealthCheckRequest(), metadata=(("authorization", "Bearer k1"),))
        assert health.healthy


async def test_draining_is_unhealthy(tiny: tuple[AsyncEngine, EngineConfig],
                                                          tmp_path: Path) -> None:
    engine, config = tiny
    frontend = Frontend(engine, config, ServerConfig(host="127.0.0.1", port=0))
    service = SglangWorkerService(frontend, tmp_path)
    frontend.draining = True
    health = await service.HealthCheck(sgl.HealthCheckRequest(), None)  # type: ignore[arg-type]
    assert not health.healthy and "shutting down" in health.message


# ---- KV events and FlushCache ------------------------------------------------------------------------------------


async def kv_batches_until(events: Any, done: Any, limit: float = 60) -> list[common_pb2.KvEventBatch]:
    """Batches read from a SubscribeKvEvents call until done(batches) holds."""
    got: list[common_pb2.KvEventBatch] = []

    async def read() -> None:
        while not done(got):
            msg = await events.read()
            assert msg is not grpc.aio.EOF
            got.append(msg)

    await asyncio.wait_for(read(), limit)
    return got


def stored_blocks(batches: list[common_pb2.KvEventBatch]) -> list[common_pb2.KvBlock]:
    return [b for batch in batches for e in batch.events if e.HasField("stored") for b in e.stored.blocks]


async def test_kv_events_follow_the_prefix_cache_and_flush(worker: Worker) -> None:
    flushed = await worker.sglang.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10))
    assert flushed.success
    events = worker.sglang.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
        start_sequence_number=0, load_records_before_first_batch=True))
    first = await kv_batches_until(events, lambda got: len(got) >= 1)
    assert first[0].HasField("load")
    ids = ids_of(worker.engine, PROMPT * 4)[:40]  # two full pages of 16 and a partial one
    await call(worker, smg_request(ids, max_new_tokens=1))
    want = [ids[:16], ids[16:32]]
    batches = first + await kv_batches_until(
        events, lambda got: [list(b.token_ids) for b in stored_blocks(got)][-2:] == want)
    one, two = stored_blocks(batches)[-2:]
    assert (one.block_size, two.block_size) == (16, 16)
    parents = [e.stored for batch in batches for e in batch.events if e.HasField("stored")][-2:]
    assert not parents[0].HasField("parent_block_hash") and parents[1].parent_block_hash == one.block_hash
    assert all(batch.load.max_running_requests == 16 for batch in batches)

    flushed = await worker.sglang.FlushCache(common_pb2.FlushCacheRequest())
    assert flushed.success and worker.engine.engine.kv.num_cached_pages == 0
    batches += await kv_batches_until(
        events, lambda got: any(e.HasField("cleared") for batch in got for e in batch.events))
    numbered = [b.sequence_number for b in batches if not b.load.load_only]
    assert numbered == sorted(set(numbered))
    events.cancel()


async def test_flush_cache_refuses_while_a_request_runs(worker: Worker) -> None:
    stream = worker.sglang.Generate(smg_request(ids_of(worker.engine), stream=True, max_new_tokens=3000,
                                                ignore_eos=True))
    assert (await stream.read()).HasField("chunk")
    busy = await worker.sglang.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0))
    assert not busy.success and "in flight" in busy.message
    stream.cancel()
    await wait_pages_free(worker.engine)
    assert (await worker.sglang.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10))).success
