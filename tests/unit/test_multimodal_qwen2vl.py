"""Qwen2-VL and Qwen2.5-VL on tiny random checkpoints (a small vision tower with its patch merger, a Qwen2 text side
with M-RoPE), each: the loader picks our family; `prepare` expands `<|image_pad|>` to each image's grid (per-item
min/max pixels) and gives the prompt's M-RoPE positions, those of transformers' `get_rope_index`; our executor's
logits of a two-image prompt equal transformers' within 1e-4 in float32 (bitwise alike when chunked inside an image),
the engine's 16 greedy tokens equal transformers'; an image request alone = batched with a text request = chunked
prefill = prefix-cache hit = preempted and recomputed, bitwise; items that cannot be placed are MediaErrors naming
them."""

from __future__ import annotations

import asyncio
import base64
import io
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from inprocess_service import engine_config, served_both
from media_fixtures import encoded, transparent
from multimodal_run import PAGE, Result, executor_logits, hf_inputs, image, request, run, start
from PIL import Image
from tiny_qwen2vl import FAMILIES
from transformers import AutoTokenizer, PreTrainedModel, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

from lmrpc.kernels import native
from lmrpc.server.config import ModelConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.sequence import Sequence
from lmrpc.server.media import decode
from lmrpc.server.media.types import Media, MediaError, MediaOptions, Modality, MultimodalProcessor, MultimodalPrompt
from lmrpc.server.models.loader import LoadedModel, load_model
from lmrpc.server.models.multimodal.qwen2_vl import Qwen2_5_VLLM, Qwen2VLLM
from lmrpc.server.models.types import PromptMedia
from lmrpc.v1 import openai_pb2

pytestmark = pytest.mark.skipif(not native.available(), reason="the native model path")

NEW = 16
VISION_START, VISION_END, IMAGE_ID = 49152, 49153, 49154  # the first ids added to SmolLM2's vocabulary
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


