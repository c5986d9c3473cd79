"""LLaVA (`LlavaForConditionalGeneration` with a Llama text side): transformers' vision tower (CLIP and the like) and
multimodal projector, our Llama. An image is one `<image>` placeholder, expanded to one position per patch (the CLS
row dropped under the "default" feature strategy)."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
from transformers import AutoModel, LlavaConfig, PretrainedConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from lmrpc.server.media.types import Modality
from lmrpc.server.models import register
from lmrpc.server.models.multimodal.base import EncoderInput, MultimodalLM, Placeholder, load_module
from lmrpc.server.models.weights import WeightSource


@register("LlavaForConditionalGeneration")
class LlavaLM(MultimodalLM):
    def build_encoder(self, config: PretrainedConfig, weights: WeightSource) -> None:
        self.vision_tower = load_module(AutoModel.from_config(config.vision_config), weights,
                                        ("model.vision_tower.", "vision_tower."))
        self.projector = load_module(LlavaMultiModalProjector(cast(LlavaConfig, config)), weights,
                                     ("model.multi_modal_projector.", "multi_modal_projector."))
        # Hidden states of these layers (by index into the tower's hidden_states, embeddings first) feed the projector
        layer = config.vision_feature_layer
        self.feature_layers: tuple[int, ...] = (layer,) if isinstance(layer, int) else tuple(layer)
        self.drop_cls = config.vision_feature_select_strategy == "default"  # "full" keeps the CLS row

    def run_encoder(self, inputs: EncoderInput) -> torch.Tensor:
        pixels = torch.from_numpy(np.ascontiguousarray(inputs["pixel_values"], dtype=np.float32))  # [1, 3, H, W]
        states = self.vision_tower(pixels, output_hidden_states=True, return_dict=True).hidden_states
        picked = [states[i][:, 1:] if self.drop_cls else states[i] for i in self.feature_layers]  # [1, N, vision]
        rows = self.projector(torch.cat(picked, dim=-1))  # [1, N, hidden]
        return rows[0]  # [N, hidden]

    @classmethod
    def fixed_positions(cls, config: PretrainedConfig, modality: Modality) -> int | None:
        vision = config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        return patches if config.vision_feature_select_strategy == "default" else patches + 1

    @classmethod
    def count_positions(cls, config: PretrainedConfig, modality: Modality, inputs: EncoderInput) -> int:
        if set(inputs) != {"pixel_values"}:
            raise ValueError(f"this model takes pixel_values only, not {sorted(inputs)}")
        size = config.vision_config.image_size
        shape = tuple(inputs["pixel_values"].shape)
        if shape != (1, config.vision_config.num_channels, size, size):
            raise ValueError(f"pixel_values must be [1, {config.vision_config.num_channels}, {size}, {size}], "
                             f"not {list(shape)}")
        if not np.isfinite(inputs["pixel_values"]).all():
            raise ValueError("pixel_values has non-finite values")
        fixed = cls.fixed_positions(config, modality)
        assert fixed is not None
        return fixed

    @classmethod
    def placeholders(cls, config: PretrainedConfig, hf_processor: object) -> tuple[Placeholder, ...]:
        token = str(getattr(hf_processor, "image_token", "<image>"))
        return (Placeholder(Modality.IMAGE, token, int(config.image_token_id)),)
