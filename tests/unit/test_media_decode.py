"""Decoding media (server/lmrpc/server/media/decode.py) and a request's items end to end through ingest.py: images
(PNG/JPEG/WebP, limits, undecodable bytes), audio (WAV/FLAC/MP3, mono, resampling, limits), wire tensors; and the
same picture from bytes, a data: URI, a loopback URL and a local path digests alike."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from media_fixtures import (
    HEIGHT,
    TONE_HZ,
    TONE_RATE,
    WIDTH,
    clip,
    data_uri,
    encoded,
    loopback,
    picture,
    png_header_only,
    tone,
    transparent,
)
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from lmrpc.server.config import MediaConfig
from lmrpc.server.media import decode
from lmrpc.server.media.ingest import ModelMedia, WireItem, ingest
from lmrpc.server.media.types import MediaError, Modality
from lmrpc.v1 import generate_pb2

FIELD = "image_data[0].items[0]"
RATE = 16000  # the model's audio rate
MODEL = ModelMedia(sampling_rate=RATE, hidden_size=8)


# ---- images -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_images_decode_to_rgb(fmt: str) -> None:
    image, digest = decode.decode_image(encoded(fmt), FIELD, 10_000)
    assert image.mode == "RGB" and image.size == (WIDTH, HEIGHT) and len(digest) == 16
    if fmt != "JPEG":  # lossless: the very pixels
        assert image.tobytes() == picture().tobytes()


def test_digest_is_of_the_pixels_not_the_encoding() -> None:
    png = decode.decode_image(encoded("PNG"), FIELD, 10_000)[1]
    assert decode.decode_image(encoded("WEBP"), FIELD, 10_000)[1] == png  # lossless WebP: the same pixels
    assert decode.decode_image(encoded("JPEG"), FIELD, 10_000)[1] != png  # lossy: other pixels
    rgba = picture().convert("RGBA")
    assert decode.decode_image(encoded("PNG", rgba), FIELD, 10_000)[1] == png  # opaque: the same RGB pixels
    other = picture().transpose(0)
    assert decode.decode_image(encoded("PNG", other), FIELD, 10_000)[1] != png


@pytest.mark.parametrize("kind", ["RGBA", "LA", "P", "RGB+tRNS"])
def test_transparency_is_composited_onto_white_as_the_processors_do(kind: str) -> None:
    data = encoded("PNG", transparent(kind))
    raw = Image.open(io.BytesIO(data))
    expected = convert_to_rgb(raw, return_numpy=True)  # what every HF image processor does first (do_convert_rgb)
    image, digest = decode.decode_image(data, FIELD, 10_000)
    assert image.mode == "RGB" and np.array_equal(np.asarray(image), expected)
    dropped = raw.convert("RGB")  # alpha dropped: other pixels (black, or the colour under it), another digest
    assert not np.array_equal(np.asarray(dropped), expected)
    assert digest != decode.image_digest(dropped) and digest == decode.image_digest(Image.fromarray(expected))


@pytest.mark.parametrize(("data", "says"), [
    (b"not an image at all", "not a PNG, JPEG or WebP"),
    (encoded("GIF"), "not a PNG, JPEG or WebP"),  # a format we do not take
    (encoded("PNG")[:60], "does not decode"),  # truncated
])
def test_undecodable_images_name_the_item(data: bytes, says: str) -> None:
    with pytest.raises(MediaError) as err:
        decode.decode_image(data, FIELD, 10_000)
    assert err.value.field == FIELD and says in err.value.message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_too_many_pixels_is_refused_before_decoding(fmt: str) -> None:
    with pytest.raises(MediaError) as err:
        decode.decode_image(encoded(fmt), FIELD, WIDTH * HEIGHT - 1)
    assert err.value.message == (f"the image is {WIDTH}x{HEIGHT} = {WIDTH * HEIGHT} pixels; the server takes at most "
                                 f"{WIDTH * HEIGHT - 1} (--max-image-pixels)")
    decode.decode_image(encoded(fmt), FIELD, WIDTH * HEIGHT)  # exactly the limit is fine


@pytest.mark.parametrize("side", [20_000, 60_000, 100_000])
def test_a_bomb_header_is_refused_with_the_servers_limit(side: str) -> None:
    """A header claiming side x side pixels over a few bytes of data: refused from the header, nothing allocated, in
    the server's words and limit (not Pillow's decompression-bomb text and its 178956970)."""
    with pytest.raises(MediaError) as err:
        decode.decode_image(png_header_only(side, side), FIELD, 16_777_216)
    assert err.value.field == FIELD
    assert err.value.message == (f"the image is {side}x{side} = {side * side} pixels; the server takes at most "
                                 "16777216 (--max-image-pixels)")


# ---- audio --------------------------------------------------------------------------------------------------------


def expected_tone(n: int, rate: int) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * TONE_HZ * np.arange(n) / rate)


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_lossless_audio_decodes_and_resamples(fmt: str) -> None:
    samples, digest = decode.decode_audio(clip(fmt), "audio_data[0].items[0]", RATE, 60)
    assert samples.dtype == np.float32 and samples.shape == (TONE_RATE * RATE // TONE_RATE,)
    middle = slice(200, -200)  # away from the edges, where the filter sees the zero padding
    assert np.abs(samples[middle] - expected_tone(len(samples), RATE)[middle]).max() < 2e-3
    assert len(digest) == 16


def test_mp3_decodes() -> None:
    samples, _ = decode.decode_audio(clip("MP3"), "audio_data[0].items[0]", RATE, 60)
    assert abs(len(samples) - RATE) < RATE * 0.1  # the encoder pads a few frames
    rms = float(np.sqrt(np.mean(samples[2000:-2000].astype(np.float64) ** 2)))
    assert abs(rms - 0.5 / np.sqrt(2)) < 0.05


def test_wav_and_flac_of_the_same_samples_digest_alike() -> None:
    wav = decode.decode_audio(clip("WAV"), "f", RATE, 60)[1]
    assert decode.decode_audio(clip("FLAC"), "f", RATE, 60)[1] == wav
    assert decode.decode_audio(clip("WAV"), "f", 8000, 60)[1] != wav  # another rate, other samples


def test_stereo_is_averaged_to_mono() -> None:
    left = tone()
    samples, _ = decode.decode_audio(clip("WAV", np.stack([left, -left], axis=1)), "f", RATE, 60)
    assert np.abs(samples).max() < 1e-6


def test_resampling_is_deterministic_and_accurate_upwards() -> None:
    x = expected_tone(8000, 8000)
    up = decode.resample(x, 8000, RATE)
    assert up.tobytes() == decode.resample(x, 8000, RATE).tobytes()
    assert len(up) == 16000
    assert np.abs(up[200:-200] - expected_tone(16000, RATE)[200:-200]).max() < 2e-3
    assert decode.resample(x, 8000, 8000).tobytes() == x.astype(np.float32).tobytes()


def test_resampling_down_removes_what_the_new_rate_cannot_hold() -> None:
    t = np.arange(TONE_RATE) / TONE_RATE
    above = np.sin(2 * np.pi * 12_000 * t)  # above 16 kHz's Nyquist (8 kHz): must not alias into the output
    assert np.abs(decode.resample(above, TONE_RATE, RATE)[200:-200]).max() < 0.01


@pytest.mark.parametrize("data", [b"RIFF....WAVEfmt nonsense", encoded("PNG"), clip("WAV")[:30]])
def test_undecodable_audio_names_the_item(data: bytes) -> None:
    with pytest.raises(MediaError) as err:
        decode.decode_audio(data, "audio_data[0].items[1]", RATE, 60)
    assert err.value.field == "audio_data[0].items[1]" and "WAV, FLAC or MP3" in err.value.message


def test_undecodable_audio_says_why_in_one_clean_sentence() -> None:
    with pytest.raises(MediaError) as err:
        decode.decode_audio(b"junk" * 10, "audio_data[0].items[1]", RATE, 60)
    assert err.value.message == "the bytes are not a WAV, FLAC or MP3 clip that decodes (Format not recognised.)"


def test_too_long_audio_is_refused_with_the_binding_limit() -> None:
    with pytest.raises(MediaError) as err:
        decode.decode_audio(clip("WAV"), "f", RATE, 0.5)  # a 1 s clip
    assert err.value.message == "the clip is 1 s long; the server takes at most 0.5 s (--max-audio-seconds)"
    with pytest.raises(MediaError) as err:  # the model's limit, below the server's: from the header
        decode.decode_audio(clip("WAV"), "f", RATE, 600, model_max_seconds=0.25)
    assert err.value.message == "the clip is 1 s long; this model takes at most 0.25 s"
    decode.decode_audio(clip("WAV"), "f", RATE, 600, model_max_seconds=1.0)  # exactly the limit is fine


def test_too_short_audio_is_refused_at_the_models_rate() -> None:
    with pytest.raises(MediaError) as err:  # 100 samples at 44.1 kHz are 36 at 16 kHz
        decode.decode_audio(clip("WAV", tone()[:100]), "f", RATE, 60, min_samples=321)
    assert err.value.message == "the clip is 36 samples at 16000 Hz (2.2 ms); this model needs at least 321 (20.1 ms)"
    with pytest.raises(MediaError, match="is 320 samples"):  # 883 at 44.1 kHz
        decode.decode_audio(clip("WAV", tone()[:883]), "f", RATE, 60, min_samples=321)
    samples, _ = decode.decode_audio(clip("WAV", tone()[:885]), "f", RATE, 60, min_samples=321)
    assert len(samples) == 321


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "MP3"])
def test_the_declared_format_must_be_the_bytes(fmt: str) -> None:
    data = clip(fmt)
    assert decode.sniff_audio(data) == fmt
    decode.decode_audio(data, "f", RATE, 60, declared=fmt)
    for other in {"WAV", "FLAC", "MP3"} - {fmt}:
        with pytest.raises(MediaError) as err:
            decode.decode_audio(data, "audio_data[0].items[0]", RATE, 60, declared=other)
        assert err.value.field == "audio_data[0].items[0]"
        assert err.value.message == f"the clip is declared {other.lower()} but holds {fmt} data"
    with pytest.raises(MediaError, match="declared mp3 but holds data that is not WAV, FLAC or MP3"):
        decode.decode_audio(encoded("PNG"), "f", RATE, 60, declared="MP3")


# ---- tensors ------------------------------------------------------------------------------------------------------


def test_tensors_are_checked() -> None:
    values = np.array([[1.5, -2.0], [0.25, 3.0]], dtype=np.float32)
    assert np.array_equal(decode.tensor_array("float32", (2, 2), values.tobytes(), "t"), values)
    bf16 = (values.view(np.uint32) >> 16).astype("<u2").tobytes()  # exact in bfloat16
    assert np.array_equal(decode.tensor_array("bfloat16", (2, 2), bf16, "t"), values)
    with pytest.raises(MediaError, match="must be one of") as err:
        decode.tensor_array("float64", (2, 2), values.tobytes(), "t")
    assert err.value.field == "t.dtype"
    with pytest.raises(MediaError, match="needs 12") as err:
        decode.tensor_array("float32", (3,), values.tobytes(), "t")
    assert err.value.field == "t.data"
    with pytest.raises(MediaError, match="finite"):
        decode.tensor_array("float32", (1,), np.array([np.nan], np.float32).tobytes(), "t")


def test_embedding_must_be_the_models_width() -> None:
    rows = np.ones((3, 8), np.float32)
    array, digest = decode.embedding_array("float32", (3, 8), rows.tobytes(), "e", 8)
    assert array.shape == (3, 8) and len(digest) == 16
    with pytest.raises(MediaError, match=r"\[tokens >= 1, 4\]"):
        decode.embedding_array("float32", (3, 8), rows.tobytes(), "e", 4)
    with pytest.raises(MediaError, match="float32, float16 or bfloat16"):
        decode.embedding_array("int32", (3, 8), rows.tobytes(), "e", 8)


# ---- ingest: one picture however it comes -------------------------------------------------------------------------


def items(*media: generate_pb2.MediaItem, modality: Modality = Modality.IMAGE) -> list[list[WireItem]]:
    return [[WireItem(modality, f"image_data[0].items[{j}]", m) for j, m in enumerate(media)]]


async def test_the_same_picture_digests_alike_however_it_comes(tmp_path: Path) -> None:
    png = encoded("PNG")
    (tmp_path / "a.png").write_bytes(png)
    config = MediaConfig(allowed_local_media_path=str(tmp_path))
    with loopback({"/a.png": png}) as web:
        [media] = await ingest(items(
            generate_pb2.MediaItem(data=png), generate_pb2.MediaItem(url=data_uri(png)),
            generate_pb2.MediaItem(url=web.url("/a.png")), generate_pb2.MediaItem(url=str(tmp_path / "a.png")),
            generate_pb2.MediaItem(url=(tmp_path / "a.png").as_uri()), generate_pb2.MediaItem(data=encoded("WEBP")),
        ), config, MODEL)
    assert [m.wire_field for m in media] == [f"image_data[0].items[{j}]" for j in range(6)]
    assert len({m.digest for m in media}) == 1
    assert all(m.image is not None and m.image.tobytes() == picture().tobytes() for m in media)


async def test_ingest_raises_the_first_failing_item_and_keeps_options() -> None:
    png = encoded("PNG")
    with pytest.raises(MediaError) as err:
        await ingest(items(generate_pb2.MediaItem(data=png), generate_pb2.MediaItem(data=b"junk"),
                           generate_pb2.MediaItem(data=b"junk too")), MediaConfig(), MODEL)
    assert err.value.field == "image_data[0].items[1]"
    [[m]] = await ingest(items(generate_pb2.MediaItem(data=png, min_pixels=4, max_pixels=64)), MediaConfig(), MODEL)
    assert (m.options.min_pixels, m.options.max_pixels) == (4, 64)
    with pytest.raises(MediaError, match="must be <= max_pixels") as err:
        await ingest(items(generate_pb2.MediaItem(data=png, min_pixels=65, max_pixels=64)), MediaConfig(), MODEL)
    assert err.value.field == "image_data[0].items[0].min_pixels"
    with pytest.raises(MediaError, match="no source"):
        await ingest(items(generate_pb2.MediaItem()), MediaConfig(), MODEL)


async def test_ingest_takes_processor_output_and_embeddings() -> None:
    pixels = np.arange(12, dtype=np.float32).reshape(3, 4)
    grid = np.array([[1, 1, 3]], dtype=np.int64)
    output = generate_pb2.ProcessorOutput(tensors={
        "pixel_values": generate_pb2.Tensor(dtype="float32", shape=[3, 4], data=pixels.tobytes()),
        "image_grid_thw": generate_pb2.Tensor(dtype="int64", shape=[1, 3], data=grid.tobytes())})
    rows = np.ones((2, 8), np.float32)
    embedding = generate_pb2.Tensor(dtype="float32", shape=[2, 8], data=rows.tobytes())
    [[a, b, c]] = await ingest(items(generate_pb2.MediaItem(processor_output=output),
                                     generate_pb2.MediaItem(processor_output=output),
                                     generate_pb2.MediaItem(embedding=embedding)), MediaConfig(), MODEL)
    assert a.processor_output is not None and np.array_equal(a.processor_output["image_grid_thw"], grid)
    assert a.digest == b.digest != c.digest
    assert c.embedding is not None and c.embedding.shape == (2, 8)
    bad = generate_pb2.ProcessorOutput(tensors={"pixel_values": generate_pb2.Tensor(dtype="float32", shape=[5],
                                                                                    data=pixels.tobytes())})
    with pytest.raises(MediaError) as err:
        await ingest(items(generate_pb2.MediaItem(processor_output=bad)), MediaConfig(), MODEL)
    assert err.value.field == "image_data[0].items[0].processor_output.tensors['pixel_values'].data"


async def test_ingest_checks_a_data_uris_audio_type_and_the_models_limits() -> None:
    wav = clip("WAV")
    for mime in ("audio/wav", "audio/x-wav", "application/octet-stream", ""):  # WAV, or no audio type declared
        [[m]] = await ingest(items(generate_pb2.MediaItem(url=data_uri(wav, mime)), modality=Modality.AUDIO),
                             MediaConfig(), MODEL)
        assert m.audio is not None
    for mime in ("audio/mpeg", "audio/mp3", "audio/flac"):
        with pytest.raises(MediaError, match="but holds WAV data") as err:
            await ingest(items(generate_pb2.MediaItem(data=clip("FLAC")), generate_pb2.MediaItem(
                url=data_uri(wav, mime)), modality=Modality.AUDIO), MediaConfig(), MODEL)
        assert err.value.field == "image_data[0].items[1]"
    limited = ModelMedia(sampling_rate=RATE, hidden_size=8, min_audio_samples=321, max_audio_seconds=0.5)
    with pytest.raises(MediaError, match=r"this model takes at most 0\.5 s"):
        await ingest(items(generate_pb2.MediaItem(data=wav), modality=Modality.AUDIO), MediaConfig(), limited)
    with pytest.raises(MediaError, match="needs at least 321"):
        await ingest(items(generate_pb2.MediaItem(data=clip("WAV", tone()[:100])), modality=Modality.AUDIO),
                     MediaConfig(), limited)


async def test_audio_items_are_resampled_to_the_models_rate() -> None:
    [[m]] = await ingest(items(generate_pb2.MediaItem(data=clip("FLAC")), modality=Modality.AUDIO), MediaConfig(),
                         MODEL)
    assert m.modality is Modality.AUDIO and m.sampling_rate == RATE
    assert m.audio is not None and len(m.audio) == RATE
    assert m.digest == decode.decode_audio(clip("WAV"), "f", RATE, 60)[1]
