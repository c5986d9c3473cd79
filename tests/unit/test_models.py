"""Our model implementations against `transformers` on the same weights: tiny random Llama, Mistral, Qwen2 (qkv
bias) and Qwen3 (q/k norms) through the paged cache in float32; the HF fallback for an unregistered architecture;
and the real SmolLM2 model read from its GGUF file (greedy tokens and logits over 64 steps in float32)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
)

from lmrpc.kernels import native
from lmrpc.kernels.attention import select_backend
from lmrpc.kernels.paged import AttentionBackend, ChunkSpec
from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineRequest, SamplingParams
from lmrpc.server.models import CausalLM, ForwardContext
from lmrpc.server.models.hf_fallback import HFCausalLM
from lmrpc.server.models.linear import DenseLinear
from lmrpc.server.models.llama import LlamaForCausalLM
from lmrpc.server.models.loader import load_model

PAGE = 16  # the native kernels' smallest page; the sequences below still span several, in scrambled order


@dataclass
class PagedRun:
    """Runs one sequence through a CausalLM step by step over its own paged cache, as the executor would."""

    model: CausalLM
    pages: list[int]  # a deliberately non-contiguous page table
    attention: AttentionBackend  # the model's KV cache and attention backend

    @classmethod
    def create(cls, model: CausalLM, max_tokens: int) -> PagedRun:
        num_pages = 2 * (max_tokens // PAGE + 1)
        pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))[: num_pages // 2].tolist()
        return cls(model, pages, model.make_attention(num_pages, PAGE))

    @torch.inference_mode()
    def logits(self, tokens: list[int], start: int) -> torch.Tensor:
        """Compute tokens[start:] given tokens[:start] are cached: logits [len - start, vocab] float32."""
        n = len(tokens) - start
        plan = self.attention.plan([ChunkSpec(start, n, self.pages)], torch.arange(start, len(tokens)))
        hidden = self.model.forward(torch.tensor(tokens[start:]), ForwardContext(self.attention, plan))
        return self.model.compute_logits(hidden)



def assert_paged_logits_equal_transformers(ours: object, path: object) -> None:
    """Our model through the paged cache (a chunked prefill: 17 tokens, then 13 with the first 17 cached, and 10
    single-token decodes) gives transformers' float32 logits for 40 random tokens of a 512-token vocabulary."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]  # [40, vocab]
    run = PagedRun.create(ours, len(tokens))  # type: ignore[arg-type]
    got = [run.logits(tokens[:17], 0), run.logits(tokens[:30], 17)]
    got += [run.logits(tokens[: i + 1], i) for i in range(30, 40)]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)

def tiny_configs() -> dict[str, PretrainedConfig]:
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    return {
        "LlamaForCausalLM": LlamaConfig(**common, architectures=["LlamaForCausalLM"]),
        "MistralForCausalLM": MistralConfig(**common, architectures=["MistralForCausalLM"], sliding_window=None),
        "Qwen2ForCausalLM": Qwen2Config(**common, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False),
        "Qwen3ForCausalLM": Qwen3Config(**common, head_dim=32, architectures=["Qwen3ForCausalLM"]),
    }


def save_random(config: PretrainedConfig, path: Path, tokenizer: PreTrainedTokenizerBase) -> Path:
    """A random-weight model of `config` saved as an HF directory (with a tokenizer, which loading needs)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random biases/norm weights, so a missed bias or norm shows up in the logits
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", sorted(tiny_configs()))
def test_native_model_equals_transformers_through_paged_cache(
    arch: str, tmp_path: Path, smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    path = save_random(tiny_configs()[arch], tmp_path / arch, smollm2_tokenizer)
    ours = load_model(ModelConfig(path=str(path), dtype="float32", device="cpu")).model
    assert isinstance(ours, LlamaForCausalLM)
    if arch == "Qwen2ForCausalLM":  # the qkv bias is there (native kernels hold it inside, DenseLinear outside)
        qkv = ours.layers[0].qkv
        assert not isinstance(qkv, DenseLinear) or qkv.bias is not None
    assert_paged_logits_equal_transformers(ours, path)


def test_bf16_weights_with_float32_activations_stay_close(
    tmp_path: Path, smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    """The CPU bf16 path (half weights and KV cache, float32 activations) tracks the float32 model closely."""
    path = save_random(tiny_configs()["LlamaForCausalLM"], tmp_path / "llama", smollm2_tokenizer)
    tokens = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    outs = {}
    for dtype in ("float32", "bfloat16"):
        model = load_model(ModelConfig(path=str(path), dtype=dtype, device="cpu")).model
        run = PagedRun.create(model, len(tokens))
        outs[dtype] = torch.cat([run.logits(tokens[:16], 0)] + [run.logits(tokens[: i + 1], i) for i in range(16, 24)])
    bf16_model = load_model(ModelConfig(path=str(path), dtype="bfloat16", device="cpu")).model
    assert isinstance(bf16_model, LlamaForCausalLM) and bf16_model.dtype == torch.bfloat16
    assert (outs["bfloat16"] - outs["float32"]).abs().max() < 0.05
    assert (outs["bfloat16"].argmax(-1) == outs["float32"].argmax(-1)).float().mean() > 0.9


def test_unregistered_architecture_uses_the_transformers_fallback(
    tmp_path: Path, smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    config = GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                        architectures=["GPT2LMHeadModel"])
    path = save_random(config, tmp_path / "gpt2", smollm2_tokenizer)
    ours = load_model(ModelConfig(path=str(path), dtype="float32", device="cpu")).model
    assert isinstance(ours, HFCausalLM)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    run = PagedRun.create(ours, len(tokens))
    got = [run.logits(tokens[:12], 0), run.logits(tokens[:25], 12)]
    got += [run.logits(tokens[: i + 1], i) for i in range(25, 30)]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


async def test_fallback_serves_through_the_engine(tmp_path: Path, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    """The whole engine (batching, prefix cache, preemption-free) over the fallback gives HF's greedy tokens."""
    config = GPT2Config(vocab_size=49152, n_embd=32, n_layer=2, n_head=2, n_positions=512,
                        architectures=["GPT2LMHeadModel"], eos_token_id=2, bos_token_id=1)
    path = save_random(config, tmp_path / "gpt2-engine", smollm2_tokenizer)
    engine = AsyncEngine.start(EngineConfig(
        model=ModelConfig(path=str(path), dtype="float32", device="cpu"),
        cache=CacheConfig(page_size=4, num_tokens=1024), scheduler=SchedulerConfig(), sampling_defaults="openai",
    ))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    try:
        prompts = [list(range(100 + 7 * i, 120 + 9 * i)) for i in range(3)]
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        requests = [EngineRequest(f"f{i}", f"f{i}", i, tuple(p), params) for i, p in enumerate(prompts)]
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        async for out in engine.generate(requests):
            tokens[out.request_id].extend(out.token_ids)
        for r, prompt in zip(requests, prompts, strict=True):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
            assert tokens[r.request_id] == ref[0, len(prompt) :].tolist()
    finally:
        engine.shutdown()


