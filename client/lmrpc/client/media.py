"""Python values -> the media of a GenerateRequest (image_data, audio_data).

An item is a str (an http(s) URL, a data: URI or a path, read by the server; a path or file:// URL only under the
server's --allowed-local-media-path), bytes (the encoded file: PNG, JPEG, WebP; WAV, FLAC, MP3), or a ready
lmrpc.v1.MediaItem (for processor output and precomputed embeddings see `processor_output` and `embedding`). A
request's media is one item or a flat list of items (for a single prompt, or for every prompt), or one list per
prompt. Arrays are taken from anything shaped like a numpy array (dtype, shape, tobytes); no numpy import here."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Union

from lmrpc.v1 import generate_pb2

MediaLike = Union[str, bytes, generate_pb2.MediaItem]  # noqa: UP007 (runtime alias, py3.10)
MediaArg = Union[MediaLike, Sequence[MediaLike], Sequence[Sequence[MediaLike]]]  # noqa: UP007

_DTYPES = frozenset({"float32", "float16", "bfloat16", "int64", "int32"})


def media_item(value: MediaLike | bytearray | memoryview, *, min_pixels: int | None = None,
               max_pixels: int | None = None) -> generate_pb2.MediaItem:
    """One item: a str is a URL (or data: URI, or path) the server reads, bytes are the file's content."""
    if isinstance(value, generate_pb2.MediaItem):
        item = generate_pb2.MediaItem()
        item.CopyFrom(value)
    elif isinstance(value, str):
        item = generate_pb2.MediaItem(url=value)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        item = generate_pb2.MediaItem(data=bytes(value))
    else:
        raise TypeError(f"a media item is a str (URL or path), bytes or lmrpc.v1.MediaItem, not {type(value).__name__}")
    if min_pixels is not None:
        item.min_pixels = min_pixels
    if max_pixels is not None:
        item.max_pixels = max_pixels
    return item


def media_lists(value: MediaArg | None) -> list[generate_pb2.MediaList]:
    """None -> [] (no media); one item or a flat list -> one list (the prompt's, or every prompt's); a list of
    lists -> one list per prompt."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, bytearray, memoryview, generate_pb2.MediaItem)):
        return [generate_pb2.MediaList(items=[media_item(value)])]
    entries: list[Any] = list(value)
    if all(_is_item(e) for e in entries):
        return [generate_pb2.MediaList(items=[media_item(e) for e in entries])]
    if any(_is_item(e) for e in entries):
        raise TypeError("media must be items, a list of items, or a list of lists of items, not a mix")
    for prompt in entries:
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"a media item is a str (URL or path), bytes or lmrpc.v1.MediaItem, and a prompt's "
                            f"items a list of them, not {type(prompt).__name__}")
    return [generate_pb2.MediaList(items=[media_item(e) for e in prompt]) for prompt in entries]


def _is_item(value: Any) -> bool:
    return isinstance(value, (str, bytes, bytearray, memoryview, generate_pb2.MediaItem))


def tensor(array: Any) -> generate_pb2.Tensor:
    """A numpy-like array (float32/float16/bfloat16/int64/int32) -> lmrpc.v1.Tensor (row-major, little-endian)."""
    dtype = str(getattr(array, "dtype", ""))
    if dtype not in _DTYPES:
        allowed = ", ".join(sorted(_DTYPES))
        raise TypeError(f"tensor dtype must be one of {allowed}, not {dtype or type(array).__name__}")
    if sys.byteorder != "little" and dtype != "bfloat16":
        array = array.byteswap()
    return generate_pb2.Tensor(dtype=dtype, shape=[int(d) for d in array.shape], data=array.tobytes())


def processor_output(tensors: dict[str, Any], **options: int) -> generate_pb2.MediaItem:
    """An item given as the model's Hugging Face processor output for it (e.g. pixel_values, image_grid_thw)."""
    item = generate_pb2.MediaItem(processor_output=generate_pb2.ProcessorOutput(
        tensors={name: tensor(a) for name, a in tensors.items()}))
    return media_item(item, **options)


def embedding(rows: Any) -> generate_pb2.MediaItem:
    """An item given as its rows [tokens, hidden size] as the language model reads them."""
    return generate_pb2.MediaItem(embedding=tensor(rows))


