"""Throughput with LoRA adapters next to the base model, in one engine: 8 streams on the base model against 8
streams spread over 4 adapters (2 each), decode tok/s. Issue 14's target: the adapters' figure >= 70% of the base's.

    .venv/bin/python bench/lora.py [--model PATH] [--streams 8] [--adapters 4] [--rank 16] [--prompt-len 64]
                                   [--new-tokens 64] [--repeats 3]

The adapters are written here in PEFT's format (random A and B on all seven projections of every layer, rank
--rank) into a temporary directory; nothing is downloaded. The two workloads alternate within each round; figures
are medians over rounds, and the ratio is the median of the rounds' own ratios (a shared machine's load drifts
between rounds more than within one). Each workload's prompts are new random tokens (no prefix-cache hits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmrpc.server.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineRequest, SamplingParams
from lmrpc.server.models.llama import LlamaForCausalLM
from lmrpc.server.models.loader import default_gguf, load_model


def write_adapters(model_path: str, root: Path, count: int, rank: int) -> list[str]:
    """`count` random PEFT adapters of the model at `model_path` under `root`; returns their directories."""
    model = load_model(ModelConfig(path=model_path, dtype="float32", device="cpu")).model
    assert isinstance(model, LlamaForCausalLM), "adapters need our Llama-family model"
    features = model.lora_features()
    generator = torch.Generator().manual_seed(0)
    dirs = []
    for i in range(count):
        tensors = {}
        for layer in range(model.shape.layers):
            for module, (fan_in, fan_out) in features.items():
                block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
        path = root / f"adapter{i}"
        path.mkdir()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(features),
            "bias": "none"}))
        dirs.append(str(path))
    return dirs


async def run(engine: AsyncEngine, names: list[str | None], prompt_len: int, new_tokens: int, seed: int) -> float:
    """Decode tok/s of one stream per entry of `names` (an adapter name, or None for the base model)."""
    rng = random.Random(seed)
    requests = []
    for i, name in enumerate(names):
        adapter = engine.lora.get(name) if name is not None else None
        rid = f"s{seed}-{i}"
        requests.append(EngineRequest(
            rid, rid, 0, tuple(rng.randrange(100, 40000) for _ in range(prompt_len)),
            SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True), adapter=adapter))
    first: float | None = None
    tokens = 0
    async for out in engine.generate(requests):
        if out.token_ids:
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                tokens += len(out.token_ids)
    assert first is not None
    return tokens / (time.perf_counter() - first)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_gguf()))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_adapters(args.model, Path(tmp), args.adapters, args.rank)
        names = [f"a{i}" for i in range(args.adapters)]
        engine = AsyncEngine.start(EngineConfig(
            model=ModelConfig(path=args.model),
            cache=CacheConfig(num_tokens=16384),
            scheduler=SchedulerConfig(max_running_requests=64),
            lora=LoraConfig(lora_modules=tuple(zip(names, dirs, strict=True)), max_loras_per_batch=args.adapters),
        ))
        mixed: list[str | None] = [names[i % args.adapters] for i in range(args.streams)]
        base_only: list[str | None] = [None] * args.streams
        asyncio.run(run(engine, mixed, 8, 4, seed=-1))  # warm-up: first calls' one-time costs
        base, lora = [], []
        for r in range(args.repeats):
            order = [(base_only, base), (mixed, lora)]
            for names_, figures in order if r % 2 == 0 else reversed(order):
                figures.append(asyncio.run(run(engine, names_, args.prompt_len, args.new_tokens, seed=r)))
        engine.shutdown()
    b, m = statistics.median(base), statistics.median(lora)
    ratios = [x / y for x, y in zip(lora, base, strict=True)]  # within a round: the two ran back to back
    print(f"{args.streams} streams, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
          f"{args.adapters} adapters of rank {args.rank}:")
    print(f"  base model     {b:8.1f} tok/s decode  (rounds: {', '.join(f'{x:.1f}' for x in base)})")
    print(f"  over adapters  {m:8.1f} tok/s decode  (rounds: {', '.join(f'{x:.1f}' for x in lora)})")
    print(f"  ratio per round {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f} "
          f"(target >= 0.70)")

if __name__ == "__main__":
    main()
