"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`): transformers'
vision tower of each (patch embedding, blocks and the patch merger; Qwen2.5-VL's with window attention) and our Qwen2
language model with M-RoPE. Both place images alike (for images, Qwen2.5-VL's position rule is Qwen2-VL's).

An image is one `<|image_pad|>` placeholder (Qwen2-VL's prompts put it between `<|vision_start|>` and
`<|vision_end|>`), expanded to the t x h x w / merge^2 positions of its grid: the HF image processor resizes it within
the item's min/max pixels (Media.options, else the checkpoint's) and gives its patches and `image_grid_thw`. Placing
the items also gives the prompt's three-component rotary positions (models/mrope.py), carried in
`PromptMedia.rope_positions`; the attention backends rotate by them (paged.Rope.rows). A text-only prompt has none:
its positions, three times, rotate exactly as one.

The expansion is done here (`Qwen2VLImages`) rather than by transformers' `Qwen2VLProcessor`, which this transformers
cannot build without torchvision (the class check of its video processor); the count is the processor's own rule,
and transformers' model checks it against the tower's rows in tests/unit/test_multimodal_qwen2vl.py."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedModel, Qwen2VLImageProcessorPil
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from lmrpc.server.media.types import Media, MediaError, Modality, MultimodalProcessor, MultimodalPrompt
from lmrpc.server.models import register
from lmrpc.server.models.mrope import GridSpan, mrope_positions
from lmrpc.server.models.multimodal.base import EncoderInput, MultimodalLM, Placeholder, load_module
from lmrpc.server.models.multimodal.processor import MediaPromptProcessor
from lmrpc.server.models.types import PromptMedia
from lmrpc.server.models.weights import WeightSource

IMAGE_TOKEN = "<|image_pad|>"


@register("Qwen2VLForConditionalGeneration")
class Qwen2VLLM(MultimodalLM):
    """Our Qwen2 with M-RoPE (its config's mrope_section) and the family's vision tower, loaded from the checkpoint."""

    # transformers' vision tower of the family: pixel patches and their grid -> merged rows [tokens, hidden]
    TOWER: ClassVar[type[PreTrainedModel]] = Qwen2VisionTransformerPretrainedModel

    def build_encoder(self, config: PretrainedConfig, weights: WeightSource) -> None:
        tower = self.TOWER._from_config(config.vision_config)
        self.visual = load_module(tower, weights, ("model.visual.", "visual."))

    def run_encoder(self, inputs: EncoderInput) -> torch.Tensor:
        pixels = torch.from_numpy(np.ascontiguousarray(inputs["pixel_values"], dtype=np.float32))  # [patches, width]
        grid = torch.from_numpy(np.asarray(inputs["image_grid_thw"], dtype=np.int64))  # [1, 3]
        return self.visual(pixels, grid_thw=grid).pooler_output  # [patches / merge^2, hidden]: merged, projected

    @classmethod
    def count_positions(cls, config: PretrainedConfig, modality: Modality, inputs: EncoderInput) -> int:
        if set(inputs) != {"pixel_values", "image_grid_thw"}:
            raise ValueError(f"this model takes pixel_values and image_grid_thw, not {sorted(inputs)}")
        vision = config.vision_config
        merge = int(vision.spatial_merge_size)
        grid = inputs["image_grid_thw"]
        if grid.shape != (1, 3) or not np.issubdtype(grid.dtype, np.integer) or (grid < 1).any():
            raise ValueError(f"image_grid_thw must be one positive (t, h, w) [1, 3], not {grid.tolist()}")
        t, h, w = (int(x) for x in grid[0])
        if h % merge or w % merge:
            raise ValueError(f"image_grid_thw's h and w must be multiples of {merge}, not {h} x {w}")
        width = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
        pixels = inputs["pixel_values"]
        if pixels.shape != (t * h * w, width):
            raise ValueError(f"pixel_values must be [{t * h * w}, {width}] for that grid, not {list(pixels.shape)}")
        if not np.isfinite(pixels).all():
            raise ValueError("pixel_values has non-finite values")
        return t * h * w // merge**2

    @classmethod
    def placeholders(cls, config: PretrainedConfig, hf_processor: object) -> tuple[Placeholder, ...]:
        return (Placeholder(Modality.IMAGE, IMAGE_TOKEN, int(config.image_token_id),
                            f"<|vision_start|>{IMAGE_TOKEN}<|vision_end|>"),)

    @classmethod
    def processor_kwargs(cls, media: Media) -> dict[str, Any]:
        """The item's pixel bounds (Qwen2VLImages takes them; unset ones stay the checkpoint's)."""
        o = media.options
        for name, value in (("min_pixels", o.min_pixels), ("max_pixels", o.max_pixels)):
            if value is not None and value < 1:
                raise MediaError(media.wire_field, f"{name} must be positive, not {value}")
        if o.min_pixels is not None and o.max_pixels is not None and o.min_pixels > o.max_pixels:
            raise MediaError(media.wire_field, f"min_pixels {o.min_pixels} exceeds max_pixels {o.max_pixels}")
        return {"min_pixels": o.min_pixels, "max_pixels": o.max_pixels}

    def make_processor(self, path: Path) -> MultimodalProcessor:
        return Qwen2VLPromptProcessor(type(self), self.hf_config, Qwen2VLImages(path), self.shape.hidden)