OURS = {"Qwen2VLForConditionalGeneration": Qwen2VLLM, "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLLM}


@pytest.fixture(scope="module", params=sorted(OURS))
def architecture(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoint(architecture: str, tiny_qwen2vl_dir: Path, tiny_qwen2_5_vl_dir: Path) -> Path:
    return tiny_qwen2vl_dir if architecture == "Qwen2VLForConditionalGeneration" else tiny_qwen2_5_vl_dir


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> LoadedModel:
    return load_model(ModelConfig(path=str(checkpoint), dtype="float32", device="cpu", quantization="none"))


@pytest.fixture(scope="module")
def processor(loaded: LoadedModel) -> MultimodalProcessor:
    assert loaded.processor is not None
    return loaded.processor


@pytest.fixture(scope="module")
def hf(architecture: str, checkpoint: Path) -> Iterator[PreTrainedModel]:
    yield FAMILIES[architecture][1].from_pretrained(checkpoint, dtype=torch.float32).eval()


def media_of(prompt: MultimodalPrompt) -> PromptMedia:
    assert isinstance(prompt.engine_media, PromptMedia)
    return prompt.engine_media


def reference_inputs(prompt: MultimodalPrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs: the ids, the items' tensors stacked, and which tokens are image tokens (for its M-RoPE)."""
    inputs = hf_inputs(prompt)
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE_ID).int()
    return inputs


def two_images(processor: MultimodalProcessor) -> MultimodalPrompt:
    """Text, a 4 x 6 grid (6 tokens), text, a 4 x 4 grid (4 tokens), text."""
    return processor.prepare(f"Compare {IMAGE} with {IMAGE}. Which one is brighter, and why?",
                             [image(1, width=90, height=60), image(2, width=60, height=60, index=1)])


def test_loader_picks_the_family(architecture: str, loaded: LoadedModel, processor: MultimodalProcessor) -> None:
    assert type(loaded.model) is OURS[architecture]
    assert loaded.info.architecture == architecture
    assert loaded.info.hidden_size == 64 and loaded.info.vocab_size == 49156
    assert loaded.model.rope.sections == (2, 3, 3)
    assert processor.modalities == frozenset({Modality.IMAGE}) and processor.sampling_rate == 0
    assert (processor.min_audio_samples, processor.max_audio_seconds) == (0, None)  # no audio limits


def test_prepare_expands_to_the_grid_and_gives_transformers_positions(processor: MultimodalProcessor,
                                                                       hf: PreTrainedModel) -> None:
    prompt = two_images(processor)
    media = media_of(prompt)
    grids = [tuple(s.encoder_input["image_grid_thw"][0]) for s in media.spans]
    assert grids == [(1, 4, 6), (1, 4, 4)]
    assert [s.length for s in media.spans] == [6, 4]
    ids = list(prompt.token_ids)
    for span in media.spans:  # each image's tokens between its vision start and end
        assert ids[span.start - 1] == VISION_START and ids[span.end] == VISION_END
        assert set(ids[span.start : span.end]) == {IMAGE_ID}
    assert ids.count(IMAGE_ID) == 10
    inputs = reference_inputs(prompt)
    expected, delta = hf.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                              image_grid_thw=inputs["image_grid_thw"])
    assert media.rope_positions is not None
    assert torch.equal(torch.tensor(media.rope_positions.prompt), expected[:, 0])
    assert media.rope_positions.delta == int(delta)
    # The prompt as ids (placeholders single, or already expanded) gives the same placement.
    for given in ([t for i, t in enumerate(ids) if t != IMAGE_ID or ids[i - 1] == VISION_START], ids):
        again = processor.prepare(given, [image(1, width=90, height=60), image(2, width=60, height=60, index=1)])
        assert again.token_ids == prompt.token_ids and media_of(again).rope_positions == media.rope_positions
    # A text prompt has no M-RoPE positions: its own, three times over, are the 1-D ones.
    assert media_of(processor.prepare("Just text.", [])).rope_positions is None


def test_per_item_pixel_bounds(processor: MultimodalProcessor) -> None:
    big = image(3, width=120, height=120)  # within the checkpoint's bounds: 8 x 8 patches, 16 tokens
    bounded = Media(Modality.IMAGE, big.wire_field, big.digest, image=big.image,
                    options=MediaOptions(max_pixels=28 * 28 * 4))
    default, small = (processor.prepare(f"See {IMAGE}", [item]) for item in (big, bounded))
    assert media_of(default).spans[0].length == 16 and media_of(small).spans[0].length == 4
    assert media_of(default).spans[0].key != media_of(small).spans[0].key  # other rows, other cache keys
    grown = Media(Modality.IMAGE, big.wire_field, big.digest, image=big.image,
                  options=MediaOptions(min_pixels=28 * 28 * 9, max_pixels=28 * 28 * 9))
    assert media_of(processor.prepare(f"See {IMAGE}", [grown])).spans[0].length == 9


def test_items_that_cannot_be_placed_are_media_errors(processor: MultimodalProcessor, loaded: LoadedModel) -> None:
    field = "image_data[0].items[0]"
    rows = Media(Modality.IMAGE, field, b"e" * 16, embedding=np.zeros((4, 64), np.float32))
    with pytest.raises(MediaError, match="grid") as e:
        processor.prepare(f"See {IMAGE}", [rows])
    assert e.value.field == field
    inverted = Media(Modality.IMAGE, field, b"i" * 16, image=image(1).image,
                     options=MediaOptions(min_pixels=28 * 28 * 9, max_pixels=28 * 28 * 4))
    with pytest.raises(MediaError, match="exceeds") as e:
        processor.prepare(f"See {IMAGE}", [inverted])
    assert e.value.field == field
    tensors = media_of(processor.prepare(f"See {IMAGE}", [image(1)])).spans[0].encoder_input
    for bad in ({"pixel_values": tensors["pixel_values"]},
                {"pixel_values": tensors["pixel_values"], "image_grid_thw": np.array([[1, 4, 4]])},
                {"pixel_values": tensors["pixel_values"], "image_grid_thw": np.array([[1, 3, 3]])}):
        given = Media(Modality.IMAGE, field, b"t" * 16, processor_output=bad)
        with pytest.raises(MediaError) as e:
            processor.prepare(f"See {IMAGE}", [given])
        assert e.value.field == field
    # the image's own tensors, given as they are, place it as the image does
    same = Media(Modality.IMAGE, field, b"t" * 16, processor_output=tensors)
    placed = processor.prepare(f"See {IMAGE}", [same])
    assert torch.equal(executor_logits(loaded, placed, [len(placed.token_ids)]),
                       executor_logits(loaded, processor.prepare(f"See {IMAGE}", [image(1)]),
                                       [len(placed.token_ids)]))


def test_logits_equal_transformers_in_any_chunking(processor: MultimodalProcessor, loaded: LoadedModel,
                                                   hf: PreTrainedModel) -> None:
    prompt = two_images(processor)
    with torch.inference_mode():
        expected = hf(**reference_inputs(prompt)).logits[0]  # [positions, vocab]
    n = len(prompt.token_ids)
    whole = executor_logits(loaded, prompt, [n])
    assert whole.shape == expected.shape
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=0)
    first, second = media_of(prompt).spans
    chunked = executor_logits(loaded, prompt, [first.start + 2, second.start + 1, second.end + 1, n])
    assert torch.equal(chunked, whole)
    # The positions matter: the same rows rotated by their 1-D positions give other logits after the first image.
    flat = MultimodalPrompt(prompt.token_ids, PromptMedia(media_of(prompt).spans), prompt.media_positions)
    assert (executor_logits(loaded, flat, [n])[first.end :] - expected[first.end :]).abs().max() > 1e-3


