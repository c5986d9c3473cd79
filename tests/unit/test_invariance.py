"""Route invariance: one request's tokens and logprobs are bitwise the same whatever route it takes through the
engine. Every engine here starts cold (nothing cached, nothing warmed); each route is compared with the request run
alone on its own fresh engine:

- as a full prefix-cache hit (the same request again) and a partial one (a cached page's head copied);
- inside a batch of 31 other requests of many lengths (15 on the real SmolLM2: its decode steps still take the
  products' many-row path);
- with its prompt prefilled in chunks of 16 tokens next to decodes (--max-batched-tokens 16);
- after being preempted and recomputed (a pool too small for everything at once);
- as each sample of n = 3 sharing one prefill;
- and the greedy token is the top-1 logprob at every position; a seeded sampled request is the same alone and busy.

Matrix: float32 and bfloat16, dense and int4 (and int8 in bfloat16), on a tiny random Llama with SmolLM2's attention
geometry (heads of 64, 3 query heads per kv head), and on the real SmolLM2 as it is served by default (bfloat16, its
own int4 blocks).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny_llama import save_tiny_llama
from transformers import PreTrainedTokenizerBase

from lmrpc.kernels import native
from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.sequence import Sequence
from lmrpc.server.engine.types import EngineOutput, EngineRequest, LogprobOptions, SamplingParams

pytestmark = pytest.mark.skipif(not native.available(), reason="route invariance rests on the native kernels")

TOP = 5  # logprob alternatives compared at every position


@pytest.fixture(scope="module")
def geometry_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: PreTrainedTokenizerBase) -> Path:
    """A 2-layer random Llama with SmolLM2's head geometry and vocabulary (random weights: near-tied logits, so any
    numeric difference between routes shows in the tokens)."""
    return save_tiny_llama(tmp_path_factory.mktemp("geometry-llama"), smollm2_tokenizer, hidden=192,
                           intermediate=512, heads=3, kv_heads=1, max_positions=2048)


@dataclass(frozen=True)
class Result:
    tokens: tuple[int, ...]
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...]  # per position: chosen, top (id, logprob)


def start(model: Path, dtype: str, quantization: str, *, kv_tokens: int = 16384, max_batched: int = 512,
          prefix_cache: bool = True) -> AsyncEngine:
    """quantization: --quantization's value, "+int8-activations" appended for --int8-activations."""
    quantization, _, extra = quantization.partition("+")
    return AsyncEngine.start(EngineConfig(
        model=ModelConfig(path=str(model), dtype=dtype, device="cpu", quantization=quantization,
                          int8_activations=extra == "int8-activations"),
        cache=CacheConfig(page_size=16, num_tokens=kv_tokens, enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(max_running_requests=64, max_batched_tokens=max_batched,
                                  max_prefill_chunk=max_batched),
        sampling_defaults="openai",
    ))


_ids = iter(range(10**9))


def req(prompt: list[int], new: int, *, seed: int | None = None, temperature: float = 0.0,
        share: str | None = None, rid: str | None = None) -> EngineRequest:
    rid = rid or f"q{next(_ids)}"
    params = SamplingParams(max_new_tokens=new, temperature=temperature, seed=seed, ignore_eos=True)
    return EngineRequest(rid, rid, 0, tuple(prompt), params, LogprobOptions(top_k=TOP), share)


async def run(engine: AsyncEngine, requests: list[EngineRequest]) -> dict[str, Result]:
    outs: dict[str, list[EngineOutput]] = {r.request_id: [] for r in requests}
    async for o in engine.generate(requests):
        outs[o.request_id].append(o)
    results = {}
    for rid, pieces in outs.items():
        lps = tuple(
            (p.chosen.logprob or 0.0, tuple((t.token_id, t.logprob or 0.0) for t in p.top))
            for o in pieces for p in o.output_logprobs
        )
        results[rid] = Result(tuple(t for o in pieces for t in o.token_ids), lps)
    return results


def prompts(seed: int, count: int, low: int = 3, high: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(low, high))] for _ in range(count)]


TARGET = prompts(1, 1, 37, 38)[0]  # 37 tokens: two full pages and a partial one
NEW = 24


def alone(model: Path, dtype: str, quantization: str, target: EngineRequest) -> Result:
    engine = start(model, dtype, quantization)
    try:
        return asyncio.run(run(engine, [target]))[target.request_id]
    finally:
        engine.shutdown()


