"""Qwen2-Audio on a tiny random checkpoint (Whisper-like encoder, Qwen2 text side): the loader picks our family and
exposes the feature extractor's sampling rate; `prepare` expands `<|AUDIO|>` to the clip's own length (a shorter
clip, fewer positions) and refuses what does not fit; our executor's logits of an audio prompt equal transformers'
within 1e-4 in float32 (whole and chunked, bitwise alike), and the engine's 16 greedy tokens equal transformers'."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from multimodal_run import audio, executor_logits, hf_reference, image, request, run, start
from transformers import Qwen2AudioForConditionalGeneration

from lmrpc.kernels import native
from lmrpc.server.config import ModelConfig
from lmrpc.server.media.types import Media, MediaError, Modality, MultimodalProcessor
from lmrpc.server.models.loader import LoadedModel, load_model
from lmrpc.server.models.multimodal.qwen2_audio import Qwen2AudioLM
from lmrpc.server.protocol import PromptMedia

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
    with pytest.raises(MediaError, match="longer than"):
        processor.prepare(CLIP, [audio(1, 16001)])
    frames = np.zeros((1, 16, 100), np.float32)
    for tensors in ({"input_features": frames}, {"input_features": frames[:, :, :50],
                                                 "feature_attention_mask": np.ones((1, 50), np.int32)}):
        with pytest.raises(MediaError) as e:
            processor.prepare(CLIP, [Media(Modality.AUDIO, "audio_data[0].items[0]", b"t" * 16,
                                           processor_output=tensors)])
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