PARITY_PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primary colours:",
    "Explain in one sentence why the sky is blue.",
)


def _chat(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer.encode(str(chat), add_special_tokens=False))


@pytest.mark.slow
def test_smollm2_greedy_tokens_and_logits_equal_transformers(
        smollm2_gguf: Path, smollm2_transformers: Callable[[], PreTrainedModel]) -> None:
    """5 prompts, 64 greedy tokens in float32 on the GGUF's dequantized weights: same tokens, logits within 1e-3.
    transformers is run teacher-forced, one forward over each prompt and our 64 tokens: its greedy choice at every
    position given the same prefix (EOS masked, as min_new_tokens does) must be the token we chose there, which is
    what generating with it would give, in one forward instead of 64."""
    loaded = load_model(ModelConfig(path=str(smollm2_gguf), dtype="float32", device="cpu", quantization="none"))
    hf = smollm2_transformers()
    steps = 64
    eos = list(loaded.info.eos_token_ids)
    for text in PARITY_PROMPTS:
        prompt = _chat(loaded.tokenizer, text)
        run = PagedRun.create(loaded.model, len(prompt) + steps)
        ours_tokens: list[int] = []
        ours_logits = [run.logits(prompt, 0)[-1:]]
        tokens = list(prompt)
        for _ in range(steps):
            step_logits = ours_logits[-1][0].clone()
            step_logits[eos] = float("-inf")  # as min_new_tokens does for HF: 64 tokens, EOS never chosen
            nxt = int(step_logits.argmax())
            ours_tokens.append(nxt)
            tokens.append(nxt)
            if len(ours_tokens) < steps:
                ours_logits.append(run.logits(tokens, len(tokens) - 1))
        with torch.no_grad():
            ref_logits = hf(torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1 :]  # [steps, vocab]
        masked = ref_logits.clone()
        masked[:, eos] = float("-inf")
        ref_tokens = masked.argmax(-1).tolist()
        assert ours_tokens == ref_tokens, text
        diff = (torch.cat(ours_logits) - ref_logits).abs().max().item()
        assert diff < 1e-3, f"{text!r}: max logit difference {diff}"




@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize(("dtype", "quantization"), [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int4")])
def test_native_stack_gives_the_layer_loops_bits(arch: str, dtype: str, quantization: str, tmp_path: Path,
                                                 smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    """Every layer in one native call (the GIL released once) computes exactly what the Python loop over layers
    computes: a prefill chunk (200 rows: its MLP in the stack's chunks of 128, the last partial), then decodes."""
    config = tiny_configs()[arch]
    path = save_random(config, tmp_path / arch, smollm2_tokenizer)
    model = load_model(ModelConfig(path=str(path), dtype=dtype, device="cpu", quantization=quantization)).model
    assert isinstance(model, LlamaForCausalLM)
    tokens = torch.randint(0, 512, (207,), generator=torch.Generator().manual_seed(4)).tolist()
    stacked = PagedRun.create(model, len(tokens))  # make_attention binds the native stack to this cache
    if not native.available():
        pytest.skip("the native kernels do not build here")
    assert model._stack is not None and model._stack.backend is stacked.attention
    steps = [(200, 0)] + [(i + 1, i) for i in range(200, 207)]
    with_stack = [stacked.logits(tokens[:end], start) for end, start in steps]
    model._stack = None  # the Python loop over layers, on a cache of its own
    looped = PagedRun(model, stacked.pages, select_backend(model.attention_shape, model.rope, model.dtype,
                                                           torch.device("cpu"), stacked.attention.num_pages, PAGE))
    for (end, start), expected in zip(steps, with_stack, strict=True):
        assert torch.equal(looped.logits(tokens[:end], start), expected), (end, start)
