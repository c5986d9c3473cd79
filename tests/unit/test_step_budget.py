"""The step token budget sized to the model (engine/step_budget.py): its rule, the scheduler's limits it fills, and an
engine that sizes an unset budget to the model it loaded while a given one wins."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.kv_cache import KVCacheManager
from lmrpc.server.engine.scheduler import Scheduler
from lmrpc.server.engine.sequence import Sequence
from lmrpc.server.engine.step_budget import MAX_STEP_TOKENS, macs_per_token, step_token_budget
from lmrpc.server.engine.types import EngineRequest, SamplingParams


@pytest.mark.parametrize(("macs", "tokens"), [
    (134_000_000, 512),  # SmolLM2-135M: its layers and its output head
    (362_000_000, 256),  # SmolLM2-360M
    (1_710_000_000, 128),  # SmolLM2-1.7B
    (7_000_000_000, 128),  # never below the floor
    (1_000, 512),  # never above the ceiling
    (0, 512),  # unknown
])
def test_the_budget_shrinks_as_the_model_grows(macs: int, tokens: int) -> None:
    assert step_token_budget(macs, gpu=False) == tokens


def test_gpus_keep_the_largest_budget() -> None:
    assert step_token_budget(1_710_000_000, gpu=True) == MAX_STEP_TOKENS


def test_budgets_never_grow_with_the_model() -> None:
    budgets = [step_token_budget(m, gpu=False) for m in range(10_000_000, 4_000_000_000, 10_000_000)]
    assert budgets == sorted(budgets, reverse=True)
    assert all(b & (b - 1) == 0 for b in budgets)  # powers of two


@dataclass
class _Layer:
    in_features: int
    out_features: int


@dataclass
class _Model:
    layers: tuple[_Layer, ...]

    def linear_layers(self) -> list[_Layer]:
        return list(self.layers)


def test_macs_count_every_linear_layer_once() -> None:
    model = _Model((_Layer(64, 128), _Layer(128, 64), _Layer(64, 1000)))
    assert macs_per_token(model) == 64 * 128 + 128 * 64 + 64 * 1000
    assert macs_per_token(object()) == 0  # a model that does not list its products: unknown


def test_unset_limits_take_the_budget_and_given_ones_stay() -> None:
    assert SchedulerConfig().with_budget(128) == SchedulerConfig(max_batched_tokens=128, max_prefill_chunk=128)
    given = SchedulerConfig(max_batched_tokens=300)
    assert given.with_budget(128) == SchedulerConfig(max_batched_tokens=300, max_prefill_chunk=300)
    assert SchedulerConfig(max_prefill_chunk=64).with_budget(128).max_prefill_chunk == 64
    with pytest.raises(ValueError, match="token budgets"):
        SchedulerConfig(max_batched_tokens=0)


def test_a_step_computes_no_more_than_its_budget() -> None:
    scheduler = Scheduler(SchedulerConfig().with_budget(128), KVCacheManager(64, 16))
    for i in range(8):  # eight 64-token prompts arriving together: two a step, their first tokens sooner
        req = EngineRequest(f"s{i}", f"s{i}", 0, tuple(range(100, 164)), SamplingParams(max_new_tokens=4))
        scheduler.add(Sequence(req))
    batch = scheduler.schedule()
    assert [c.num_tokens for c in batch.chunks] == [64, 64]
    alone = Scheduler(SchedulerConfig(), KVCacheManager(64, 16))  # not sized by an engine: the largest budget
    assert (alone.step_tokens, alone.chunk_tokens) == (MAX_STEP_TOKENS, MAX_STEP_TOKENS)


def _engine(model_dir: Path, scheduler: SchedulerConfig) -> AsyncEngine:
    return AsyncEngine.start(EngineConfig(
        model=ModelConfig(path=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(num_tokens=1024), scheduler=scheduler, sampling_defaults="openai"))


def test_the_engine_sizes_an_unset_budget_to_its_model_and_a_given_one_wins(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, SchedulerConfig())
    try:
        # The tiny Llama (tests/conftest.py): 2 layers of hidden 64, 4 heads and 2 KV heads of 16, MLP 128; the
        # output head over SmolLM2's 49,152 tokens.
        layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 2 * 128 + 128 * 64
        macs = macs_per_token(engine.engine.executor.model)
        assert macs == 2 * layer + 64 * 49152
        budget = step_token_budget(macs, gpu=False)
        assert engine.scheduler_config == SchedulerConfig(max_batched_tokens=budget, max_prefill_chunk=budget)
        assert engine.engine.scheduler.step_tokens == budget
    finally:
        engine.shutdown()
    engine = _engine(tiny_llama_dir, SchedulerConfig(max_batched_tokens=48))
    try:
        assert (engine.scheduler_config.max_batched_tokens, engine.scheduler_config.max_prefill_chunk) == (48, 48)
    finally:
        engine.shutdown()
