"""Qwen2-Audio on a tiny random checkpoint (Whisper-like encoder, Qwen2 text side): the loader picks our family and
exposes the feature extractor's sampling rate; `prepare` expands `<|AUDIO|>` to the clip's own length (a shorter
clip, fewer positions) and refuses what does not fit; our executor's logits of an audio prompt equal transformers'
within 1e-4 in float32 (whole and chunked, bitwise alike), and the engine's 16 greedy tokens equal transformers'."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest
import torch
from inprocess_service import engine_config, served_both
from media_fixtures import clip
from multimodal_run import audio, executor_logits, hf_reference, image, request, run, start
from status_details import violations
from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

from lmrpc.kernels import native
from lmrpc.server.config import ModelConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.media.types import Media, MediaError, Modality, MultimodalProcessor
from lmrpc.server.models.loader import LoadedModel, load_model
from lmrpc.server.models.multimodal.qwen2_audio import MIN_FRAMES, Qwen2AudioLM, _positions
from lmrpc.server.models.types import PromptMedia
from lmrpc.v1 import generate_pb2, openai_pb2

pytestmark = pytest.mark.skipif(not native.available(), reason="the native model path")

NEW = 16
CLIP = "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat sound is this?"


@pytest.fixture(scope="module")
def loaded(tiny_qwen2_audio_dir: Path) -> LoadedModel:
    return load_model(ModelConfig(path=str(tiny_qwen2_audio_dir), dtype="float32", device="cpu", quantization="none"))


@pytest.fixture(scope="module")
def processor(loaded: LoadedModel) -> MultimodalProcessor:
    assert loaded.processor is not None
    return loaded.processor


@pytest.fixture(scope="module")
def hf(tiny_qwen2_audio_dir: Path) -> Iterator[Qwen2AudioForConditionalGeneration]:
    yield Qwen2AudioForConditionalGeneration.from_pretrained(tiny_qwen2_audio_dir, dtype=torch.float32).eval()


def test_loader_picks_the_qwen2_audio_family(loaded: LoadedModel, processor: MultimodalProcessor) -> None:
    assert isinstance(loaded.model, Qwen2AudioLM)
    assert processor.modalities == frozenset({Modality.AUDIO}) and processor.sampling_rate == 16000


def test_the_models_audio_limits_are_its_feature_extractors_and_encoders(
        tiny_qwen2_audio_dir: Path, loaded: LoadedModel, processor: MultimodalProcessor) -> None:
    """The shortest clip: the fewest samples whose mel frames (one per hop of 160 begun) leave the encoder's stride-2
    convolution and pooling one position, as transformers' own processor counts them; the longest: the feature
    extractor's one-second window."""
    assert (processor.min_audio_samples, processor.max_audio_seconds) == (321, 1.0)
    hf_processor = AutoProcessor.from_pretrained(tiny_qwen2_audio_dir)
    for samples, positions in ((320, 0), (321, 1)):
        out = hf_processor(text=["<|AUDIO|>"], audio=[np.zeros(samples, np.float32)], sampling_rate=16000,
                           return_tensors="np")
        assert int((out["input_ids"] == loaded.model.hf_config.audio_token_index).sum()) == positions
    # the position rule is the encoder's own layers' arithmetic
    tower = cast(Qwen2AudioLM, loaded.model).audio_tower

    def out_length(length: int, layer: torch.nn.Module) -> int:
        kernel, stride, padding = (x if isinstance(x, int) else x[0] for x in (
            layer.kernel_size, layer.stride, layer.padding))
        return (length + 2 * padding - kernel) // stride + 1

    for frames in range(1, 101):
        after = out_length(out_length(out_length(frames, tower.conv1), tower.conv2), tower.avg_pooler)
        assert _positions(frames) == max(after, 0)
    assert MIN_FRAMES == 3


def test_prepare_expands_to_the_clip_length(processor: MultimodalProcessor, loaded: LoadedModel) -> None:
    audio_id = loaded.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    long, short = processor.prepare(CLIP, [audio(1, 16000)]), processor.prepare(CLIP, [audio(1, 4000)])
    # 100 and 25 mel frames -> 50 and 13 after the stride-2 convolution -> 25 and 6 after pooling
    assert (long.media_positions, short.media_positions) == (25, 6)
    for prepared in (long, short):
        assert sum(t == audio_id for t in prepared.token_ids) == prepared.media_positions
        media = prepared.engine_media
        assert isinstance(media, PromptMedia) and media.spans[0].length == prepared.media_positions
    again = processor.prepare(list(loaded.tokenizer.encode(CLIP)), [audio(1, 4000)])
    assert again.token_ids == short.token_ids


