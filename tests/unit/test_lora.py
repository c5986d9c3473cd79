"""LoRA adapters on the tiny model: our deltas equal peft's merged model (logits within 1e-4, greedy tokens equal),
a batch mixing the base model and adapters equals each request run alone (bitwise), the prefix cache never shares
pages between adapters, --max-loras-per-batch bounds a step's adapters, and the registry's rules (root, LRU, pins,
errors)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from lora_adapters import make_adapter, make_adapter_for, merged_model
from peft import PeftModel
from tiny_gguf import TINY, write_tiny_llama
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)
from transformers import LlamaForCausalLM as HFLlama

from lmrpc.kernels import native
from lmrpc.kernels.paged import ChunkSpec
from lmrpc.server import validation
from lmrpc.server.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.sequence import ScheduledBatch
from lmrpc.server.engine.types import EngineOutput, EngineRequest, LogprobOptions, SamplingParams
from lmrpc.server.lora.errors import AdapterError, AdapterErrorKind
from lmrpc.server.lora.registry import LoadedAdapter, LoraRegistry
from lmrpc.server.models import ForwardContext
from lmrpc.server.models.llama import LlamaForCausalLM
from lmrpc.server.models.loader import load_model
from lmrpc.server.models.lora_delta import RowGroup
from lmrpc.server.models.quantized import StackedLinear

PAGE = 16


def save_random(config: PretrainedConfig, path: Path, tokenizer: PreTrainedTokenizerBase) -> Path:
    """A random-weight model of `config` (random biases and norm weights too) saved as an HF directory."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """Under one root: adapters a1..a4 of the tiny Llama (all seven modules, different ranks and seeds)."""
    root = tmp_path_factory.mktemp("adapters")
    for i, rank in enumerate((8, 4, 16, 2), start=1):
        make_adapter(tiny_llama_dir, root / f"a{i}", rank=rank, alpha=2.0 * rank, seed=i)
    return root


def _forward_logits(model: LlamaForCausalLM, tokens: list[int], adapter: LoadedAdapter | None) -> torch.Tensor:
    """A 25-token prefill chunk then single-token decodes through the paged cache: logits [len, vocab]."""
    attention = model.make_attention(2 * (len(tokens) // PAGE + 2), PAGE)
    pages = list(range(0, 2 * (len(tokens) // PAGE + 2), 2))  # non-contiguous page table
    out = []
    steps = [(0, 25)] + [(i, i + 1) for i in range(25, len(tokens))]
    with torch.inference_mode():
        for start, end in steps:
            plan = attention.plan([ChunkSpec(start, end - start, pages)], torch.arange(start, end))
            lora = (RowGroup(torch.arange(end - start), adapter.layers, adapter.stack),) if adapter is not None else ()
            hidden = model.forward(torch.tensor(tokens[start:end]), ForwardContext(attention, plan), lora=lora)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


@pytest.mark.parametrize(("arch", "targets", "rslora"), [
    ("LlamaForCausalLM", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    ("LlamaForCausalLM", ("k_proj", "up_proj"), True),  # slices of the fused products alone; alpha/sqrt(r)
    ("LlamaForCausalLM", ("v_proj", "o_proj", "down_proj"), False),
    ("Qwen2ForCausalLM", ("q_proj", "v_proj", "gate_proj", "down_proj"), False),  # qkv bias
])
def test_logits_equal_peft_merged_model(arch: str, targets: tuple[str, ...], rslora: bool, tmp_path: Path,
                                        smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    config = (LlamaConfig(**common, architectures=[arch]) if arch == "LlamaForCausalLM"
              else Qwen2Config(**common, architectures=[arch], tie_word_embeddings=False))
    base = save_random(config, tmp_path / "base", smollm2_tokenizer)
    adapter_dir = make_adapter(base, tmp_path / "adapter", rank=8, alpha=16.0, targets=targets, rslora=rslora)
    model = load_model(ModelConfig(path=str(base), dtype="float32", device="cpu")).model
    assert isinstance(model, LlamaForCausalLM)
    adapter = LoraRegistry(LoraConfig(), model).load("t", str(adapter_dir), confined=False)
    assert adapter.target_modules == tuple(sorted(targets))
    tokens = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = merged_model(base, adapter_dir)(torch.tensor([tokens])).logits[0]  # [40, vocab]
        base_logits = merged_model(base, None)(torch.tensor([tokens])).logits[0]
    got = _forward_logits(model, tokens, adapter)
    assert (expected - base_logits).abs().max() > 1e-2  # the adapter changes the outputs: the check has teeth
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


class _StackSpy:
    """The native decoder stack, counting the calls that carried adapter rows (so a test knows which path ran)."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self.with_lora = 0

    def forward(self, *args: Any) -> torch.Tensor:
        self.with_lora += bool(args[-1])
        return self.stack.forward(*args)


