"""Encoded media -> what a model's processor reads, checked against the limits, with its digest: images (PNG, JPEG,
WebP) -> RGB Pillow images (the pixel count checked from the header, before decoding); audio (WAV, FLAC, MP3) -> mono
float32 at the model's rate (the length checked from the header, then resampled with a windowed-sinc filter:
deterministic, numpy only); wire tensors (processor output, embeddings) -> numpy arrays (dtype known, shape matching
the bytes). Blocking: the service runs these off the event loop.

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


def decode_image(data: bytes, field: str, max_pixels: int) -> tuple[Image.Image, bytes]:
    """PNG/JPEG/WebP bytes -> (the RGB image, its digest). Undecodable bytes, another format, or more than
    max_pixels (read from the header, before decoding: no decompression bomb is expanded) are MediaErrors."""
    try:
        # Image.open reads the header only; the size is checked before load() decodes anything. (Pillow's own bomb
        # limit, Image.MAX_IMAGE_PIXELS, still refuses past twice its value.)
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise MediaError(field, f"image is {width}x{height} = {width * height} pixels; the server takes at "
                                    f"most {max_pixels} (--max-image-pixels)")
        image.load()
        rgb = image.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise MediaError(field, f"image is too large to decode: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise MediaError(field, f"is not a PNG, JPEG or WebP image ({len(data)} bytes)") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt data found while decoding
        raise MediaError(field, f"image does not decode: {exc}") from exc
    return rgb, image_digest(rgb)


def image_digest(image: Image.Image) -> bytes:
    return _digest(b"image", image.mode.encode(), f"{image.width}x{image.height}".encode(), image.tobytes())


# ---- audio --------------------------------------------------------------------------------------------------------


def decode_audio(data: bytes, field: str, rate: int, max_seconds: float) -> tuple[np.ndarray, bytes]:
    """WAV/FLAC/MP3 bytes -> (mono float32 samples at `rate`, their digest). Channels are averaged. Undecodable
    bytes, another format, or a clip longer than max_seconds (from the header, then from what decoded) are
    MediaErrors."""
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            kind = AUDIO_FORMATS.get(f.format)
            if kind is None:
                raise MediaError(field, f"audio format {f.format} is not taken (WAV, FLAC or MP3)")
            source_rate = f.samplerate
            if f.frames > max_seconds * source_rate:
                raise MediaError(field, f"audio is {f.frames / source_rate:.1f} s long; the server takes at most "
                                        f"{max_seconds:g} s (--max-audio-seconds)")
            frames = f.read(frames=math.floor(max_seconds * source_rate) + 1, dtype="float32", always_2d=True)
    except soundfile.SoundFileError as exc:  # libsndfile cannot open or read it
        raise MediaError(field, f"is not a WAV, FLAC or MP3 clip that decodes: {exc}") from exc
    if len(frames) > max_seconds * source_rate:
        raise MediaError(field, f"audio is longer than {max_seconds:g} s (--max-audio-seconds)")
    if len(frames) == 0:
        raise MediaError(field, "audio clip has no samples")
    mono = frames.mean(axis=1, dtype=np.float64)  # [samples]
    samples = resample(mono, source_rate, rate)
    if not np.isfinite(samples).all():
        raise MediaError(field, "audio has samples that are not finite")
    return samples, audio_digest(samples, rate)


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
