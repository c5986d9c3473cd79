"""M-RoPE (Qwen2-VL's multimodal rotary positions) in our language model: the position rule against transformers'
`get_rope_index`; our Qwen2 text model with three-component positions against transformers' Qwen2-VL (float32,
1e-4) on every route (native stack, native attention layer by layer, torch reference), bitwise the same however the
prompt is chunked; three equal positions rotate exactly as one."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from tiny_qwen2vl import tiny_qwen2vl_config
from transformers import AutoConfig, Qwen2VLForConditionalGeneration, Qwen2VLModel

from lmrpc.kernels import native
from lmrpc.kernels.attention import PagedTorchAttention
from lmrpc.kernels.paged import AttentionBackend, ChunkSpec, Rope
from lmrpc.server.models import ForwardContext
from lmrpc.server.models.llama import LlamaForCausalLM
from lmrpc.server.models.mrope import GridSpan, mrope_positions
from lmrpc.server.models.quantized import LinearBuilder, Quantization
from lmrpc.server.models.types import RopePositions
from lmrpc.server.models.weights import SafetensorsWeights

PAGE = 16
IMAGE = 500  # the image placeholder id of the rule tests' config
MERGE = 2

# prompts as (text before, grid), ..., text after: (t, h, w) in patches before the 2 x 2 merge
PROMPTS: dict[str, tuple[list[tuple[int, tuple[int, int, int]]], int]] = {
    "text only": ([], 9),
    "one image": ([(3, (1, 4, 6))], 5),
    "two images, different grids": ([(2, (1, 4, 4)), (4, (1, 6, 2))], 3),
    "image first, wide then tall": ([(0, (1, 2, 8)), (1, (1, 10, 4))], 2),
    "ends with an image": ([(4, (1, 6, 6))], 0),
    "two frames": ([(1, (2, 4, 4))], 2),
}


def layout(items: list[tuple[int, tuple[int, int, int]]], tail: int) -> tuple[list[int], list[GridSpan]]:
    """Token ids (text 7, images IMAGE) and the image spans of a prompt."""
    ids: list[int] = []
    spans = []
    for text, grid in items:
        ids += [7] * text
        span = GridSpan(len(ids), grid, MERGE)
        spans.append(span)
        ids += [IMAGE] * span.num_tokens
    return ids + [7] * tail, spans


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_position_rule_equals_transformers_get_rope_index(name: str) -> None:
    items, tail = PROMPTS[name]
    ids, spans = layout(items, tail)
    hf = Qwen2VLModel(tiny_qwen2vl_config(512, IMAGE, 501, 502, 503))
    input_ids = torch.tensor([ids])
    grids = torch.tensor([grid for _, grid in items]) if items else None
    expected, delta = hf.get_rope_index(input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
                                        image_grid_thw=grids)  # [3, 1, L], [1, 1]
    ours = mrope_positions(len(ids), spans)
    assert torch.equal(torch.tensor(ours.prompt), expected[:, 0])
    assert ours.delta == int(delta)


def test_positions_past_the_prompt_continue_from_its_largest_plus_one() -> None:
    ids, spans = layout([(1, (1, 4, 6))], 1)  # 1 text, 2 x 3 image tokens, 1 text: largest position 1 + 3 = 4
    ours = mrope_positions(len(ids), spans)
    assert ours.prompt[2][-1] == 4 and ours.delta == 5 - len(ids)
    assert ours.span(len(ids) - 1, len(ids) + 2) == ([4, 5, 6], [4, 5, 6], [4, 5, 6])
    assert ours.span(1, 4) == ([1, 1, 1], [1, 1, 1], [1, 2, 3])


@pytest.fixture(scope="module")
def hf_model(tiny_qwen2vl_dir: Path) -> Qwen2VLForConditionalGeneration:
    return Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen2vl_dir, dtype=torch.float32).eval()


def language_model(path: Path, native_products: bool) -> LlamaForCausalLM:
    """Our Qwen2 language model from the Qwen2-VL checkpoint's text config and weights."""
    config = AutoConfig.from_pretrained(path).text_config
    builder = LinearBuilder(Quantization.NONE, torch.float32, torch.device("cpu"), native=native_products)
    return LlamaForCausalLM(config, SafetensorsWeights(path), builder)


