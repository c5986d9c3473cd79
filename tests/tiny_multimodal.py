"""Tiny random-weight multimodal checkpoints (transformers config + save_pretrained, SmolLM2's tokenizer with the
model's image/audio tokens added, the HF processor assembled here and saved with it), for the unit tests (the
tiny_llava_dir and tiny_qwen2_audio_dir fixtures in conftest.py) and `--model DIR`."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerBase,
    Qwen2AudioConfig,
    Qwen2AudioEncoderConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    Qwen2Config,
    WhisperFeatureExtractor,
)

VOCAB = 49216  # SmolLM2's 49152 ids, the added media tokens, padded to a multiple of 64
IMAGE_SIZE = 32  # pixels a side: (32 / 8)^2 = 16 patches, so an image fills 16 positions
AUDIO_RATE = 16000  # samples per second the feature extractor takes
AUDIO_SECONDS = 1  # the feature extractor pads every clip to this: 100 mel frames -> 25 positions at most


def _text_common() -> dict[str, object]:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)


def _with_tokens(tokenizer: PreTrainedTokenizerBase, tokens: list[str]) -> PreTrainedTokenizerBase:
    out = copy.deepcopy(tokenizer)
    out.add_special_tokens({"additional_special_tokens": tokens})  # type: ignore[dict-item]
    return out


def save_tiny_llava(path: Path, tokenizer: PreTrainedTokenizerBase) -> Path:
    """LLaVA: a 2-layer CLIP vision tower (32x32 pixels, patches of 8), the two-layer GELU projector, a 2-layer Llama
    (untied output projection). An image is `<image>`, 16 positions (the CLS row dropped: strategy "default")."""
    tok = _with_tokens(tokenizer, ["<image>"])
    image_id = tok.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=8, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_text_common(), tie_word_embeddings=False),
                         image_token_id=image_id, vision_feature_layer=-2, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu", architectures=["LlavaForConditionalGeneration"])
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).eval().save_pretrained(path)
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE,
                                                                               "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1).save_pretrained(path)
    return path


def save_tiny_qwen2_audio(path: Path, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Qwen2-Audio: a 2-layer Whisper-like encoder over 16 mel bins (clips padded to one second, 100 frames), the
    linear projector, a 2-layer Qwen2 (qkv bias). A clip is `<|audio_bos|><|AUDIO|><|audio_eos|>`."""
    tok = _with_tokens(tokenizer, ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"])
    frames = AUDIO_SECONDS * AUDIO_RATE // 160
    audio = Qwen2AudioEncoderConfig(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2,
                                    encoder_ffn_dim=64, d_model=32, max_source_positions=frames // 2)
    config = Qwen2AudioConfig(audio_config=audio, text_config=Qwen2Config(**_text_common(), tie_word_embeddings=False),
                              audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
                              architectures=["Qwen2AudioForConditionalGeneration"])
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    with torch.no_grad():  # Qwen2's qkv bias starts at zero: random, so that the checkpoint tests reading it
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) and "audio" not in name:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    features = WhisperFeatureExtractor(feature_size=16, sampling_rate=AUDIO_RATE, hop_length=160,
                                       chunk_length=AUDIO_SECONDS, n_fft=400)
    Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok).save_pretrained(path)
    return path
