"""Where a model's tensors come from: a Hugging Face safetensors directory, or a GGUF file read as it is.

Both answer by Hugging Face parameter names (`model.layers.0.self_attn.q_proj.weight`). A GGUF file's Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS matrices are handed over as their own integer
codes and scales (`PackedWeight`, kernels/gguf_blocks.py; never dequantized), and IQ1-IQ3 and TQ ones as exact wider
codes (kernels/gguf_grids.py), so they are served with exactly the file's weights; other tensors are dequantized to
float32 with the gguf package.
llama.cpp stores the rows of Llama's q and k projections interleaved for its RoPE; they are put back in Hugging
Face's order here (a row permutation: of the blocks' bytes before packing, or of dense values).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import gguf
import numpy as np
import torch
from safetensors import safe_open

from lmrpc.kernels import gguf_blocks, gguf_grids, packed_rows, packing
from lmrpc.kernels.packing import PackedWeight
from lmrpc.server.models.gguf_file import GGUFFile, GGUFTensor
from lmrpc.server.models.types import ModelLoadError, ModelNotFoundError


@dataclass(frozen=True)
class RowParts:
    """Packed weights stacked along their rows but each kept in its own format: a fused product (q/k/v, gate/up)
    whose parts come in different formats, such as a Q4_K_M layer's Q4_K q and k beside its Q6_K v. Served as one
    product whose parts run side by side (quantized.StackedLinear), each with its own format's kernel and no more
    bytes than its file gives it."""

    parts: tuple[PackedWeight, ...]  # in output order; neighbours of one format already stacked into one part

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    def dense(self) -> torch.Tensor:
        """The stacked weight's values [n, k] float32 (where the parts are not served as blocks)."""
        return torch.cat([packing.dequantize(p) for p in self.parts])


Matrix = torch.Tensor | PackedWeight | RowParts  # a linear layer's weight [out, in]: dense values, or packed codes


def stack_rows(parts: Sequence[Matrix]) -> Matrix:
    """Weights stacked along their rows (fused qkv and gate_up products): dense values concatenated; packed codes of
    one format re-packed into one weight; packed parts in different formats kept apart (RowParts), each run of
    neighbours in one format stacked into one part. Parts mixing dense values and codes are stacked as dense."""
    packed = [p for p in parts if isinstance(p, PackedWeight)]
    if packed and len(packed) == len(parts):
        runs: list[list[PackedWeight]] = []
        for p in packed:
            if runs and packed_rows.stackable([runs[-1][0], p]):
                runs[-1].append(p)
            else:
                runs.append([p])
        stacked = [packed_rows.concat_rows(run) if len(run) > 1 else run[0] for run in runs]
        return stacked[0] if len(stacked) == 1 else RowParts(tuple(stacked))
    return torch.cat([_dense(p) for p in parts])


def matrix_shape(m: Matrix) -> tuple[int, ...]:
    """A linear layer's weight's [out, in] (a dense tensor's own shape, whatever its rank)."""
    return (m.n, m.k) if isinstance(m, (PackedWeight, RowParts)) else tuple(int(d) for d in m.shape)


def expect_shape(name: str, got: Sequence[int], expected: Sequence[int]) -> None:
    """A weight against the shape the model's config gives it: a file whose tensors disagree with its own config is
    refused at load, naming the tensor, rather than loading and then failing inside a kernel at every request."""
    if tuple(got) != tuple(expected):
        raise ModelLoadError(f"tensor {name!r} is {list(got)} where the model's config makes it {list(expected)}")


def _dense(m: Matrix) -> torch.Tensor:
    if isinstance(m, PackedWeight):
        return packing.dequantize(m)
    return m.dense() if isinstance(m, RowParts) else m


class WeightSource(Protocol):
    def has(self, name: str) -> bool: ...

    def tensor(self, name: str) -> torch.Tensor:
        """A dense tensor in its stored float dtype (norms, biases, embeddings)."""
        ...

    def matrix(self, name: str) -> Matrix:
        """A linear layer's weight [out, in]: dense, or packed codes when the source stores it quantized."""
        ...


