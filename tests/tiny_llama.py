"""Tiny random-weight Llama checkpoints with SmolLM2's vocabulary and tokenizer, saved as HF directories: the test
models of the engine, the routes and the CUDA path (random weights: near-tied logits, so any numeric difference
between two paths shows in the tokens)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


def save_tiny_llama(path: Path, tokenizer: PreTrainedTokenizerBase, *, hidden: int, intermediate: int, heads: int,
                    kv_heads: int, max_positions: int = 4096) -> Path:
    """Two layers of these sizes (head size hidden / heads), tied embeddings, weights from seed 0."""
    config = LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
