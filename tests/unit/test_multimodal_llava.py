"""LLaVA on a tiny random checkpoint (CLIP tower, Llama text side): the loader picks our family for the directory;
`prepare` expands `<image>` as the HF processor does, for text and token-id prompts, and refuses what does not fit
(MediaError naming the item); our executor's logits of an image prompt equal transformers' within 1e-4 in float32 (in
one chunk and in chunks cut inside the image, bitwise alike), and the engine's 16 greedy tokens equal transformers'."""

from __future__ import annotations

import asyncio
import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from inprocess_service import engine_config, served
from media_fixtures import encoded, transparent
from multimodal_run import executor_logits, hf_reference, image, request, run, start
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor, LlavaForConditionalGeneration

from lmrpc.kernels import native
from lmrpc.server.config import ModelConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.media import decode
from lmrpc.server.media.types import Media, MediaError, Modality, MultimodalProcessor
from lmrpc.server.models.loader import LoadedModel, load_model
from lmrpc.server.models.multimodal.llava import LlavaLM
from lmrpc.server.models.types import PromptMedia
from lmrpc.v1 import generate_pb2

pytestmark = pytest.mark.skipif(not native.available(), reason="the native model path")

NEW = 16
IMAGE_POSITIONS = 16  # (32 / 8)^2 patches, the CLS row dropped


@pytest.fixture(scope="module")
def loaded(tiny_llava_dir: Path) -> LoadedModel:
    return load_model(ModelConfig(path=str(tiny_llava_dir), dtype="float32", device="cpu", quantization="none"))


@pytest.fixture(scope="module")
def processor(loaded: LoadedModel) -> MultimodalProcessor:
    assert loaded.processor is not None
    return loaded.processor


@pytest.fixture(scope="module")
def hf(tiny_llava_dir: Path) -> Iterator[LlavaForConditionalGeneration]:
    yield LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()


def test_loader_picks_the_llava_family(loaded: LoadedModel, processor: MultimodalProcessor) -> None:
    assert isinstance(loaded.model, LlavaLM)
    assert loaded.info.architecture == "LlavaForConditionalGeneration"
    assert loaded.info.hidden_size == 64 and loaded.info.vocab_size == 49216
    assert processor.modalities == frozenset({Modality.IMAGE}) and processor.sampling_rate == 0
    assert (processor.min_audio_samples, processor.max_audio_seconds) == (0, None)  # no audio limits


