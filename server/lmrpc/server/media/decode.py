"""Encoded media -> what a model's processor reads, checked against the limits, with its digest: images (PNG, JPEG,
WebP) -> RGB Pillow images, transparency composited onto white as the models' processors do (the pixel count checked
from the header, before decoding); audio (WAV, FLAC, MP3; a declared format checked against the bytes) -> mono
float32 at the model's rate (the length checked from the header against the server's and the model's limits, then
resampled with a windowed-sinc filter: deterministic, numpy only; too short for the model's encoder refused); wire
tensors (processor output, embeddings) -> numpy arrays (dtype known, shape matching the bytes). Blocking: the service
runs these off the event loop.

The digest (blake2b-128) is of the decoded content, so one picture sent as PNG bytes, a data: URI, a URL or a path
digests alike (the prefix cache keys the item's positions on it)."""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Mapping

import numpy as np
import soundfile
from PIL import Image, UnidentifiedImageError

from lmrpc.server.media.types import MediaError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # (JPEG covers MPO, the multi-picture JPEG cameras write: its first picture)
AUDIO_FORMATS = {"WAV": "WAV", "WAVEX": "WAV", "FLAC": "FLAC", "MP3": "MP3"}  # libsndfile's name -> ours
TENSOR_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int64": "<i8", "int32": "<i4"}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
SINC_ZEROS = 16  # zero crossings of the resampling filter on each side (at the lower of the two rates)
KAISER_BETA = 8.6  # the filter's window: stopband about -80 dB
RESAMPLE_BLOCK = 8192  # output samples computed at a time (bounds the temporary [block, taps] arrays)


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # framed: no two part lists hash the same bytes
        h.update(part)
    return h.digest()


# ---- images -------------------------------------------------------------------------------------------------------

# Pillow's own decompression-bomb guard (Image.MAX_IMAGE_PIXELS: a warning past ~89M pixels, an error past ~179M)
# would answer a large header before our check, with its limit instead of --max-image-pixels. decode_image refuses
# images over --max-image-pixels from the header, before anything is decoded, so Pillow's guard is turned off.
Image.MAX_IMAGE_PIXELS = None