def check_routes(model: Path, dtype: str, quantization: str, others: int = 31) -> None:
    expected = alone(model, dtype, quantization, req(TARGET, NEW))
    assert len(expected.tokens) == NEW
    # The greedy token is the best logprob at every position (logprobs are float32, computed from float32 logits).
    for token, (chosen, top) in zip(expected.tokens, expected.logprobs, strict=True):
        assert top[0][0] == token and top[0][1] == chosen

    # Prefix-cache hits: the same request again (all but its last prompt token cached), and after another prompt
    # that shares its first 21 tokens (one full page shared, five tokens of the next copied).
    engine = start(model, dtype, quantization)
    try:
        first = asyncio.run(run(engine, [req(TARGET, NEW)]))
        again = asyncio.run(run(engine, [req(TARGET, NEW)]))
        assert list(first.values()) == [expected] and list(again.values()) == [expected]
    finally:
        engine.shutdown()
    engine = start(model, dtype, quantization)
    try:
        asyncio.run(run(engine, [req([*TARGET[:21], 7, 8, 9], 3)]))
        assert list(asyncio.run(run(engine, [req(TARGET, NEW)])).values()) == [expected]
    finally:
        engine.shutdown()

    # Inside `others` requests of many lengths (the target in the middle of the batch), then chunked prefill.
    batch = [req(p, 16) for p in prompts(2, others)]
    target = req(TARGET, NEW)
    engine = start(model, dtype, quantization)
    try:
        half = others // 2
        assert asyncio.run(run(engine, [*batch[:half], target, *batch[half:]]))[target.request_id] == expected
    finally:
        engine.shutdown()
    target = req(TARGET, NEW)
    engine = start(model, dtype, quantization, max_batched=16)
    try:
        batch = [req(p, 20) for p in prompts(3, 3)] + [target]
        assert asyncio.run(run(engine, batch))[target.request_id] == expected
    finally:
        engine.shutdown()

    # Preemption: 8 pages for four requests that need 5 each; the newest (the target) is preempted and recomputed.
    target = req(TARGET, NEW)
    engine = start(model, dtype, quantization, kv_tokens=8 * 16)
    preempted: list[str] = []
    scheduler = engine.engine.scheduler
    original = scheduler._preempt

    def record(seq: Sequence) -> None:
        preempted.append(seq.request_id)
        original(seq)

    scheduler._preempt = record  # type: ignore[method-assign]
    try:
        batch = [req(p, 40) for p in prompts(4, 3, 30, 40)] + [target]
        assert asyncio.run(run(engine, batch))[target.request_id] == expected
        assert target.request_id in preempted
    finally:
        engine.shutdown()

    # n = 3 greedy samples sharing one prefill: each is the request alone.
    engine = start(model, dtype, quantization)
    try:
        first = req(TARGET, NEW, rid="n/0")
        siblings = [first, req(TARGET, NEW, rid="n/1", share="n/0"), req(TARGET, NEW, rid="n/2", share="n/0")]
        assert list(asyncio.run(run(engine, siblings)).values()) == [expected] * 3
    finally:
        engine.shutdown()


COMBOS = [("float32", "none"), ("bfloat16", "none"), ("float32", "int4"), ("bfloat16", "int4"), ("bfloat16", "int8")]


@pytest.mark.parametrize(("dtype", "quantization"), COMBOS, ids=["-".join(c) for c in COMBOS])
def test_every_route_gives_the_same_bits_tiny(geometry_llama_dir: Path, dtype: str, quantization: str) -> None:
    check_routes(geometry_llama_dir, dtype, quantization)


def _int8_dtype() -> str | None:
    """The model dtype whose int4 products take int8 activations in this build (VNNI: bfloat16, AVX2: float32)."""
    if not native.available():
        return None
    lib = native.load()
    return "bfloat16" if lib.native_vnni() else "float32" if lib.native_avx2() else None


@pytest.mark.skipif(_int8_dtype() is None, reason="no int8-activation products in this build")
def test_every_route_gives_the_same_bits_with_int8_activations(geometry_llama_dir: Path) -> None:
    dtype = _int8_dtype()
    assert dtype is not None
    check_routes(geometry_llama_dir, dtype, "int4+int8-activations")


@pytest.mark.slow
def test_every_route_gives_the_same_bits_smollm2_as_served(smollm2_gguf: Path) -> None:
    """The default server: bfloat16, the GGUF's own Q4_1/Q8_0 blocks. A batch of 16 on the real model (decode
    steps of 16 rows: past the 8 from which the products take their many-row path); the tiny model takes 32."""
    check_routes(smollm2_gguf, "auto", "auto", others=15)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_alone_equals_batched_and_cached_smollm2_dense(smollm2_gguf: Path, dtype: str) -> None:
    expected = alone(smollm2_gguf, dtype, "none", req(TARGET, NEW))
    engine = start(smollm2_gguf, dtype, "none")
    try:
        target = req(TARGET, NEW)
        batch = [req(p, 16) for p in prompts(5, 31)]
        assert asyncio.run(run(engine, [*batch[:7], target, *batch[7:]]))[target.request_id] == expected
        assert list(asyncio.run(run(engine, [req(TARGET, NEW)])).values()) == [expected]  # now a cache hit
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def bf16_int4(geometry_llama_dir: Path) -> Iterator[AsyncEngine]:
    engine = start(geometry_llama_dir, "bfloat16", "int4")
    yield engine
    engine.shutdown()


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(bf16_int4: AsyncEngine,
                                                               geometry_llama_dir: Path) -> None:
    sampled = dict(temperature=0.9, seed=1234)
    expected = alone(geometry_llama_dir, "bfloat16", "int4", req(TARGET, NEW, **sampled))  # type: ignore[arg-type]
    target = req(TARGET, NEW, **sampled)  # type: ignore[arg-type]
    busy = [req(p, 20, temperature=1.0, seed=i) for i, p in enumerate(prompts(6, 20))] + [target]
    assert asyncio.run(run(bf16_int4, busy))[target.request_id] == expected
    # and a different seed gives a different output (the seed is honoured, not ignored)
    other = asyncio.run(run(bf16_int4, [req(TARGET, NEW, temperature=0.9, seed=4321)]))
    assert next(iter(other.values())).tokens != expected.tokens
