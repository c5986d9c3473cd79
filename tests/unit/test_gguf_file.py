"""models/gguf_file.py reads what gguf's own GGUFReader reads (every tensor's name, type, shape and bytes; every
scalar field), on the bundled model and on a file with metadata of every value type, nested arrays included; a
broken file is a ValueError naming it, never a crash or a silent wrong tensor."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from lmrpc.server.models.gguf_file import GGUFFile


def same_as_gguf(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type
        assert mine.shape == tuple(int(d) for d in t.shape)
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert np.array_equal(mine.data.view(np.uint8), np.asarray(t.data).view(np.uint8))
    for name, field in theirs.fields.items():
        kind = field.types[0] if field.types else None
        if kind in (gguf.GGUFValueType.ARRAY, None) or name.startswith("GGUF."):
            assert name not in ours.metadata
        else:
            assert ours.metadata[name] == field.contents(), name
    return ours


def test_the_bundled_model_reads_as_gguf_reads_it(smollm2_gguf: Path) -> None:
    ours = same_as_gguf(smollm2_gguf)
    assert ours.field_str("general.architecture") == "llama"
    assert ours.field_int("llama.block_count") == 30


def _written(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def every_value_type(tmp_path: Path) -> Path:
    path = tmp_path / "every.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_array("t.strings", ["a", "", "ünïcode", "x" * 1000])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_uint32("general.alignment", 64)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("vec", rng.standard_normal(9).astype(np.float32))
    return _written(w, path)


def test_every_value_type_and_tensor_kind_reads_as_gguf_reads_it(every_value_type: Path) -> None:
    ours = same_as_gguf(every_value_type)
    assert ours.metadata["t.str"] == "héllo" and ours.metadata["t.u64"] == 2**63 + 5
    assert "t.strings" not in ours.metadata and ours.field_int("general.alignment") == 64
    assert ours.tensors["q8"].data.shape == (4, 68)  # two Q8_0 blocks of 34 bytes per row


@pytest.mark.parametrize("cut", [3, 20, 200, -64])  # -64: past the last padding into the last tensor
def test_a_broken_file_is_a_value_error_naming_it(every_value_type: Path, tmp_path: Path, cut: int) -> None:
    data = every_value_type.read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"broken\.gguf"):
        GGUFFile(broken)


def test_not_a_gguf_file_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)


def test_a_released_tensor_still_reads_its_bytes(every_value_type: Path) -> None:
    """release() drops a packed tensor's pages from the resident set (madvise): the mapping stays, and reading the
    tensor again faults the same bytes back in from the file."""
    ours = GGUFFile(every_value_type)
    before = {name: t.data.copy() for name, t in ours.tensors.items()}
    for t in ours.tensors.values():
        ours.release(t)
    for name, t in ours.tensors.items():
        assert np.array_equal(t.data.view(np.uint8), before[name].view(np.uint8)), name


def _small(path: Path, *, tokens: list[str], weight_type: gguf.GGMLQuantizationType, seed: int,
           output: bool = False) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_uint32("llama.block_count", 1)
    weight = np.random.default_rng(seed).standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(weight, weight_type), raw_dtype=weight_type)
    if output:
        w.add_tensor("output.weight", weight)
    return _written(w, path)


def test_the_header_digest_covers_metadata_and_tensor_names_not_weights(tmp_path: Path) -> None:
    """What the loader keys a file's converted config and tokenizer on: one model's quantizations share it; another
    vocabulary (an array field), or another tensor (tied embeddings become untied), does not."""
    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    base = GGUFFile(_small(tmp_path / "a.gguf", tokens=["a", "b"], weight_type=q4, seed=0)).header_digest
    same = GGUFFile(_small(tmp_path / "b.gguf", tokens=["a", "b"], weight_type=q8, seed=1)).header_digest
    vocab = GGUFFile(_small(tmp_path / "c.gguf", tokens=["a", "c"], weight_type=q4, seed=0)).header_digest
    untied = GGUFFile(_small(tmp_path / "d.gguf", tokens=["a", "b"], weight_type=q4, seed=0, output=True)).header_digest
    assert base == same
    assert len({base, vocab, untied}) == 3