def decode_image(data: bytes, field: str, max_pixels: int) -> tuple[Image.Image, bytes]:
    """PNG/JPEG/WebP bytes -> (the RGB image as the model's processor sees it (`as_rgb`), its digest). Undecodable
    bytes, another format, or more than max_pixels (read from the header, before decoding: no decompression bomb is
    expanded) are MediaErrors."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # the header only
    except UnidentifiedImageError as exc:
        raise MediaError(field, f"the bytes are not a PNG, JPEG or WebP image ({len(data)} bytes)") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # a header that starts right and then breaks
        raise MediaError(field, f"the image does not decode: {exc}") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(field, f"the image is {width}x{height} = {width * height} pixels; the server takes at most "
                                f"{max_pixels} (--max-image-pixels)")
    try:
        image.load()
        rgb = as_rgb(image)
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt data found while decoding
        raise MediaError(field, f"the image does not decode: {exc}") from exc
    return rgb, image_digest(rgb)


def as_rgb(image: Image.Image) -> Image.Image:
    """The image in RGB as transformers' image processors make it (image_transforms.convert_to_rgb, which they apply
    by default, do_convert_rgb): an image with transparency (an alpha band, or a palette's or colour key's
    transparency) composited onto white, any other converted. Done here, so that the digest (the prefix cache's key)
    is of what the model sees, and the processor's own conversion leaves it as it is."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def image_digest(image: Image.Image) -> bytes:
    return _digest(b"image", image.mode.encode(), f"{image.width}x{image.height}".encode(), image.tobytes())


# ---- audio --------------------------------------------------------------------------------------------------------


def sniff_audio(data: bytes) -> str | None:
    """The container its first bytes say ("WAV", "FLAC", "MP3"), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:3] == b"ID3" or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):  # a tag, or a frame sync
        return "MP3"
    return None


def _mismatch(field: str, declared: str, found: str | None) -> MediaError:
    what = f"{found} data" if found else "data that is not WAV, FLAC or MP3"
    return MediaError(field, f"the clip is declared {declared.lower()} but holds {what}")


def decode_audio(data: bytes, field: str, rate: int, max_seconds: float, *, model_max_seconds: float | None = None,
                 min_samples: int = 0, declared: str | None = None) -> tuple[np.ndarray, bytes]:
    """WAV/FLAC/MP3 bytes -> (mono float32 samples at `rate`, their digest). Channels are averaged. MediaErrors:
    undecodable bytes, another format, bytes of another format than `declared` ("WAV", "FLAC", "MP3": what the
    request said it sends), a clip longer than max_seconds (--max-audio-seconds) or model_max_seconds (the model's
    own limit; both from the header, then from what decoded), or shorter than min_samples at `rate`."""
    if declared is not None and sniff_audio(data) != declared:
        raise _mismatch(field, declared, sniff_audio(data))
    limit = max_seconds if model_max_seconds is None else min(max_seconds, model_max_seconds)
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            kind = AUDIO_FORMATS.get(f.format)
            if kind is None:
                raise MediaError(field, f"the clip is {f.format}; the server takes WAV, FLAC or MP3")
            if declared is not None and kind != declared:
                raise _mismatch(field, declared, kind)
            source_rate = f.samplerate
            if f.frames > limit * source_rate:
                raise _too_long(field, f.frames / source_rate, max_seconds, model_max_seconds)
            frames = f.read(frames=math.floor(limit * source_rate) + 1, dtype="float32", always_2d=True)
    except soundfile.LibsndfileError as exc:  # libsndfile cannot open or read it
        raise MediaError(field, f"the bytes are not a WAV, FLAC or MP3 clip that decodes ({exc.error_string})"
                         ) from exc
    except soundfile.SoundFileError as exc:
        raise MediaError(field, f"the bytes are not a WAV, FLAC or MP3 clip that decodes ({exc})") from exc
    if len(frames) > limit * source_rate:  # more than the header said
        raise _too_long(field, len(frames) / source_rate, max_seconds, model_max_seconds)
    if len(frames) == 0:
        raise MediaError(field, "the clip has no samples")
    mono = frames.mean(axis=1, dtype=np.float64)  # [samples]
    samples = resample(mono, source_rate, rate)
    check_audio_length(len(samples), rate, field, min_samples=min_samples)
    if not np.isfinite(samples).all():
        raise MediaError(field, "the clip has samples that are not finite")
    return samples, audio_digest(samples, rate)


def _too_long(field: str, seconds: float, max_seconds: float, model_max_seconds: float | None) -> MediaError:
    if model_max_seconds is not None and model_max_seconds < max_seconds:
        return MediaError(field, f"the clip is {seconds:.8g} s long; this model takes at most {model_max_seconds:g} s")
    return MediaError(field, f"the clip is {seconds:.8g} s long; the server takes at most {max_seconds:g} s "
                             "(--max-audio-seconds)")


def check_audio_length(samples: int, rate: int, field: str, *, min_samples: int = 0,
                       model_max_seconds: float | None = None) -> None:
    """A clip of `samples` at `rate` the model can take: at least min_samples (fewer give its encoder no position),
    at most model_max_seconds (its feature extractor's window); else a MediaError naming the limit."""
    if samples < min_samples:
        raise MediaError(field, f"the clip is {samples} samples at {rate} Hz ({samples / rate * 1000:.1f} ms); this "
                                f"model needs at least {min_samples} ({min_samples / rate * 1000:.1f} ms)")
    if model_max_seconds is not None and samples > model_max_seconds * rate:
        raise MediaError(field, f"the clip is {samples / rate:.8g} s long; this model takes at most "
                                f"{model_max_seconds:g} s")


def audio_digest(samples: np.ndarray, rate: int) -> bytes:
    return _digest(b"audio", str(rate).encode(), np.ascontiguousarray(samples, dtype="<f4").tobytes())


def resample(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """[samples] at rate_in -> float32 [floor(samples * rate_out / rate_in)] at rate_out: each output sample a
    Kaiser-windowed sinc sum over its neighbours, cut off at the lower rate's Nyquist frequency. Output time t_n =
    n * rate_in / rate_out input samples, computed in integers: deterministic, whatever the rates."""
    if rate_in == rate_out:
        return x.astype(np.float32)
    n_out = len(x) * rate_out // rate_in
    scale = min(1.0, rate_out / rate_in)  # the cutoff, relative to the input's Nyquist frequency
    half = math.ceil(SINC_ZEROS / scale)  # taps on each side of t_n
    offsets = np.arange(-half + 1, half + 1, dtype=np.int64)  # taps relative to floor(t_n): [2 * half]
    padded = np.concatenate([np.zeros(half), x.astype(np.float64), np.zeros(half + 1)])
    out = np.empty(n_out, dtype=np.float32)
    norm = np.i0(KAISER_BETA)
    for start in range(0, n_out, RESAMPLE_BLOCK):
        n = np.arange(start, min(n_out, start + RESAMPLE_BLOCK), dtype=np.int64)  # [block]
        num = n * rate_in
        base = num // rate_out  # floor(t_n)
        frac = (num % rate_out) / rate_out  # t_n - floor(t_n)
        dist = offsets[None, :] - frac[:, None]  # tap position - t_n: [block, taps]
        window = np.i0(KAISER_BETA * np.sqrt(np.clip(1.0 - (dist / half) ** 2, 0.0, 1.0))) / norm
        weights = scale * np.sinc(scale * dist) * window
        out[start:start + len(n)] = (padded[base[:, None] + offsets[None, :] + half] * weights).sum(axis=1)
    return out


# ---- tensors ------------------------------------------------------------------------------------------------------


def tensor_array(dtype: str, shape: tuple[int, ...], data: bytes, field: str) -> np.ndarray:
    """A wire Tensor -> a numpy array of that shape (bfloat16 widened to float32, exactly)."""
    code = TENSOR_DTYPES.get(dtype)
    if code is None:
        raise MediaError(f"{field}.dtype", f"must be one of {', '.join(TENSOR_DTYPES)}, got {dtype!r}")
    if any(d < 0 for d in shape):
        raise MediaError(f"{field}.shape", f"dimensions must be >= 0, got {list(shape)}")
    itemsize = np.dtype(code).itemsize
    count = math.prod(shape)
    if count * itemsize != len(data):
        raise MediaError(f"{field}.data", f"has {len(data)} bytes; shape {list(shape)} of {dtype} needs "
                                          f"{count * itemsize}")
    array = np.frombuffer(data, dtype=code).reshape(shape)
    if dtype == "bfloat16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    if dtype in FLOAT_DTYPES and not np.isfinite(array).all():
        raise MediaError(f"{field}.data", "values must be finite (no NaN or infinity)")
    return array


def tensors_digest(tensors: Mapping[str, tuple[str, np.ndarray]]) -> bytes:
    """Processor output: names (sorted), wire dtypes, shapes and bytes."""
    parts = [b"tensors"]
    for name in sorted(tensors):
        dtype, array = tensors[name]
        parts += [name.encode(), dtype.encode(), repr(array.shape).encode(), np.ascontiguousarray(array).tobytes()]
    return _digest(*parts)


def embedding_array(dtype: str, shape: tuple[int, ...], data: bytes, field: str, hidden_size: int
                    ) -> tuple[np.ndarray, bytes]:
    """A precomputed embedding -> (float32 [tokens, hidden_size], its digest)."""
    if dtype not in FLOAT_DTYPES:
        raise MediaError(f"{field}.dtype", f"an embedding is float32, float16 or bfloat16, got {dtype!r}")
    if len(shape) != 2 or shape[0] < 1 or shape[1] != hidden_size:
        raise MediaError(f"{field}.shape", f"must be [tokens >= 1, {hidden_size}] (the model's hidden size), got "
                                           f"{list(shape)}")
    rows = np.ascontiguousarray(tensor_array(dtype, shape, data, field), dtype=np.float32)
    return rows, _digest(b"embedding", repr(rows.shape).encode(), rows.astype("<f4").tobytes())
