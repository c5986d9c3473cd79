"""The engine loop on a tiny random-weight Llama: batching never changes a greedy or seeded output, cancels and
aborts never leak pages, a tiny pool completes everything through preemption, and the prefix cache reports the
figures of docs/semantics.md "Prefix cache"."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.live import _Abort, _Add
from lmrpc.server.engine.types import EngineOutput, EngineRequest, FinishReason, LogprobOptions, SamplingParams

VOCAB_LOW, VOCAB_HIGH = 100, 40000  # ordinary tokens of the real tokenizer (no specials)


def make_engine(model_dir: Path, *, kv_tokens: int = 8192, page_size: int = 16, max_running: int = 64,
                max_batched: int = 256, max_buffered: int = 64) -> AsyncEngine:
    config = EngineConfig(
        model=ModelConfig(path=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(page_size=page_size, num_tokens=kv_tokens),
        scheduler=SchedulerConfig(max_running_requests=max_running, max_batched_tokens=max_batched,
                                  max_prefill_chunk=max_batched),
        sampling_defaults="openai",
        max_buffered_outputs=max_buffered,
    )
    return AsyncEngine.start(config)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[AsyncEngine]:
    eng = make_engine(tiny_llama_dir)
    yield eng
    eng.shutdown()


_counter = iter(range(10**9))


def request(prompt: list[int], params: SamplingParams, *, rid: str | None = None,
            logprobs: LogprobOptions | None = None, share: str | None = None) -> EngineRequest:
    rid = rid or f"r{next(_counter)}"
    return EngineRequest(request_id=rid, rid=rid, index=0, prompt_ids=tuple(prompt), params=params,
                         logprobs=logprobs, share_prefill_with=share)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


async def collect(eng: AsyncEngine, reqs: list[EngineRequest]) -> dict[str, list[EngineOutput]]:
    out: dict[str, list[EngineOutput]] = {r.request_id: [] for r in reqs}
    async for o in eng.generate(reqs):
        out[o.request_id].append(o)
    return out


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def wait_idle(eng: AsyncEngine) -> None:
    for _ in range(200):
        s = eng.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_used_pages == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {eng.stats()}")


GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


async def test_concurrent_greedy_equals_solo(engine: AsyncEngine) -> None:
    rng = random.Random(0)
    prompts = [random_prompt(rng, rng.randrange(3, 60)) for _ in range(16)]
    solo = []
    for p in prompts:
        res = await collect(engine, [request(p, GREEDY)])
        solo.append(tokens(next(iter(res.values()))))
    together = await collect(engine, [request(p, GREEDY, rid=f"c{i}") for i, p in enumerate(prompts)])
    for i in range(16):
        outs = together[f"c{i}"]
        assert tokens(outs) == solo[i], f"prompt {i} changed when batched"
        assert outs[-1].finish is not None and outs[-1].finish.reason is FinishReason.LENGTH
        assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 24
    await wait_idle(engine)


async def test_seeded_sampling_same_alone_and_in_busy_batch(engine: AsyncEngine) -> None:
    rng = random.Random(1)
    prompt = random_prompt(rng, 20)
    seeded = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = tokens(next(iter((await collect(engine, [request(prompt, seeded)])).values())))
    noise = [request(random_prompt(rng, rng.randrange(5, 40)),
                     SamplingParams(max_new_tokens=rng.randrange(5, 30), temperature=0.8, ignore_eos=True))
             for _ in range(8)]
    busy = await collect(engine, [*noise[:4], request(prompt, seeded, rid="seeded"), *noise[4:]])
    assert tokens(busy["seeded"]) == alone
    other_seed = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=50, seed=99, ignore_eos=True)
    assert tokens(next(iter((await collect(engine, [request(prompt, other_seed)])).values()))) != alone
    await wait_idle(engine)


async def test_random_cancels_and_aborts_return_every_page(engine: AsyncEngine) -> None:
    rng = random.Random(2)

    async def one(i: int) -> None:
        req = request(random_prompt(rng, rng.randrange(2, 80)),
                      SamplingParams(max_new_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True),
                      rid=f"m{i}")
        fate = rng.random()
        gen = engine.generate([req])
        try:
            n = 0
            async for out in gen:
                n += 1
                if fate < 0.3 and n >= 2:
                    break  # client cancel: closing the iterator aborts the request
                if fate > 0.7 and n == 1:
                    engine.abort([req.rid])
                if out.finish is not None and fate > 0.7:
                    assert out.finish.reason in (FinishReason.ABORT, FinishReason.LENGTH)
        finally:
            await gen.aclose()

    for start in range(0, 200, 40):
        await asyncio.gather(*(one(i) for i in range(start, start + 40)))
    await wait_idle(engine)
    stats = engine.stats()
    assert stats.num_used_pages == 0
    assert stats.num_free_pages == stats.num_pages


async def test_abort_while_queued_never_reaches_model(engine: AsyncEngine) -> None:
    outputs: list[EngineOutput] = []
    done = threading.Event()

    def sink(out: EngineOutput) -> None:
        outputs.append(out)
        if out.finish is not None:
            done.set()

    req = request([VOCAB_LOW] * 10, GREEDY, rid="queued")
    # Both commands sit in the inbox together, so the abort is applied before any step could run the request.
    engine.engine.submit(_Add(req, sink))
    engine.engine.submit(_Abort(req.request_id, "test"))
    assert await asyncio.to_thread(done.wait, 30)
    assert outputs[-1].finish is not None and outputs[-1].finish.reason is FinishReason.ABORT
    assert sum(len(o.token_ids) for o in outputs) == 0
    await wait_idle(engine)


async def test_tiny_pool_completes_everything_through_preemption(tiny_llama_dir: Path) -> None:
    rng = random.Random(3)
    prompts = [random_prompt(rng, rng.randrange(10, 30)) for _ in range(12)]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    big = make_engine(tiny_llama_dir)
    try:
        solo = [tokens(next(iter((await collect(big, [request(p, params)])).values()))) for p in prompts]
    finally:
        big.shutdown()
    small = make_engine(tiny_llama_dir, kv_tokens=16 * 12, page_size=16)  # 192 tokens for ~720 offered
    try:
        res = await collect(small, [request(p, params, rid=f"p{i}") for i, p in enumerate(prompts)])
        for i in range(12):
            assert tokens(res[f"p{i}"]) == solo[i]
        await wait_idle(small)
    finally:
        small.shutdown()


async def test_prefix_cache_figures(engine: AsyncEngine) -> None:
    rng = random.Random(4)
    long = random_prompt(rng, 1000)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)

    async def run(prompt: list[int]) -> tuple[int, list[int]]:
        outs = next(iter((await collect(engine, [request(prompt, params)])).values()))
        assert outs[-1].usage is not None
        return outs[-1].usage.cached_tokens, [t for o in outs for t in o.token_ids]

    assert (await run(long[:100]))[0] == 0
    first, computed = await run(long)
    assert first == 100  # 96 in place, 4 copied from the partial page the first request left
    again, reused = await run(long)
    assert again == 999  # all but the last token, which must be recomputed for its logits
    assert reused == computed  # copied and shared K/V give the same greedy continuation


async def test_n_samples_share_prompt_prefill(engine: AsyncEngine) -> None:
    rng = random.Random(5)
    prompt = random_prompt(rng, 70)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=7, ignore_eos=True)
    reqs = [request(prompt, params, rid="s/0")]
    reqs += [request(prompt, params, rid=f"s/{i}", share="s/0") for i in (1, 2)]
    res = await collect(engine, reqs)
    for i in (1, 2):
        usage = res[f"s/{i}"][-1].usage
        assert usage is not None and usage.cached_tokens >= 64


async def test_prompt_logprobs_and_scoring(engine: AsyncEngine) -> None:
    rng = random.Random(6)
    prompt = random_prompt(rng, 30)
    opts = LogprobOptions(start_len=0, top_k=3)
    outs = next(iter((await collect(engine, [request(prompt, SamplingParams(max_new_tokens=0),
                                                      logprobs=opts)])).values()))
    entries = [e for o in outs for e in o.input_logprobs]
    assert len(entries) == 30
    assert entries[0].chosen.logprob is None
    assert all(e.chosen.logprob is not None and e.chosen.logprob <= 0 for e in entries[1:])
    assert [e.chosen.token_id for e in entries] == prompt
    k = 10
    outs = next(iter((await collect(engine, [request(prompt, SamplingParams(max_new_tokens=0),
                                                      logprobs=LogprobOptions(start_len=k))])).values()))
    later = [e for o in outs for e in o.input_logprobs]
    assert len(later) == 30 - k
    for a, b in zip(later, entries[k:], strict=True):
        assert a.chosen.token_id == b.chosen.token_id
        assert a.chosen.logprob == pytest.approx(b.chosen.logprob, abs=1e-4)


def test_a_load_failure_is_raised_by_start(tmp_path: Path) -> None:
    """The engine thread loads the model; a failure there reaches the caller of start() instead of hanging it."""
    with pytest.raises(FileNotFoundError, match=r"HF model directory or a \.gguf file"):
        make_engine(tmp_path / "no-such-model")