def test_prepare_refuses_items_that_do_not_fit(processor: MultimodalProcessor) -> None:
    with pytest.raises(MediaError, match="takes no image") as e:
        processor.prepare(CLIP, [image(1)])
    assert e.value.field == "image_data[0].items[0]"
    with pytest.raises(MediaError) as e:
        processor.prepare(CLIP, [audio(1), audio(2, index=1)])
    assert e.value.field == "audio_data[0].items[1]"
    slow = Media(Modality.AUDIO, "audio_data[0].items[0]", b"a" * 16, audio=np.zeros(800, np.float32),
                 sampling_rate=8000)
    with pytest.raises(MediaError, match="16000 Hz"):
        processor.prepare(CLIP, [slow])
    with pytest.raises(MediaError, match="this model takes at most 1 s"):  # the feature extractor's window
        processor.prepare(CLIP, [audio(1, 16001)])
    for short in (1, 100, 320):  # too short for one encoder position
        with pytest.raises(MediaError, match="at least 321") as e:
            processor.prepare(CLIP, [audio(1, short)])
        assert e.value.field == "audio_data[0].items[0]"
    frames = np.zeros((1, 16, 100), np.float32)
    for tensors in ({"input_features": frames}, {"input_features": frames[:, :, :50],
                                                 "feature_attention_mask": np.ones((1, 50), np.int32)}):
        with pytest.raises(MediaError) as e:
            processor.prepare(CLIP, [Media(Modality.AUDIO, "audio_data[0].items[0]", b"t" * 16,
                                           processor_output=tensors)])
        assert e.value.field == "audio_data[0].items[0]"
    mask = np.zeros((1, 100), np.int32)
    mask[0, :2] = 1  # two frames: no position either
    with pytest.raises(MediaError, match="at least 3") as e:
        processor.prepare(CLIP, [Media(Modality.AUDIO, "audio_data[0].items[0]", b"m" * 16, processor_output={
            "input_features": frames, "feature_attention_mask": mask})])
    assert e.value.field == "audio_data[0].items[0]"
    wide = Media(Modality.AUDIO, "audio_data[0].items[0]", b"e" * 16, embedding=np.zeros((5, 65), np.float32))
    with pytest.raises(MediaError, match="64"):
        processor.prepare(CLIP, [wide])


def test_logits_equal_transformers_in_any_chunking(processor: MultimodalProcessor, loaded: LoadedModel,
                                                   hf: Qwen2AudioForConditionalGeneration) -> None:
    prepared = processor.prepare(CLIP, [audio(3, 12000)])  # shorter than the padded second: the mask matters
    expected, _ = hf_reference(hf, prepared, 1)
    n = len(prepared.token_ids)
    whole = executor_logits(loaded, prepared, [n])
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=0)
    media = prepared.engine_media
    assert isinstance(media, PromptMedia)
    inside = media.spans[0].start + 3
    assert torch.equal(executor_logits(loaded, prepared, [inside, inside + 9, n]), whole)
    other = executor_logits(loaded, processor.prepare(CLIP, [audio(5, 12000)]), [n])
    assert (other[-1] - whole[-1]).abs().max() > 1e-3  # the clip matters


def test_sixteen_greedy_tokens_equal_transformers(tiny_qwen2_audio_dir: Path, processor: MultimodalProcessor,
                                                  hf: Qwen2AudioForConditionalGeneration) -> None:
    prepared = processor.prepare(CLIP, [audio(4, 9000)])
    _, expected = hf_reference(hf, prepared, NEW)
    engine = start(tiny_qwen2_audio_dir)
    try:
        [got] = asyncio.run(run(engine, [request(prepared, NEW)])).values()
    finally:
        engine.shutdown()
    assert list(got.tokens) == expected


async def test_clips_the_model_cannot_take_are_invalid_argument_naming_them(tiny_qwen2_audio_dir: Path) -> None:
    """Through both services on the real model: clips too short for one encoder position (1, 100, 320 samples), or
    longer than the feature extractor's window, are INVALID_ARGUMENT naming the item and the limit (never the
    engine's assertion); WAV bytes declared mp3 are refused; the shortest clip the model takes generates."""
    config = engine_config(str(tiny_qwen2_audio_dir), "float32")
    engine = AsyncEngine.start(config)
    params = generate_pb2.SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)

    def generate(samples: int) -> generate_pb2.GenerateRequest:
        req = generate_pb2.GenerateRequest(text=[CLIP], sampling_params=[params])
        req.audio_data.add().items.add(data=wav(samples))
        return req

    def chat(samples: int, fmt: str = "wav") -> openai_pb2.ChatCompleteRequest:
        part = openai_pb2.ContentPart(type="input_audio", input_audio=openai_pb2.InputAudio(
            data=base64.b64encode(wav(samples)).decode(), format=fmt))
        return openai_pb2.ChatCompleteRequest(messages=[openai_pb2.ChatMessage(role="user", content_parts=[
            openai_pb2.ContentPart(type="text", text="What is this?"), part])], max_tokens=2, temperature=0.0)

    async def refused(call: Any, field: str) -> str:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [_ async for _ in call]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        found = violations(err.value)
        assert list(found) == [field], found
        return found[field]

    part = "messages[0].content_parts[1]"
    try:
        async with served_both(engine, config) as (stub, openai):
            for samples in (1, 100, 320):
                for call, field in ((stub.Generate(generate(samples)), "audio_data[0].items[0]"),
                                    (openai.ChatComplete(chat(samples)), part)):
                    said = await refused(call, field)
                    assert f"the clip is {samples} samples at 16000 Hz" in said and "at least 321" in said, said
            for call, field in ((stub.Generate(generate(16001)), "audio_data[0].items[0]"),
                                (openai.ChatComplete(chat(16001)), part)):
                assert "this model takes at most 1 s" in await refused(call, field)
            said = await refused(openai.ChatComplete(chat(8000, "mp3")), part)
            assert "declared mp3" in said and "WAV" in said
            [out] = [m async for m in stub.Generate(generate(321))]
            assert len(out.token_ids) == 2
            [reply] = [m async for m in openai.ChatComplete(chat(321))]
            assert reply.usage.completion_tokens == 2
            # GetModelInfo publishes the same bounds: the model's 1 s (below --max-audio-seconds' 600), 321 samples
            limits = (await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())).limits
            assert (limits.max_audio_seconds, limits.min_audio_samples, limits.audio_sampling_rate) == (1.0, 321,
                                                                                                          16000)
    finally:
        engine.shutdown()


def wav(samples: int) -> bytes:
    return clip("WAV", np.full(samples, 0.1, np.float32), rate=16000)
