"""A GGUF file's config built from its header (models/gguf_config.py) is the dict transformers' legacy reader builds,
for each architecture built there, and the converted config.json is the one AutoConfig's reading would write."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from transformers import AutoConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from lmrpc.server.models import loader
from lmrpc.server.models.gguf_config import RENAMED_ONLY, fast_config_dict


def legacy(path: Path) -> dict[str, object]:
    """The config dict AutoConfig reads from a file of these architectures (transformers' legacy GGUF reader)."""
    return dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])


def write_header(path: Path, arch: str, name: str = "tiny", output: bool = False, vocab_size: bool = False,
                 nested: bool = False) -> Path:
    """A GGUF of `arch` with the metadata transformers maps into a config and a 7-token vocabulary; its only tensors
    are an embedding (and an output head when `output`). `nested`: also a field holding arrays of arrays."""
    out = gguf.GGUFWriter(str(path), arch)
    out.add_name(name)
    if nested:
        out.add_array("tiny.nested", [[1, 2], [3]])
    out.add_block_count(3)
    out.add_context_length(2048)
    out.add_embedding_length(64)
    out.add_feed_forward_length(160)
    out.add_head_count(4)
    out.add_head_count_kv(2)
    out.add_rope_freq_base(50000.0)
    out.add_layer_norm_rms_eps(1e-6)
    out.add_rope_dimension_count(16)
    if vocab_size:
        out.add_vocab_size(9)
    out.add_tokenizer_model("gpt2")
    out.add_token_list(["a", "b", "c", "ab", "<s>", "</s>", "<unk>"])
    out.add_token_merges(["a b"])
    out.add_bos_token_id(4)
    out.add_eos_token_id(5)
    out.add_unk_token_id(6)
    out.add_tensor("token_embd.weight", np.zeros((7, 64), np.float32))
    if output:
        out.add_tensor("output.weight", np.zeros((7, 64), np.float32))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return path


@pytest.mark.parametrize("output", [False, True], ids=["tied", "own-head"])
@pytest.mark.parametrize("vocab_size", [False, True], ids=["vocab-from-tokens", "vocab-stated"])
@pytest.mark.parametrize("arch", sorted(RENAMED_ONLY))
def test_the_config_is_the_legacy_readers(tmp_path: Path, arch: str, output: bool, vocab_size: bool) -> None:
    path = write_header(tmp_path / "m.gguf", arch, output=output, vocab_size=vocab_size)
    got = fast_config_dict(path)
    assert got == legacy(path)
    assert got is not None and got["tie_word_embeddings"] is not output
    assert got["vocab_size"] == (9 if vocab_size else 7)


def test_the_bundled_models_converted_config_is_the_one_autoconfig_reads(smollm2_gguf: Path, tmp_path: Path) -> None:
    # config.json as the conversion writes it, and as it would be written from AutoConfig's reading of the file
    loader._gguf_metadata(smollm2_gguf, tmp_path / "fast")
    auto = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)  # the legacy reader: ~8 s
    auto.architectures = ["LlamaForCausalLM"]
    loader._save_config(auto, tmp_path / "auto")
    assert (tmp_path / "fast" / "config.json").read_bytes() == (tmp_path / "auto" / "config.json").read_bytes()
    assert json.loads((tmp_path / "fast" / "config.json").read_text())["num_hidden_layers"] == 30


@pytest.mark.parametrize(("arch", "name", "nested"), [("llama", "mistral", False), ("qwen2moe", "tiny", False),
                                                      ("gemma3", "tiny", False), ("llama", "tiny", True)])
def test_other_files_are_left_to_autoconfig(tmp_path: Path, arch: str, name: str, nested: bool) -> None:
    # a llama file named "mistral" is read as Mistral; qwen2moe and gemma3 have special cases in transformers' reader;
    # the newer reader refuses arrays of arrays (AutoConfig then answers, as before the header path)
    assert fast_config_dict(write_header(tmp_path / "m.gguf", arch, name=name, nested=nested)) is None
