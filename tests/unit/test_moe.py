"""Our mixture-of-experts models (models/moe.py) against transformers on tiny random checkpoints: Qwen2-MoE (shared
expert, unnormalized top-k, a dense layer), Qwen3-MoE (normalized, q/k norms), Mixtral and OLMoE (full-width q/k
norms, clip_qkv). Logits through the paged
cache in float32 within 1e-4; 32 greedy tokens through the engine equal transformers' generate; 16 concurrent
requests give bitwise their solo tokens and logprobs (route invariance)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_models import assert_paged_logits_equal_transformers
from tiny_moe import save_tiny_moe
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from lmrpc.kernels import native
from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineOutput, EngineRequest, LogprobOptions, SamplingParams
from lmrpc.server.models.loader import load_model
from lmrpc.server.models.moe import MoEForCausalLM, SparseMLP

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_moe_logits_equal_transformers_through_paged_cache(
    arch: str, tmp_path: Path, smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    path = save_tiny_moe(arch, tmp_path / arch, smollm2_tokenizer, vocab_size=512)
    ours = load_model(ModelConfig(path=str(path), dtype="float32", device="cpu")).model
    assert isinstance(ours, MoEForCausalLM)
    sparse = [layer for layer in ours.layers if isinstance(getattr(layer, "mlp", None), SparseMLP)]
    assert len(sparse) == (2 if arch == "Qwen2MoeForCausalLM" else 3)  # Qwen2-MoE's last layer is dense here
    assert_paged_logits_equal_transformers(ours, path)


def start(path: Path) -> AsyncEngine:
    return AsyncEngine.start(EngineConfig(
        model=ModelConfig(path=str(path), dtype="float32", device="cpu"),
        cache=CacheConfig(page_size=16, num_tokens=8192),
        scheduler=SchedulerConfig(max_running_requests=32, max_batched_tokens=512, max_prefill_chunk=512),
        sampling_defaults="openai",
    ))


Run = tuple[tuple[int, ...], tuple[tuple[float | None, tuple[tuple[int, float | None], ...]], ...]]


async def generate(engine: AsyncEngine, requests: list[EngineRequest]) -> dict[str, Run]:
    outs: dict[str, list[EngineOutput]] = {r.request_id: [] for r in requests}
    async for o in engine.generate(requests):
        outs[o.request_id].append(o)
    return {
        rid: (tuple(t for o in pieces for t in o.token_ids),
              tuple((p.chosen.logprob, tuple((t.token_id, t.logprob) for t in p.top))
                    for o in pieces for p in o.output_logprobs))
        for rid, pieces in outs.items()
    }


def greedy(rid: str, prompt: list[int], new: int) -> EngineRequest:
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, rid, 0, tuple(prompt), params, LogprobOptions(top_k=3))


@pytest.mark.skipif(not native.available(), reason="route invariance rests on the native kernels")
@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM"])
def test_moe_greedy_equals_transformers_and_concurrent_equals_solo(
    arch: str, tmp_path: Path, smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    path = save_tiny_moe(arch, tmp_path / arch, smollm2_tokenizer)
    prompts = [list(range(200 + 37 * i, 200 + 37 * i + 5 + 3 * i)) for i in range(16)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    expected = tuple(ref[0, len(prompts[0]):].tolist())
    engine = start(path)
    try:
        solo = {f"s{i}": asyncio.run(generate(engine, [greedy(f"s{i}", p, 32)]))[f"s{i}"]
                for i, p in enumerate(prompts)}
        assert solo["s0"][0] == expected  # 32 greedy tokens equal transformers'
        together = asyncio.run(generate(engine, [greedy(f"t{i}", p, 32) for i, p in enumerate(prompts)]))
    finally:
        engine.shutdown()
    for i in range(16):
        assert together[f"t{i}"] == solo[f"s{i}"]  # tokens and logprobs, bitwise
