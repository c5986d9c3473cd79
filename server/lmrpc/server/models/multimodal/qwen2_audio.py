"""Qwen2-Audio (`Qwen2AudioForConditionalGeneration`, a Qwen2 text side): transformers' audio encoder (Whisper-like,
over log-mel features padded to a fixed length) and linear projector, our Qwen2. A clip is one `<|AUDIO|>`
placeholder, expanded to one position per two encoder frames of the clip's own (unpadded) length."""

from __future__ import annotations

import itertools
from typing import cast

import numpy as np
import torch
from transformers import AutoModel, PretrainedConfig, Qwen2AudioConfig
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioMultiModalProjector

from lmrpc.server.media.types import Modality
from lmrpc.server.models import register
from lmrpc.server.models.multimodal.base import EncoderInput, MultimodalLM, Placeholder, load_module
from lmrpc.server.models.weights import WeightSource

INPUTS = frozenset({"input_features", "feature_attention_mask"})  # what the feature extractor gives per clip


def _positions(frames: int) -> int:
    """Positions of a clip of `frames` mel frames: the encoder's stride-2 convolution, then its pooling by 2."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


# The fewest mel frames that give one position (3: fewer leave the pooling nothing to pool)
MIN_FRAMES = next(f for f in itertools.count(1) if _positions(f) >= 1)


@register("Qwen2AudioForConditionalGeneration")
class Qwen2AudioLM(MultimodalLM):
    def build_encoder(self, config: PretrainedConfig, weights: WeightSource) -> None:
        tower = AutoModel.from_config(config.audio_config)
        self.audio_config: PretrainedConfig = tower.config  # the encoder's own (its attention masks are built on it)
        self.audio_tower = load_module(tower, weights, ("model.audio_tower.", "audio_tower."))
        self.projector = load_module(Qwen2AudioMultiModalProjector(cast(Qwen2AudioConfig, config)), weights,
                                     ("model.multi_modal_projector.", "multi_modal_projector."))

    def run_encoder(self, inputs: EncoderInput) -> torch.Tensor:
        features = torch.from_numpy(np.ascontiguousarray(inputs["input_features"], dtype=np.float32))  # [1, mel, F]
        frames = int(np.asarray(inputs["feature_attention_mask"]).sum())  # the clip's own frames; the rest padding
        conv_frames = (frames - 1) // 2 + 1  # after the stride-2 convolution
        padded = (features.shape[-1] - 2) // 2 + 1
        keep = (torch.arange(padded) < conv_frames).long()[None]  # [1, padded]: attend to the clip, not the padding
        mask = create_bidirectional_mask(config=self.audio_config, inputs_embeds=torch.zeros(1, padded, 1),
                                         attention_mask=keep)
        states = self.audio_tower(features, attention_mask=mask).last_hidden_state  # [1, padded / 2, audio]
        return self.projector(states)[0, : _positions(frames)]  # [positions, hidden]

    @classmethod
    def count_positions(cls, config: PretrainedConfig, modality: Modality, inputs: EncoderInput) -> int:
        if set(inputs) != INPUTS:
            raise ValueError(f"this model takes {sorted(INPUTS)}, not {sorted(inputs)}")
        audio = config.audio_config
        frames = audio.max_source_positions * 2  # what the encoder takes: every clip padded to this
        features, mask = inputs["input_features"], inputs["feature_attention_mask"]
        if tuple(features.shape) != (1, audio.num_mel_bins, frames):
            raise ValueError(f"input_features must be [1, {audio.num_mel_bins}, {frames}], not {list(features.shape)}")
        if tuple(mask.shape) != (1, frames) or not np.isin(mask, (0, 1)).all():
            raise ValueError(f"feature_attention_mask must be [1, {frames}] of 0 and 1, not {list(mask.shape)}")
        length = int(mask.sum())
        if length < 1 or not (mask[0, :length] == 1).all():
            raise ValueError("feature_attention_mask must be ones for the clip's frames, then zeros")
        if length < MIN_FRAMES:
            raise ValueError(f"feature_attention_mask marks {length} frames; the encoder needs at least {MIN_FRAMES} "
                             "to give the clip a position")
        if not np.isfinite(features).all():
            raise ValueError("input_features has non-finite values")
        return _positions(length)

    @classmethod
    def placeholders(cls, config: PretrainedConfig, hf_processor: object) -> tuple[Placeholder, ...]:
        token = str(getattr(hf_processor, "audio_token", "<|AUDIO|>"))
        bos = str(getattr(hf_processor, "audio_bos_token", "<|audio_bos|>"))
        eos = str(getattr(hf_processor, "audio_eos_token", "<|audio_eos|>"))
        return (Placeholder(Modality.AUDIO, token, int(config.audio_token_index), f"{bos}{token}{eos}"),)

    @classmethod
    def sampling_rate(cls, hf_processor: object) -> int:
        return int(getattr(hf_processor, "feature_extractor").sampling_rate)  # noqa: B009  (HF processors: untyped)

    @classmethod
    def audio_limits(cls, hf_processor: object) -> tuple[int, float | None]:
        """The Whisper feature extractor marks one frame per hop_length samples begun, so MIN_FRAMES frames take
        (MIN_FRAMES - 1) * hop + 1 samples; it pads or cuts every clip to its window of n_samples (chunk_length
        seconds)."""
        features = getattr(hf_processor, "feature_extractor")  # noqa: B009  (HF processors: untyped)
        hop = int(features.hop_length)
        return (MIN_FRAMES - 1) * hop + 1, int(features.n_samples) / int(features.sampling_rate)