@register("Qwen2_5_VLForConditionalGeneration")
class Qwen2_5_VLLM(Qwen2VLLM):
    """Qwen2.5-VL: the same language side and placement, its own tower (window attention, RMSNorm, gated MLP)."""

    TOWER = Qwen2_5_VisionTransformerPretrainedModel


class Qwen2VLImages:
    """What MediaPromptProcessor calls as the HF processor: the checkpoint's tokenizer, and a call that resizes and
    patches images (transformers' image processor) and expands the text's `<|image_pad|>` to each image's
    t x h x w / merge^2 tokens, as Qwen2VLProcessor does."""

    def __init__(self, path: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        size = self.image_processor.size
        self.min_pixels = int(size["shortest_edge"])  # the checkpoint's bounds on a resized image's pixels
        self.max_pixels = int(size["longest_edge"])

    def __call__(self, text: list[str], images: list[Any], return_tensors: str = "np", min_pixels: int | None = None,
                 max_pixels: int | None = None) -> dict[str, np.ndarray]:
        """text: one string; images: one per `<|image_pad|>` in it; min/max_pixels: this call's bounds (None: the
        checkpoint's)."""
        assert len(text) == 1 and return_tensors == "np"
        size = {"shortest_edge": self.min_pixels if min_pixels is None else min_pixels,
                "longest_edge": self.max_pixels if max_pixels is None else max_pixels}
        if size["shortest_edge"] > size["longest_edge"]:
            raise ValueError(f"min_pixels {size['shortest_edge']} exceeds max_pixels {size['longest_edge']}")
        out = self.image_processor(images=images, size=size, return_tensors="np")
        merge = int(self.image_processor.merge_size)
        counts = iter(int(np.prod(g)) // merge**2 for g in out["image_grid_thw"])
        pieces = text[0].split(IMAGE_TOKEN)
        expanded = pieces[0] + "".join(IMAGE_TOKEN * next(counts) + piece for piece in pieces[1:])
        ids = np.asarray([self.tokenizer.encode(expanded)], dtype=np.int64)  # [1, tokens]
        return {"input_ids": ids, "pixel_values": np.asarray(out["pixel_values"]),
                "image_grid_thw": np.asarray(out["image_grid_thw"])}


class Qwen2VLPromptProcessor(MediaPromptProcessor):
    """MediaPromptProcessor, plus the prompt's M-RoPE positions from where its images lie and their grids."""

    def _run_processor(self, item: Media, holder: Placeholder) -> EncoderInput:
        try:
            return super()._run_processor(item, holder)
        except MediaError:
            raise
        except ValueError as e:  # the image processor's: bounds or a shape the image cannot be resized within
            raise MediaError(item.wire_field, f"the image processor cannot take the image: {e}") from None

    def prepare(self, prompt: str | Sequence[int], media: Sequence[Media]) -> MultimodalPrompt:
        placed = super().prepare(prompt, media)
        assert isinstance(placed.engine_media, PromptMedia)
        spans = placed.engine_media.spans
        merge = int(self._config.vision_config.spatial_merge_size)
        grids = []
        for span in spans:
            if span.encoder_input is None:  # rows given: their grid is unknown, and with it their positions
                raise MediaError(span.wire_field, "Qwen2-VL places an image's rows on its grid: give the image or "
                                                  "its pixel_values and image_grid_thw, not rows")
            t, h, w = (int(x) for x in span.encoder_input["image_grid_thw"][0])
            grids.append(GridSpan(span.start, (t, h, w), merge))
        rope = mrope_positions(len(placed.token_ids), grids) if grids else None
        return MultimodalPrompt(placed.token_ids, PromptMedia(spans, rope), placed.media_positions)