def test_sixteen_greedy_tokens_equal_transformers(checkpoint: Path, processor: MultimodalProcessor,
                                                  hf: PreTrainedModel) -> None:
    prompt = two_images(processor)
    inputs = reference_inputs(prompt)
    with torch.inference_mode():
        generated = hf.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,  # type: ignore[operator]
                                pad_token_id=0)
    expected = generated[0, len(prompt.token_ids) :].tolist()
    engine = start(checkpoint)
    try:
        [got] = asyncio.run(run(engine, [request(prompt, NEW)])).values()
    finally:
        engine.shutdown()
    assert list(got.tokens) == expected


def solo(path: Path, prompt: MultimodalPrompt | list[int], **engine_args: int | bool) -> Result:
    engine = start(path, **engine_args)  # type: ignore[arg-type]
    try:
        [result] = asyncio.run(run(engine, [request(prompt, NEW)])).values()
    finally:
        engine.shutdown()
    return result


def test_an_image_request_has_the_same_bits_on_every_route(checkpoint: Path,
                                                           processor: MultimodalProcessor) -> None:
    """Alone; in one batch with a text request; prefilled in chunks of 8 tokens; again as a prefix-cache hit over
    its text and images: the same tokens and logprobs, bitwise. The text request is its solo self too."""
    prompt = two_images(processor)
    rng = random.Random(5)
    text = [rng.randrange(100, 40000) for _ in range(40)]
    alone = solo(checkpoint, prompt, prefix_cache=False)
    text_alone = solo(checkpoint, text, prefix_cache=False)
    chunked = solo(checkpoint, prompt, max_batched=8, prefix_cache=False)
    assert (chunked.tokens, chunked.logprobs) == (alone.tokens, alone.logprobs)
    engine = start(checkpoint)
    try:
        batched = asyncio.run(run(engine, [request(prompt, NEW, "img"), request(text, NEW, "txt")]))
        again = asyncio.run(run(engine, [request(prompt, NEW, "img2")]))["img2"]
    finally:
        engine.shutdown()
    assert (batched["img"].tokens, batched["img"].logprobs) == (alone.tokens, alone.logprobs)
    assert (batched["txt"].tokens, batched["txt"].logprobs) == (text_alone.tokens, text_alone.logprobs)
    assert again.cached_tokens >= 16  # whole pages, the first image among them
    assert (again.tokens, again.logprobs) == (alone.tokens, alone.logprobs)


def test_preempted_image_requests_recompute_to_the_same_bits(checkpoint: Path,
                                                             processor: MultimodalProcessor) -> None:
    """Three image requests of 2 pages each in a pool of 4: some are preempted and recomputed, their generated tokens
    then prefilled at M-RoPE positions past the prompt (position + delta); each output equals its run in a pool
    that holds them all."""
    prompts = [processor.prepare(f"Look at {IMAGE} number {i}", [image(10 + i, width=90, height=60)])
               for i in range(3)]
    requests = [request(p, NEW, f"img{i}") for i, p in enumerate(prompts)]
    roomy = start(checkpoint, prefix_cache=False)
    try:
        expected = asyncio.run(run(roomy, requests))
    finally:
        roomy.shutdown()
    tight = start(checkpoint, kv_tokens=4 * PAGE, prefix_cache=False)
    scheduler = tight.engine.scheduler
    preempted: list[str] = []
    preempt = scheduler._preempt

    def recording_preempt(seq: Sequence) -> None:
        preempted.append(seq.request_id)
        preempt(seq)

    scheduler._preempt = recording_preempt  # type: ignore[method-assign]
    try:
        got = asyncio.run(run(tight, requests))
    finally:
        tight.shutdown()
    assert preempted
    assert {r: (g.tokens, g.logprobs) for r, g in got.items()} == {r: (e.tokens, e.logprobs)
                                                                    for r, e in expected.items()}