def test_prepare_expands_placeholders_in_text_and_ids(processor: MultimodalProcessor, loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    image_id = tok.convert_tokens_to_ids("<image>")
    text = "Look: <image> and <image>, what differs?"
    prepared = processor.prepare(text, [image(1), image(2, index=1)])
    ids = list(tok.encode(text))
    first = ids.index(image_id)
    second = ids.index(image_id, first + 1) + IMAGE_POSITIONS - 1
    expected = ids[:first] + [image_id] * IMAGE_POSITIONS + ids[first + 1 :]
    expected = expected[:second] + [image_id] * IMAGE_POSITIONS + expected[second + 1 :]
    assert list(prepared.token_ids) == expected
    assert prepared.media_positions == 2 * IMAGE_POSITIONS
    media = prepared.engine_media
    assert isinstance(media, PromptMedia)
    assert [(s.start, s.length) for s in media.spans] == [(first, IMAGE_POSITIONS), (second, IMAGE_POSITIONS)]
    assert media.spans[0].key != media.spans[1].key  # different images, different keys
    # The same prompt as token ids (placeholders as single ids, or already expanded) places the items alike.
    for given in (ids, list(prepared.token_ids)):
        again = processor.prepare(given, [image(1), image(2, index=1)])
        assert again.token_ids == prepared.token_ids
        assert isinstance(again.engine_media, PromptMedia)
        assert [s.key for s in again.engine_media.spans] == [s.key for s in media.spans]


def test_prepare_refuses_items_that_do_not_fit(processor: MultimodalProcessor, loaded: LoadedModel) -> None:
    one = "Look: <image> now"
    with pytest.raises(MediaError) as e:
        processor.prepare(one, [image(1), image(2, index=1)])
    assert e.value.field == "image_data[0].items[1]"  # more items than placeholders
    with pytest.raises(MediaError) as e:
        processor.prepare("<image> and <image>", [image(1)])
    assert e.value.field == "image_data[0].items[0]"  # fewer
    clip = Media(Modality.AUDIO, "audio_data[0].items[0]", b"a" * 16, audio=np.zeros(10, np.float32),
                 sampling_rate=16000)
    with pytest.raises(MediaError, match="takes no audio") as e:
        processor.prepare(one, [clip])
    assert e.value.field == "audio_data[0].items[0]"
    bad_pixels = Media(Modality.IMAGE, "image_data[0].items[0]", b"p" * 16,
                       processor_output={"pixel_values": np.zeros((1, 3, 16, 16), np.float32)})
    with pytest.raises(MediaError, match="pixel_values must be"):
        processor.prepare(one, [bad_pixels])
    wrong_name = Media(Modality.IMAGE, "image_data[0].items[0]", b"p" * 16,
                       processor_output={"pixels": np.zeros((1, 3, 32, 32), np.float32)})
    with pytest.raises(MediaError, match="pixel_values only"):
        processor.prepare(one, [wrong_name])
    for shape in ((IMAGE_POSITIONS, 63), (IMAGE_POSITIONS - 1, 64)):
        rows = Media(Modality.IMAGE, "image_data[0].items[0]", b"e" * 16, embedding=np.zeros(shape, np.float32))
        with pytest.raises(MediaError) as e:
            processor.prepare(one, [rows])
        assert e.value.field == "image_data[0].items[0]"


def test_logits_equal_transformers_in_any_chunking(processor: MultimodalProcessor, loaded: LoadedModel,
                                                   hf: LlavaForConditionalGeneration) -> None:
    prepared = processor.prepare("A picture: <image> What is in it? Answer:", [image(3)])
    expected, _ = hf_reference(hf, prepared, 1)
    n = len(prepared.token_ids)
    whole = executor_logits(loaded, prepared, [n])
    assert whole.shape == expected.shape
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=0)
    media = prepared.engine_media
    assert isinstance(media, PromptMedia)
    inside = media.spans[0].start + 5  # a chunk ends inside the image; the next starts there
    chunked = executor_logits(loaded, prepared, [inside, inside + 7, n])
    assert torch.equal(chunked, whole)
    # The image matters: another one gives other logits after it (the test could not pass on the text alone).
    other = executor_logits(loaded, processor.prepare("A picture: <image> What is in it? Answer:", [image(5)]), [n])
    assert (other[-1] - whole[-1]).abs().max() > 1e-3


def test_processor_output_and_embedding_items_equal_the_image(processor: MultimodalProcessor,
                                                              loaded: LoadedModel) -> None:
    """An item given as the processor's tensors, or as the encoder's rows, gives the image's bits."""
    text = "A picture: <image> What is in it?"
    prepared = processor.prepare(text, [image(3)])
    media = prepared.engine_media
    assert isinstance(media, PromptMedia)
    span = media.spans[0]
    tensors = Media(Modality.IMAGE, "image_data[0].items[0]", b"t" * 16, processor_output=span.encoder_input)
    rows = loaded.model.encode_media(span).numpy()  # type: ignore[attr-defined]
    embedded = Media(Modality.IMAGE, "image_data[0].items[0]", b"r" * 16, embedding=rows)
    n = len(prepared.token_ids)
    whole = executor_logits(loaded, prepared, [n])
    for item in (tensors, embedded):
        assert torch.equal(executor_logits(loaded, processor.prepare(text, [item]), [n]), whole)


def test_sixteen_greedy_tokens_equal_transformers(tiny_llava_dir: Path, processor: MultimodalProcessor,
                                                  hf: LlavaForConditionalGeneration) -> None:
    prepared = processor.prepare("Describe <image> in a few words:", [image(4)])
    _, expected = hf_reference(hf, prepared, NEW)
    engine = start(tiny_llava_dir)
    try:
        [got] = asyncio.run(run(engine, [request(prepared, NEW)])).values()
    finally:
        engine.shutdown()
    assert list(got.tokens) == expected
    assert got.cached_tokens == 0


