"""Tiny random-weight mixture-of-experts checkpoints (transformers config + save_pretrained, SmolLM2's tokenizer),
for the unit tests and the e2e server (the tiny_moe_dir fixture in conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)


def tiny_moe_config(arch: str, vocab_size: int = 49152) -> PretrainedConfig:
    """A tiny 3-layer mixture-of-experts config of `arch`: 8 experts, top 2 (Qwen2-MoE: a shared expert,
    unnormalized top-k weights and its last layer dense; Qwen3-MoE: normalized, q/k norms; Mixtral: normalized;
    OLMoE: unnormalized, full-width q/k norms, q/k/v clipped at 1.5, which the normalized q and k often reach)."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, architectures=[arch],
    )
    if arch == "Qwen2MoeForCausalLM":
        return Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                              shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[2])
    if arch == "Qwen3MoeForCausalLM":
        return Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                              norm_topk_prob=True, head_dim=32)
    if arch == "OlmoeForCausalLM":
        return OlmoeConfig(**common, intermediate_size=32, num_experts=8, norm_topk_prob=False, clip_qkv=1.5)
    assert arch == "MixtralForCausalLM"
    return MixtralConfig(**common, intermediate_size=32, num_local_experts=8)


def save_tiny_moe(arch: str, path: Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int = 49152) -> Path:
    """A random-weight MoE checkpoint with SmolLM2's tokenizer. The routers' weights are scaled up (x30) so that a
    token's top-k experts are decided by clear margins: with the default init every router logit is within ~1e-2 of
    the others, and two correct implementations could pick different experts on float32 rounding alone."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(arch, vocab_size)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.mul_(30.0)
            elif "norm" in name or "shared_expert_gate" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