def test_a_transparent_png_gives_the_tokens_of_transformers_processor(checkpoint: Path,
                                                                      processor: MultimodalProcessor,
                                                                      hf: PreTrainedModel) -> None:
    """A palette PNG with transparent entries, decoded as the service does and placed by `prepare`, gives the very
    patches and grid of transformers' image processor on the PNG as Pillow opens it (transparency composited onto
    white), and the engine's 16 greedy tokens are transformers' generate on those. Dropping the transparency would
    give other patches."""
    data = encoded("PNG", transparent("P").resize((90, 60)))
    raw = Image.open(io.BytesIO(data))
    images = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
    assert images.do_convert_rgb
    reference = images(images=[raw], return_tensors="np")
    dropped = images(images=[raw.convert("RGB")], return_tensors="np")
    assert not np.array_equal(dropped["pixel_values"], reference["pixel_values"])
    field = "image_data[0].items[0]"
    image, digest = decode.decode_image(data, field, 1 << 20)
    prompt = processor.prepare(f"What is in {IMAGE}?", [Media(Modality.IMAGE, field, digest, image=image)])
    [span] = media_of(prompt).spans
    assert np.array_equal(span.encoder_input["pixel_values"], reference["pixel_values"])
    assert np.array_equal(span.encoder_input["image_grid_thw"], reference["image_grid_thw"])
    inputs = reference_inputs(prompt)
    inputs["pixel_values"] = torch.from_numpy(reference["pixel_values"])  # transformers' own, not ours
    with torch.inference_mode():
        generated = hf.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,  # type: ignore[operator]
                                pad_token_id=0)
    result = solo(checkpoint, prompt)
    assert list(result.tokens) == generated[0, len(prompt.token_ids) :].tolist()


async def test_a_chat_renders_and_places_as_transformers_does(tiny_qwen2vl_dir: Path) -> None:
    """ChatComplete on Qwen2-VL (its own template, which iterates over content parts): the prompt's ids are those of
    transformers' apply_chat_template on the same messages (text parts run together), each image's `<|image_pad|>`
    expanded to its grid (a transparent PNG composited onto white by the image processor), and the 8 greedy tokens
    are transformers'."""
    data = encoded("PNG", transparent("RGBA").resize((90, 60)))
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    parts = [openai_pb2.ContentPart(type="text", text="Look:"),
             openai_pb2.ContentPart(type="image_url", image_url=openai_pb2.ImageUrl(url=uri)),
             openai_pb2.ContentPart(type="text", text="What is it?")]
    system = [openai_pb2.ContentPart(type="text", text="Be"), openai_pb2.ContentPart(type="text", text=" brief.")]
    req = openai_pb2.ChatCompleteRequest(messages=[openai_pb2.ChatMessage(role="system", content_parts=system),
                                                   openai_pb2.ChatMessage(role="user", content_parts=parts)],
                                         max_tokens=8, temperature=0.0, ignore_eos=True, return_token_ids=True)
    config = engine_config(str(tiny_qwen2vl_dir), "float32")
    engine = AsyncEngine.start(config)
    try:
        async with served_both(engine, config) as (_, openai):
            [reply] = [m async for m in openai.ChatComplete(req)]
    finally:
        engine.shutdown()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2vl_dir)
    text = tokenizer.apply_chat_template([
        {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": " brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                     {"type": "text", "text": "What is it?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    pixels = Qwen2VLImageProcessorPil.from_pretrained(tiny_qwen2vl_dir)(
        images=[Image.open(io.BytesIO(data))], return_tensors="np")
    grid = pixels["image_grid_thw"]
    expanded = text.replace("<|image_pad|>", "<|image_pad|>" * (int(np.prod(grid)) // 4))
    ids = tokenizer(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
    choice = reply.choices[0]
    assert list(choice.prompt_token_ids) == ids[0].tolist()
    hf = Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen2vl_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        generated = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),  # type: ignore[operator]
                                pixel_values=torch.from_numpy(pixels["pixel_values"]),
                                image_grid_thw=torch.from_numpy(grid), mm_token_type_ids=(ids == IMAGE_ID).int(),
                                max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert list(choice.token_ids) == generated[0, ids.shape[1] :].tolist()