def test_a_transparent_png_gives_the_tokens_of_transformers_processor(tiny_llava_dir: Path, loaded: LoadedModel,
                                                                      processor: MultimodalProcessor,
                                                                      hf: LlavaForConditionalGeneration) -> None:
    """A PNG with an alpha band, decoded as the service does and placed by `prepare`, gives the very pixel values and
    ids of transformers' LlavaProcessor on the PNG as Pillow opens it (transparency composited onto white), and the
    engine's 16 greedy tokens are transformers' generate on those. Dropping the alpha would give other pixels."""
    data = encoded("PNG", transparent("RGBA"))
    raw = Image.open(io.BytesIO(data))
    text = "Describe <image> in a few words:"
    hf_processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    assert hf_processor.image_processor.do_convert_rgb
    reference = hf_processor(text=[text], images=[raw], return_tensors="pt")
    dropped = hf_processor(text=[text], images=[raw.convert("RGB")], return_tensors="pt")
    assert not torch.equal(dropped["pixel_values"], reference["pixel_values"])
    field = "image_data[0].items[0]"
    image, digest = decode.decode_image(data, field, 1 << 20)
    prepared = processor.prepare(text, [Media(Modality.IMAGE, field, digest, image=image)])
    media = prepared.engine_media
    assert isinstance(media, PromptMedia)
    assert np.array_equal(media.spans[0].encoder_input["pixel_values"], reference["pixel_values"].numpy())
    assert list(prepared.token_ids) == reference["input_ids"][0].tolist()
    with torch.inference_mode():
        generated = hf.generate(**reference, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,  # type: ignore[operator]
                                pad_token_id=0)
    engine = start(tiny_llava_dir)
    try:
        [got] = asyncio.run(run(engine, [request(prepared, NEW)])).values()
    finally:
        engine.shutdown()
    assert list(got.tokens) == generated[0, len(prepared.token_ids) :].tolist()


async def test_served_like_any_checkpoint(tiny_llava_dir: Path) -> None:
    """`--model DIR` of a LLaVA checkpoint: the services answer from the text side; a text prompt generates."""
    config = engine_config(str(tiny_llava_dir), "float32")
    engine = AsyncEngine.start(config)
    try:
        assert engine.media_processor is not None
        async with served(engine, config) as stub:
            info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
            assert info.architecture == "LlavaForConditionalGeneration" and info.vocab_size == 49216
            req = generate_pb2.GenerateRequest(text=["Hello there"], sampling_params=[generate_pb2.SamplingParams(
                max_new_tokens=4, temperature=0.0, ignore_eos=True)])
            [msg] = [m async for m in stub.Generate(req)]
            assert len(msg.token_ids) == 4
    finally:
        engine.shutdown()


NEW_LAYOUT = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
              ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


def test_either_weight_layout_loads_the_same_model(tiny_llava_dir: Path, tmp_path: Path, loaded: LoadedModel,
                                                   processor: MultimodalProcessor) -> None:
    """transformers 5 writes LLaVA's weights under the legacy names; checkpoints written otherwise hold them under
    model.language_model / model.vision_tower / lm_head: both load the same model."""
    for file in tiny_llava_dir.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, tmp_path / file.name)
    renamed = {}
    for name, tensor in load_file(str(tiny_llava_dir / "model.safetensors")).items():
        old, new = next(pair for pair in NEW_LAYOUT if name.startswith(pair[0]))
        renamed[new + name[len(old) :]] = tensor
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    other = load_model(ModelConfig(path=str(tmp_path), dtype="float32", device="cpu", quantization="none"))
    prepared = processor.prepare("A picture: <image> What is in it?", [image(6)])
    n = len(prepared.token_ids)
    assert torch.equal(executor_logits(other, prepared, [n]), executor_logits(loaded, prepared, [n]))
