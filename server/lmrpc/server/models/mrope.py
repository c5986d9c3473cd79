"""Qwen2-VL's multimodal rotary positions (M-RoPE): where each prompt token rotates, given where its images lie.

Text tokens count up one position at a time, the same in all three components (temporal, height, width). An
image's tokens, after the vision tower's spatial merge a grid of t x h x w tokens in row-major order, all start
from the position the next text token would have had: token (i, j, k) sits at (start + i, start + j, start + k).
The text after it continues from start + max(h, w), one past the grid's largest position. Generated tokens continue
from the prompt's largest position + 1 (`RopePositions.delta`).

Our own implementation of the rule transformers' `Qwen2VLModel.get_rope_index` applies to images
(tests/unit/test_mrope.py checks they agree). No torch: it runs where the service prepares a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmrpc.server.models.types import RopePositions


@dataclass(frozen=True)
class GridSpan:
    """One image's tokens in a prompt."""

    start: int  # prompt position of its first token
    grid: tuple[int, int, int]  # (t, h, w) in patches, before the spatial merge: the processor's image_grid_thw row
    spatial_merge: int  # patches merged per side into one token (the vision config's spatial_merge_size)

    def __post_init__(self) -> None:
        t, h, w = self.grid
        assert t >= 1 and h % self.spatial_merge == 0 and w % self.spatial_merge == 0, "a grid of whole tokens"

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """(t, h, w) in tokens: the grid after the spatial merge."""
        t, h, w = self.grid
        return t, h // self.spatial_merge, w // self.spatial_merge

    @property
    def num_tokens(self) -> int:
        t, h, w = self.token_grid
        return t * h * w


def mrope_positions(prompt_len: int, spans: Sequence[GridSpan]) -> RopePositions:
    """The three rotary positions of each of a prompt's tokens, its images at `spans` (in prompt order, disjoint)."""
    temporal: list[int] = []
    height: list[int] = []
    width: list[int] = []
    index = 0  # the next prompt token
    current = 0  # the rotary position the next text token takes
    for span in (*spans, None):
        text_end = prompt_len if span is None else span.start
        assert index <= text_end <= prompt_len, "image spans in order, within the prompt, not overlapping"
        text = range(current, current + text_end - index)  # [text_end - index]
        temporal += text
        height += text
        width += text
        current += text_end - index
        index = text_end
        if span is None:
            break
        t, h, w = span.token_grid
        for i in range(t):  # row-major (t, h, w): the order of the vision tower's merged tokens
            for j in range(h):
                temporal += [current + i] * w
                height += [current + j] * w
                width += range(current, current + w)
        index += span.num_tokens
        current += max(h, w)
    largest = max((*temporal, *height, *width), default=-1)
    return RopePositions((tuple(temporal), tuple(height), tuple(width)), largest + 1 - prompt_len)