@pytest.mark.skipif(not native.available(), reason="the native decoder stack needs the native kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_stack_gives_the_python_loops_bits_for_a_mixed_batch(dtype: str, tiny_llama_dir: Path,
                                                                    lora_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One prefill step of five sequences (the base model, a1, a2, a3 and a1 again, so a1's rows are not contiguous),
    then three decode steps: the native stack's logits equal the Python per-layer loop's bitwise, and the base rows
    equal those of a step with no adapters at all."""
    model = load_model(ModelConfig(path=str(tiny_llama_dir), dtype=dtype, device="cpu")).model
    assert isinstance(model, LlamaForCausalLM)
    _native_stack_equals_python_loop(model, lora_dir, monkeypatch)


@pytest.mark.skipif(not native.available(), reason="the native decoder stack needs the native kernels")
def test_native_stack_gives_the_python_loops_bits_over_products_of_stacked_parts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same over a Q4_K_M-style GGUF (q and k in Q4_K, v in Q6_K): the fused qkv product runs as two parts, and
    the adapters' deltas land on the right columns of both in the one-call stack."""
    path = write_tiny_llama(tmp_path / "tiny-q4_k_m.gguf", gguf.GGMLQuantizationType.Q4_K,
                            v_down=gguf.GGMLQuantizationType.Q6_K)
    model = load_model(ModelConfig(path=str(path), dtype="bfloat16", device="cpu")).model
    assert isinstance(model, LlamaForCausalLM) and isinstance(model.layers[0].qkv, StackedLinear)
    c = TINY
    shape = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                        num_key_value_heads=c["kv_heads"], tie_word_embeddings=True)
    for i, rank in enumerate((8, 4, 16), start=1):
        make_adapter_for(HFLlama(shape), tmp_path / f"a{i}", rank=rank, alpha=2.0 * rank, seed=i)
    _native_stack_equals_python_loop(model, tmp_path, monkeypatch)


def _native_stack_equals_python_loop(model: LlamaForCausalLM, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = LoraRegistry(LoraConfig(), model)
    loaded = {n: registry.load(n, str(root / n), confined=False) for n in ("a1", "a2", "a3")}
    owners: list[LoadedAdapter | None] = [None, loaded["a1"], loaded["a2"], loaded["a3"], loaded["a1"]]
    assert all(a is None or a.stack is not None for a in owners)
    generator = torch.Generator().manual_seed(5)
    tokens = [torch.randint(3, 49152, (n + 3,), generator=generator).tolist() for n in (7, 19, 3, 25, 11)]
    prompt_lens = [len(t) - 3 for t in tokens]

    def run(path: str) -> list[torch.Tensor]:
        attention = model.make_attention(4 * len(tokens), PAGE)
        assert model._stack is not None  # native attention and products: the one-call stack exists
        spy = _StackSpy(model._stack.stack)
        monkeypatch.setattr(model, "_stack", dataclasses.replace(model._stack, stack=spy))
        steps = [[(0, n) for n in prompt_lens]] + [[(n + d, n + d + 1) for n in prompt_lens] for d in range(3)]
        logits = []
        with torch.inference_mode():
            for spans in steps:
                chunks, ids, positions = [], [], []
                groups: dict[int, list[int]] = {}
                for i, (start, end) in enumerate(spans):
                    chunks.append(ChunkSpec(start, end - start, list(range(4 * i, 4 * i + 4))))
                    adapter = owners[i]
                    if adapter is not None:
                        groups.setdefault(adapter.uid, []).extend(range(len(ids), len(ids) + end - start))
                    ids += tokens[i][start:end]
                    positions += range(start, end)
                by_uid = {a.uid: a for a in owners if a is not None}
                lora = () if path == "base" else tuple(
                    RowGroup(torch.tensor(rows), by_uid[uid].layers, by_uid[uid].stack if path == "native" else None)
                    for uid, rows in groups.items())
                plan = attention.plan(chunks, torch.tensor(positions))
                hidden = model.forward(torch.tensor(ids), ForwardContext(attention, plan), lora=lora)
                logits.append(model.compute_logits(hidden))  # [T, vocab]
        assert spy.with_lora == (len(steps) if path == "native" else 0)
        return logits

    native_logits, python_logits, base_logits = run("native"), run("python"), run("base")
    for step, (n, p, b) in enumerate(zip(native_logits, python_logits, base_logits, strict=True)):
        assert torch.equal(n, p), f"step {step}"
        base_rows = prompt_lens[0] if step == 0 else 1  # sequence 0's rows come first
        assert torch.equal(n[:base_rows], b[:base_rows]), f"step {step}: the base rows"
        assert (n[base_rows:] - b[base_rows:]).abs().max() > 1e-3  # the adapters change their rows


# ---- through the engine --------------------------------------------------------------------------------------


def _start(model: Path, root: Path, names: tuple[str, ...], *, prefix_cache: bool = True, max_loras: int = 8,
           max_loaded: int = 16) -> AsyncEngine:
    return AsyncEngine.start(EngineConfig(
        model=ModelConfig(path=str(model), dtype="float32", device="cpu"),
        cache=CacheConfig(page_size=PAGE, num_tokens=8192, enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(max_running_requests=64, max_batched_tokens=512, max_prefill_chunk=512),
        sampling_defaults="openai",
        lora=LoraConfig(lora_modules=tuple((n, str(root / n)) for n in names), max_loras_per_batch=max_loras,
                        max_loaded_loras=max_loaded, lora_root=str(root)),
    ))


_serial = iter(range(10**9))


def _req(prompt: list[int], new: int, adapter: LoadedAdapter | None) -> EngineRequest:
    rid = f"r{next(_serial)}"
    return EngineRequest(rid, rid, 0, tuple(prompt), SamplingParams(max_new_tokens=new, temperature=0.0,
                                                                    ignore_eos=True),
                         LogprobOptions(top_k=5), adapter=adapter)


Result = tuple[tuple[int, ...], tuple[tuple[float | None, tuple[tuple[int, float | None], ...]], ...], int]


async def _run(engine: AsyncEngine, requests: list[EngineRequest]) -> dict[str, Result]:
    outs: dict[str, list[EngineOutput]] = {}
    async for out in engine.generate(requests):
        outs.setdefault(out.request_id, []).append(out)
    results: dict[str, Result] = {}
    for rid, pieces in outs.items():
        tokens = tuple(t for p in pieces for t in p.token_ids)
        logprobs = tuple((lp.chosen.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                         for p in pieces for lp in p.output_logprobs)
        usage = pieces[-1].usage
        results[rid] = (tokens, logprobs, usage.cached_tokens if usage is not None else -1)
    return results


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, lora_dir: Path) -> Iterator[AsyncEngine]:
    yield _start(tiny_llama_dir, lora_dir, ("a1", "a2", "a3"))


def test_greedy_tokens_equal_peft_merged_model(engine: AsyncEngine, tiny_llama_dir: Path, lora_dir: Path) -> None:
    prompt = list(engine.tokenizer.encode("The quick brown fox jumps over"))
    for name in ("a1", "a3"):
        adapter = engine.lora.get(name)
        assert adapter is not None
        [(tokens, _, _)] = asyncio.run(_run(engine, [_req(prompt, 32, adapter)])).values()
        reference = merged_model(tiny_llama_dir, lora_dir / name)
        with torch.no_grad():
            ids = torch.tensor([prompt])
            for _ in range(32):  # greedy, no EOS stop: as ignore_eos
                ids = torch.cat([ids, reference(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert tokens == tuple(ids[0, len(prompt):].tolist()), name
    [(base_tokens, _, _)] = asyncio.run(_run(engine, [_req(prompt, 32, None)])).values()
    assert base_tokens != tokens  # the adapter changed the output


@pytest.mark.skipif(not native.available(), reason="bitwise batch invariance rests on the native kernels")
def test_batch_of_base_and_three_adapters_equals_each_alone(engine: AsyncEngine, tiny_llama_dir: Path,
                                                            lora_dir: Path) -> None:
    adapters: list[LoadedAdapter | None] = [None, engine.lora.get("a1"), engine.lora.get("a2"), engine.lora.get("a3")]
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (int(n),), generator=generator).tolist()
               for n in torch.randint(5, 60, (16,), generator=generator)]
    batch = [_req(p, 12, adapters[i % 4]) for i, p in enumerate(prompts)]
    together = asyncio.run(_run(engine, batch))
    # Alone: each request on an engine with no prefix cache and nothing else running.
    alone_engine = _start(tiny_llama_dir, lora_dir, ("a1", "a2", "a3"), prefix_cache=False)
    try:
        for i, request in enumerate(batch):
            adapter = request.adapter
            own = alone_engine.lora.get(adapter.name) if adapter is not None else None
            [alone] = asyncio.run(_run(alone_engine, [_req(list(request.prompt_ids), 12, own)])).values()
            assert together[request.request_id][:2] == alone[:2], f"request {i} ({adapter and adapter.name})"
    finally:
        alone_engine.shutdown()
    distinct = {r[0] for r in together.values()}
    assert len(distinct) > 4  # the adapters produce different outputs


def test_prefix_cache_never_shares_pages_between_adapters(engine: AsyncEngine) -> None:
    prompt = list(range(100, 170))  # 70 tokens: 4 full pages
    a1, a2 = engine.lora.get("a1"), engine.lora.get("a2")
    first = asyncio.run(_run(engine, [_req(prompt, 2, a1)]))
    other = asyncio.run(_run(engine, [_req(prompt, 2, a2)]))
    base = asyncio.run(_run(engine, [_req(prompt, 2, None)]))
    again = asyncio.run(_run(engine, [_req(prompt, 2, a1)]))
    assert [r[2] for r in first.values()] == [0]
    assert [r[2] for r in other.values()] == [0]
    assert [r[2] for r in base.values()] == [0]
    assert [r[2] for r in again.values()] == [69]  # the same adapter reuses its own pages
    assert [r[0] for r in again.values()] == [r[0] for r in first.values()]
    engine.engine.kv.check_invariants()


def test_max_loras_per_batch_bounds_each_step(tiny_llama_dir: Path, lora_dir: Path) -> None:
    engine = _start(tiny_llama_dir, lora_dir, ("a1", "a2", "a3"), max_loras=2)
    seen: list[int] = []

    def hook(batch: ScheduledBatch) -> None:
        seen.append(len({c.seq.adapter_uid for c in batch.chunks if c.seq.adapter_uid is not None}))

    engine.engine.step_hook = hook
    names = ["a1", "a2", "a3"]
    requests = [_req(list(range(10 + i, 30 + i)), 6, engine.lora.get(names[i % 3])) for i in range(9)]
    results = asyncio.run(_run(engine, requests))
    assert all(len(r[0]) == 6 for r in results.values()) and len(results) == 9
    assert max(seen) == 2


def test_an_adapter_waiting_for_a_slot_is_not_overtaken_by_later_requests(tiny_llama_dir: Path,
                                                                           lora_dir: Path) -> None:
    """--max-loras-per-batch 1, one call: two a1 requests, then an a2 request, then ten more a1 requests. The a2
    request runs once the two earlier a1 requests end, before any later a1 request starts (without the rule, every
    a1 request would run first: a steady stream of them would starve a2)."""
    engine = _start(tiny_llama_dir, lora_dir, ("a1", "a2"), max_loras=1)
    try:
        a1, a2 = engine.lora.get("a1"), engine.lora.get("a2")
        requests = [_req(list(range(10 + i, 20 + i)), 4, a1 if i != 2 else a2) for i in range(13)]
        order: list[tuple[str, bool]] = []  # (request id, finished) in the order outputs came

        async def collect() -> None:
            async for out in engine.generate(requests):
                order.append((out.request_id, out.finish is not None))

        asyncio.run(collect())
    finally:
        engine.shutdown()
    b_done = order.index((requests[2].request_id, True))
    later = {r.request_id for r in requests[3:]}
    first_later = min(i for i, (rid, _) in enumerate(order) if rid in later)
    assert b_done < first_later
    assert sum(done for _, done in order) == 13


# ---- the registry ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir: Path) -> LlamaForCausalLM:
    model = load_model(ModelConfig(path=str(tiny_llama_dir), dtype="float32", device="cpu")).model
    assert isinstance(model, LlamaForCausalLM)
    return model


def _kind(call: object) -> AdapterErrorKind:
    with pytest.raises(AdapterError) as err:
        call()  # type: ignore[operator]
    return err.value.kind


def test_unknown_adapter_is_not_found_listing_the_loaded_ones(tiny_model: LlamaForCausalLM, lora_dir: Path) -> None:
    registry = LoraRegistry(LoraConfig(lora_root=str(lora_dir)), tiny_model)
    registry.load("a1", str(lora_dir / "a1"), confined=False)
    with pytest.raises(AdapterError) as err:
        registry.resolve("nope")
    assert err.value.kind is AdapterErrorKind.NOT_FOUND
    assert "'nope'" in err.value.message and "'a1'" in err.value.message
    without_root = LoraRegistry(LoraConfig(), tiny_model)
    assert _kind(lambda: without_root.resolve("a1")) is AdapterErrorKind.NOT_FOUND


def test_paths_outside_the_root_are_refused(tiny_model: LlamaForCausalLM, lora_dir: Path, tmp_path: Path) -> None:
    registry = LoraRegistry(LoraConfig(lora_root=str(lora_dir)), tiny_model)
    assert _kind(lambda: registry.resolve("../x")) is AdapterErrorKind.PERMISSION
    assert _kind(lambda: registry.resolve("/etc")) is AdapterErrorKind.PERMISSION
    os.symlink(tmp_path, lora_dir / "escape")  # a symlink out of the root is outside it too
    try:
        assert _kind(lambda: registry.resolve("escape")) is AdapterErrorKind.PERMISSION
    finally:
        os.unlink(lora_dir / "escape")
    assert _kind(lambda: LoraRegistry(LoraConfig(), tiny_model).load("x", str(lora_dir / "a1"), confined=True)
                 ) is AdapterErrorKind.PERMISSION
    assert registry.resolve("a2").name == "a2"  # relative to the root: loaded under that name
    assert registry.resolve(str(lora_dir / "a3")).rank == 16  # absolute under the root


def test_rank_above_the_limit_and_foreign_modules_are_invalid(tiny_model: LlamaForCausalLM, lora_dir: Path,
                                                             tiny_llama_dir: Path) -> None:
    registry = LoraRegistry(LoraConfig(lora_root=str(lora_dir), max_lora_rank=8), tiny_model)
    with pytest.raises(AdapterError) as err:
        registry.resolve("a3")  # rank 16
    assert err.value.kind is AdapterErrorKind.INVALID and "--max-lora-rank" in err.value.message
    make_adapter(tiny_llama_dir, lora_dir / "head", targets=("lm_head",))
    with pytest.raises(AdapterError) as err:
        registry.resolve("head")
    assert err.value.kind is AdapterErrorKind.INVALID and "lm_head" in err.value.message
    assert _kind(lambda: registry.load("a1", str(lora_dir / "a1"), confined=False).name and
                 registry.load("a1", str(lora_dir / "a1"), confined=False)) is AdapterErrorKind.EXISTS
    assert registry.names() == ["a1"]


def test_lru_eviction_spares_adapters_in_use_and_never_exceeds_the_limit(tiny_model: LlamaForCausalLM,
                                                                          lora_dir: Path) -> None:
    registry = LoraRegistry(LoraConfig(lora_root=str(lora_dir), max_loaded_loras=2), tiny_model)
    a1, a2 = registry.resolve("a1"), registry.resolve("a2")
    registry.pin([a1])
    registry.resolve("a3")  # a2 is the least recently used one not in use
    assert registry.names() == ["a1", "a3"]
    registry.pin([registry.resolve("a3")])
    with pytest.raises(AdapterError) as err:
        registry.resolve("a4")  # everything loaded is in use: no third adapter
    assert err.value.kind is AdapterErrorKind.EXHAUSTED and "--max-loaded-loras 2" in err.value.message
    assert registry.names() == ["a1", "a3"] and registry.room_may_free()
    registry.unpin([a1])  # a1 no longer in use: it makes room
    registry.resolve("a4")
    assert registry.names() == ["a3", "a4"]
    assert [a.in_use for a in registry.list()] == [1, 0]
    assert registry.get("a2") is None and a2.layers  # an evicted adapter's object still works for its requests
    registry.unload("a4")
    assert registry.names() == ["a3"]
    assert _kind(lambda: registry.unload("a4")) is AdapterErrorKind.NOT_FOUND


def test_adapters_loaded_at_start_are_never_evicted(tiny_model: LlamaForCausalLM, lora_dir: Path) -> None:
    registry = LoraRegistry(LoraConfig(lora_root=str(lora_dir), max_loaded_loras=2), tiny_model)
    registry.load("start", str(lora_dir / "a1"), confined=False, pinned=True)  # as --lora-modules does
    for name in ("a2", "a3", "a4", "a2"):  # the one other slot turns over; the pinned adapter stays
        registry.resolve(name)
        assert registry.names() == ["start", name]
    registry.load("start2", str(lora_dir / "a3"), confined=False, pinned=True)  # evicts a2, the last unpinned one
    assert registry.names() == ["start", "start2"] and not registry.room_may_free()
    assert _kind(lambda: registry.resolve("a4")) is AdapterErrorKind.EXHAUSTED  # pinned for good: no wait helps
    registry.unload("start2")  # an admin may still unload one
    assert registry.resolve("a4").name == "a4" and registry.names() == ["start", "a4"]


def test_a_request_waits_for_room_until_a_call_ends(tiny_model: LlamaForCausalLM, lora_dir: Path) -> None:
    """--max-loaded-loras 1 with a1 in use: resolving a2 for a request waits (no error) until a1's call ends."""
    registry = LoraRegistry(LoraConfig(lora_root=str(lora_dir), max_loaded_loras=1), tiny_model)
    a1 = registry.resolve("a1")
    registry.pin([a1])

    async def scenario() -> LoadedAdapter | None:
        waiting = asyncio.create_task(validation.resolve_adapter(registry, "a2", "lora_path[0]"))
        while not registry._room_waiters:  # the request is parked on the event loop (no thread held)
            assert not waiting.done()
            await asyncio.sleep(0.01)
        assert registry.names() == ["a1"]
        registry.unpin([a1])  # the call using a1 ends
        return await waiting

    adapter = asyncio.run(scenario())
    assert adapter is not None and adapter.name == "a2" and registry.names() == ["a2"]


def test_smollm2_adapter_equals_peft_merged_model(smollm2_gguf: Path, tmp_path: Path,
                                                  smollm2_transformers: Callable[[], PreTrainedModel]) -> None:
    """The real model as served by default (its own Q4_1/Q8_0 blocks, float32 activations) with a random adapter on
    every module, against transformers' dequantized model with the adapter merged by peft: logits within 1e-4 on a
    40-token prefill, and 32 greedy tokens equal."""
    hf = smollm2_transformers
    adapter_dir = make_adapter_for(hf(), tmp_path / "smol", rank=8, alpha=16.0, std=0.02)
    reference = PeftModel.from_pretrained(hf(), adapter_dir).merge_and_unload().eval()
    model = load_model(ModelConfig(path=str(smollm2_gguf), dtype="float32", device="cpu")).model
    assert isinstance(model, LlamaForCausalLM)
    adapter = LoraRegistry(LoraConfig(), model).load("smol", str(adapter_dir), confined=False)
    tokens = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]  # [40, vocab]
        ids = torch.tensor([tokens[:8]])
        for _ in range(32):
            ids = torch.cat([ids, reference(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    got = _forward_logits(model, tokens, adapter)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # greedy decoding through the paged cache: an 8-token prefill, then one token at a time
    attention = model.make_attention(8, PAGE)
    pages = [0, 2, 4]
    seq = tokens[:8]
    with torch.inference_mode():
        for _ in range(32):
            start = 0 if len(seq) == 8 else len(seq) - 1
            plan = attention.plan([ChunkSpec(start, len(seq) - start, pages)], torch.arange(start, len(seq)))
            rows = (RowGroup(torch.arange(len(seq) - start), adapter.layers, adapter.stack),)
            hidden = model.forward(torch.tensor(seq[start:]), ForwardContext(attention, plan), lora=rows)
            seq.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    assert seq[8:] == ids[0, 8:].tolist()