class SafetensorsWeights:
    """Every *.safetensors file of a directory, read lazily by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._files: dict[str, Path] = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                    self._files[key] = file
        if not self._files:
            raise ModelNotFoundError(f"no .safetensors weights in {path}")

    def has(self, name: str) -> bool:
        return name in self._files

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise ModelLoadError(f"{self.path}: the model needs tensor {name!r}, which no .safetensors file has")
        with safe_open(self._files[name], "pt") as f:
            return f.get_tensor(name)

    def matrix(self, name: str) -> Matrix:
        return self.tensor(name)


# GGUF architecture names whose q/k rows llama.cpp's converter permutes (Llama's interleaved RoPE layout).
_PERMUTED_QK_ARCHS = frozenset({"llama"})


class GGUFWeights:
    """The tensors of a GGUF file under Hugging Face names."""

    def __init__(self, path: Path, heads: int, kv_heads: int) -> None:
        self._file = GGUFFile(path)
        self.arch = self._file.field_str("general.architecture")
        arch_ids = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
        if self.arch not in arch_ids:
            raise ModelLoadError(f"unknown GGUF architecture {self.arch!r}")
        blocks = self._file.field_int(f"{self.arch}.block_count")
        self._map = gguf.get_tensor_name_map(arch_ids[self.arch], blocks)
        self._tensors = self._file.tensors
        self._heads, self._kv_heads = heads, kv_heads

    def _gguf_name(self, name: str) -> str | None:
        base, _, suffix = name.rpartition(".")  # "...q_proj", "weight"
        mapped = self._map.get_name(base)
        if mapped is None:
            return None
        full = f"{mapped}.{suffix}"
        return full if full in self._tensors else None

    def has(self, name: str) -> bool:
        return self._gguf_name(name) is not None

    def _raw(self, name: str) -> GGUFTensor:
        mapped = self._gguf_name(name)
        if mapped is None:
            base, _, suffix = name.rpartition(".")
            wanted = self._map.get_name(base)
            named = f" ({wanted}.{suffix} in the file's names)" if wanted else ""
            raise ModelLoadError(f"{self._file.path}: the model needs tensor {name!r}{named}, which the file lacks")
        return self._tensors[mapped]

    def tensor(self, name: str) -> torch.Tensor:
        t = self._raw(name)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        out = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)  # a writable copy
        self._file.release(t)
        return self._unpermute(name, out)

    def matrix(self, name: str) -> Matrix:
        t = self._raw(name)
        n, k = int(t.shape[1]), int(t.shape[0])
        if int(t.tensor_type) not in gguf_blocks.SUPPORTED or k % gguf_blocks.BLOCK[int(t.tensor_type)][0]:
            return self.tensor(name)
        raw = np.asarray(t.data).reshape(n, -1)  # [n, row bytes]: a row's blocks are one run of bytes
        order = self._row_order(name, n)
        if order is not None:  # rows put in HF's order before packing (a copy of the permuted rows' bytes)
            raw = raw[order.numpy()]
        try:
            packed = gguf_blocks.pack_gguf(int(t.tensor_type), raw, n, k)
        except gguf_grids.NotExact:  # a grid format's scale that its held layout would round: served dense
            return self.tensor(name)
        self._file.release(t)
        return packed

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """HF row r of a permuted q/k projection is GGUF row order[r] (see the module doc)."""
        if self.arch not in _PERMUTED_QK_ARCHS or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        heads = self._heads if name.endswith("q_proj.weight") else self._kv_heads
        head_dim = rows // heads
        h, e, i = torch.meshgrid(torch.arange(heads), torch.arange(2), torch.arange(head_dim // 2), indexing="ij")
        return (h * head_dim + 2 * i + e).reshape(-1)

    def _unpermute(self, name: str, values: torch.Tensor) -> torch.Tensor:
        order = self._row_order(name, values.shape[0]) if values.dim() == 2 else None
        return values if order is None else values[order]
