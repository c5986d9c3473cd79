"""A GGUF file's header read in one pass: its scalar metadata, and each tensor's name, type, shape and bytes (views
of the mapped file, never copied).

Why not gguf's own `GGUFReader`: it builds a numpy view for every part of every metadata field, about a million of
them for a 49k-token vocabulary and its merges, which took 5.5 of the bundled model's 6.9 s load. The server never
reads those arrays here (the loader takes the tokenizer from the HF directory it converts once and caches), so this
reader steps over arrays by their lengths and keeps only scalars. The tensors' bytes are what `gguf.quants` and
`kernels.gguf_blocks` take, shaped as GGUFReader shapes them: float types as [.., ne1, ne0] arrays of their dtype,
block types as [.., ne1, bytes per row] uint8.

Format (little-endian): magic "GGUF", version (2 or 3), tensor count, metadata count (u64 each); metadata as key
(string: u64 length + UTF-8), value type (u32), value; tensor infos as name, dims (u32 count, u64 each, innermost
first), ggml type (u32), offset (u64) from the data section, which starts at the next multiple of
`general.alignment` (32 unless set) after the infos.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from lmrpc.server.models.types import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type -> struct format of one scalar (gguf.GGUFValueType numbering); STRING and ARRAY are read apart
_SCALARS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b", gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h", gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?", gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q", gguf.GGUFValueType.FLOAT64: "<d",
}
# ggml types whose tensors are plain arrays of one dtype (everything else is blocks of bytes)
_PLAIN = {
    gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}

Scalar = int | float | bool | str


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    tensor_type: gguf.GGMLQuantizationType  # how its values are stored
    shape: tuple[int, ...]  # GGUF order: innermost (row length, ne0) first
    data: np.ndarray  # read-only view of the mapped file: [.., ne1, ne0] of its dtype, or [.., ne1, row bytes] uint8
    offset: int  # where its bytes start in the file


class _Cursor:
    """Sequential little-endian reads over the mapped header, each bounds-checked."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.at = buf, path, 0

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise ModelLoadError(f"{self.path}: not a complete GGUF file (the header ends at byte {len(self.buf)})")
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def count(self) -> int:
        return int(self.take("<Q"))

    def skip(self, size: int) -> None:
        if size < 0 or self.at + size > len(self.buf):
            raise ModelLoadError(f"{self.path}: not a complete GGUF file (a value runs past byte {len(self.buf)})")
        self.at += size

    def string(self) -> str:
        n = self.count()
        start = self.at
        self.skip(n)
        return bytes(self.buf[start:self.at]).decode("utf-8")

    def value_type(self) -> gguf.GGUFValueType:
        raw = int(self.take("<I"))
        try:
            return gguf.GGUFValueType(raw)
        except ValueError:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {raw} at byte {self.at - 4}") from None

    def value(self, kind: gguf.GGUFValueType) -> Scalar | None:
        """A scalar or string; an array is stepped over (None)."""
        if kind is gguf.GGUFValueType.STRING:
            return self.string()
        if kind is gguf.GGUFValueType.ARRAY:
            self.skip_array()
            return None
        return self.take(_SCALARS[kind])

    def skip_array(self) -> None:
        kind, n = self.value_type(), self.count()
        if kind in _SCALARS:
            self.skip(n * struct.calcsize(_SCALARS[kind]))
        elif kind is gguf.GGUFValueType.STRING:
            for _ in range(n):  # each string is its length then its bytes: only the lengths are read
                self.skip(self.count())
        else:
            for _ in range(n):
                self.skip_array()


class GGUFFile:
    """The header of a GGUF file and views of its tensors. The mapping stays open as long as this object or any
    tensor view does."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(self._map, self.path)
        if bytes(self._map[:4]) != MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (it does not start with {MAGIC!r})")
        cursor.skip(4)
        version = int(cursor.take("<I"))
        if version not in VERSIONS:
            raise ModelLoadError(f"{self.path}: GGUF version {version} (byte-swapped: a big-endian file?); this reader "
                                 f"takes versions {VERSIONS} in little-endian")
        num_tensors, num_fields = cursor.count(), cursor.count()
        metadata: dict[str, Scalar] = {}
        fields_start = cursor.at
        for _ in range(num_fields):
            key = cursor.string()
            value = cursor.value(cursor.value_type())
            if value is not None:
                metadata[key] = value
        self.metadata: Mapping[str, Scalar] = metadata  # scalar and string fields (arrays are not kept)
        # What an HF config and tokenizer are converted from: every metadata field (arrays included) and the tensors'
        # names and shapes (transformers reads a few config values from them, e.g. tied embeddings when there is no
        # output.weight), not their formats or bytes. Files of one model in different quantizations share it.
        digest = hashlib.sha256(self._map[fields_start : cursor.at])
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = tuple(cursor.count() for _ in range(int(cursor.take("<I"))))
            raw_type = int(cursor.take("<I"))
            try:
                kind = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown ggml type {raw_type}") from None
            infos.append((name, dims, kind, cursor.count()))
            digest.update(f"{name}{dims}".encode())
        self.header_digest = digest.hexdigest()
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.at // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, kind, offset in infos:
            if name in self.tensors:
                raise ModelLoadError(f"{self.path}: tensor {name!r} appears twice")
            at = data_start + offset
            self.tensors[name] = GGUFTensor(name, kind, dims, self._view(name, dims, kind, at), at)

    def _view(self, name: str, dims: tuple[int, ...], kind: gguf.GGMLQuantizationType, at: int) -> np.ndarray:
        elements = int(np.prod(dims, dtype=np.int64))
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        if dims and dims[0] % block:
            raise ModelLoadError(f"{self.path}: tensor {name!r} rows of {dims[0]} are not whole {kind.name} blocks")
        size = elements // block * block_bytes
        if at + size > len(self._map):
            raise ModelLoadError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        shape = tuple(reversed(dims))
        if kind in _PLAIN:
            return np.frombuffer(self._map, dtype=_PLAIN[kind], count=elements, offset=at).reshape(shape)
        row_bytes = dims[0] // block * block_bytes
        return np.frombuffer(self._map, dtype=np.uint8, count=size, offset=at).reshape(*shape[:-1], row_bytes)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the tensor's pages from this process's resident set once it has been copied into the kernels'
        layout: a mapped file's pages count in RSS while mapped, so a model read whole would otherwise hold its file
        and its packed copy at once (the page cache keeps them; a later read faults them back in)."""
        page = mmap.PAGESIZE
        start = tensor.offset // page * page
        end = min(-(-(tensor.offset + tensor.data.nbytes) // page) * page, len(self._map))
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def field_int(self, key: str) -> int:
        value = self.metadata.get(key)
        if not isinstance(value, int):
            raise ModelLoadError(f"{self.path}: metadata {key!r} is missing or not an integer")
        return value

    def field_str(self, key: str) -> str:
        value = self.metadata.get(key)
        if not isinstance(value, str):
            raise ModelLoadError(f"{self.path}: metadata {key!r} is missing or not a string")
        return value