def run_chunks(model: LlamaForCausalLM, attention: AttentionBackend, embeds: torch.Tensor,
               rope: RopePositions | None, cuts: list[int]) -> torch.Tensor:
    """Our logits [L, vocab] of the rows embeds [L, hidden], computed in chunks [cuts[i], cuts[i+1]) over one scrambled
    page table, each rotated by its M-RoPE positions (None: its positions)."""
    pages = torch.randperm(16, generator=torch.Generator().manual_seed(0))[:8].tolist()
    out = []
    with torch.inference_mode():
        for start, end in itertools.pairwise(cuts):
            positions = torch.arange(start, end)
            rope_positions = None if rope is None else torch.tensor(rope.span(start, end))  # [3, n]
            plan = attention.plan([ChunkSpec(start, end - start, pages)], positions, rope_positions)
            # a copy: the native stack runs the residual stream in place of its input rows
            hidden = model.forward(torch.zeros(end - start, dtype=torch.int64), ForwardContext(attention, plan),
                                   embeds[start:end].clone())
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


# The native stack; the same native products and attention with the layers run one by one from Python (the route of
# LoRA adapters the stack does not have); torch's products and the torch reference attention.
ROUTES = ("native stack", "native layers", "torch")


def backend(model: LlamaForCausalLM, route: str) -> AttentionBackend:
    if route == "torch":
        return PagedTorchAttention(model.attention_shape, model.rope, torch.float32, torch.device("cpu"), 16, PAGE)
    attention = model.make_attention(16, PAGE)
    assert model._stack is not None
    if route == "native layers":
        model._stack = None
    return attention


@pytest.mark.parametrize("route", ROUTES)
def test_language_model_with_mrope_equals_transformers(tiny_qwen2vl_dir: Path,
                                                       hf_model: Qwen2VLForConditionalGeneration, route: str) -> None:
    """A 20-token prompt (5 text rows, a 2 x 3 image-like span of random rows, 9 text rows) and 8 generated rows:
    the same logits as transformers given the same rows and its own positions, prefilled whole or in chunks split
    inside the image (bitwise the same on the native routes), then decoded token by token."""
    if route != "torch" and not native.available():
        pytest.skip("the native kernels do not build here")
    ids, spans = layout([(5, (1, 4, 6))], 9)
    rope = mrope_positions(len(ids), spans)
    total = len(ids) + 8
    embeds = torch.randn(total, 64, generator=torch.Generator().manual_seed(3))  # [28, hidden]
    hf_positions = torch.tensor(rope.span(0, total)).unsqueeze(1)  # [3, 1, 28]
    with torch.no_grad():
        expected = hf_model(inputs_embeds=embeds[None], position_ids=hf_positions).logits[0]  # [28, vocab]
    model = language_model(tiny_qwen2vl_dir, native_products=route != "torch")
    whole = run_chunks(model, backend(model, route), embeds, rope, [0, 20, *range(21, total + 1)])
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-4)
    chunked = run_chunks(model, backend(model, route), embeds, rope, [0, 7, 13, 20, *range(21, total + 1)])
    if route != "torch":  # torch's products are not row-invariant
        assert torch.equal(chunked, whole)
    # without its positions, the prompt rotates otherwise: the positions are what made it agree
    plain = run_chunks(model, backend(model, route), embeds, None, [0, total])
    assert (plain - expected).abs().max() > 1e-3


def test_three_equal_positions_rotate_exactly_as_one(tiny_qwen2vl_dir: Path) -> None:
    """A text prompt in an M-RoPE model gives the same bits with its positions as (p, p, p) or as p: what lets the
    executor leave text-only steps on the 1-D tables, and a text request's bits not depend on an image request in
    its step."""
    if not native.available():
        pytest.skip("the native kernels do not build here")
    model = language_model(tiny_qwen2vl_dir, native_products=True)
    embeds = torch.randn(24, 64, generator=torch.Generator().manual_seed(4))
    text = RopePositions((tuple(range(24)),) * 3, 0)
    plain = run_chunks(model, model.make_attention(16, PAGE), embeds, None, [0, 11, 24])
    assert torch.equal(run_chunks(model, model.make_attention(16, PAGE), embeds, text, [0, 11, 24]), plain)


def test_rope_rows_take_each_section_from_its_component() -> None:
    table = torch.arange(10, dtype=torch.float32)[:, None] * 100 + torch.arange(8)  # [10, head_dim 8]: 100 p + col
    rope = Rope(table, -table, sections=(1, 2, 1))
    rows = rope.rows(torch.tensor([[1, 2], [3, 4], [5, 6]]))  # token 0 at (1, 3, 5), token 1 at (2, 4, 6)
    assert rows.cos.tolist() == [[100, 301, 302, 503, 104, 305, 306, 507], [200, 401, 402, 603, 204, 405, 406, 607]]
    assert torch.equal(rows.sin, -rows.cos)
