"""Tiny random-weight Qwen2-VL and Qwen2.5-VL checkpoints for tests: a 2-layer Qwen2 text model (hidden 64) with
M-RoPE, a 1-block vision tower (patch 14, spatial merge 2; Qwen2.5-VL's with its window attention), SmolLM2's
tokenizer with the Qwen2-VL special tokens and chat template, and an image processor with small bounds (an image
becomes a few tokens).

Not a `Qwen2VLProcessor`: in this transformers it cannot be built without torchvision (its video processor's class
check), which lmrpc does not depend on; the image processor then is the PIL one, as AutoImageProcessor falls back to."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MIN_PIXELS = 28 * 28 * 4  # at least 2 x 2 tokens after the merge
MAX_PIXELS = 28 * 28 * 16  # at most 16 tokens
QK_SCALE = 8.0  # q/k projection weights times this: scores of a few units, so positions change the outputs
MROPE_SECTION = (2, 3, 3)  # frequency pairs of temporal, height, width: head_dim 16 / 2
# Qwen2-VL-Instruct's own chat template (its tokenizer_config.json): content given as a list of parts, each image part
# written as its vision markers around `<|image_pad|>`
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-6)


# Per architecture: the config class, the model class, and its tiny vision tower.
FAMILIES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, object]]] = {
    "Qwen2VLForConditionalGeneration": (Qwen2VLConfig, Qwen2VLForConditionalGeneration, dict(
        depth=1, embed_dim=32, hidden_size=TEXT["hidden_size"], num_heads=2, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2)),
    "Qwen2_5_VLForConditionalGeneration": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, dict(
        depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=TEXT["hidden_size"], num_heads=2,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])),
}


def tiny_qwen2vl_config(vocab_size: int, image_token_id: int, video_token_id: int, vision_start_token_id: int,
                        vision_end_token_id: int,
                        architecture: str = "Qwen2VLForConditionalGeneration") -> PretrainedConfig:
    config_class, _, vision = FAMILIES[architecture]
    config = config_class(
        text_config=dict(TEXT, vocab_size=vocab_size, bos_token_id=None, eos_token_id=None, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(MROPE_SECTION)}),
        vision_config=vision, image_token_id=image_token_id, video_token_id=video_token_id,
        vision_start_token_id=vision_start_token_id, vision_end_token_id=vision_end_token_id,
        tie_word_embeddings=False,
    )
    config.architectures = [architecture]
    return config


def save_tiny_qwen2vl(path: Path, tokenizer: PreTrainedTokenizerBase, seed: int = 0,
                      architecture: str = "Qwen2VLForConditionalGeneration") -> Path:
    """Write the checkpoint (config, weights, image processor, tokenizer with Qwen2-VL's chat template) into path;
    returns path. The given tokenizer is left as it is (a copy gets the special tokens and the template)."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = tiny_qwen2vl_config(len(tokenizer), ids["<|image_pad|>"], ids["<|video_pad|>"], ids["<|vision_start|>"],
                                 ids["<|vision_end|>"], architecture)
    config.text_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = FAMILIES[architecture][1](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):  # non-zero q/k/v biases (initialized to zero): reading them is tested
                p.normal_(0.0, 0.02)
            if "language_model" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                # sharp attention: at the initial scale every score is near 0, and rotations hardly matter
                p.mul_(QK_SCALE)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
