"""A GGUF file's converted config and tokenizer (models/loader.py), read without their classes' modules: the values
transformers' Auto classes read, aliases included, and none of the modelling stack those modules import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase, Qwen3MoeConfig

from lmrpc.server.config import ModelConfig
from lmrpc.server.models import loader

TEXTS = ("Hello, world!", "  leading spaces and\ttabs\n", "naïve café — 東京 🚀", "<|im_start|>user\nhi<|im_end|>")

# What importing a model type's config module brings in (transformers 5): serving a GGUF natively needs none of it.
HEAVY = ("transformers.models.llama.configuration_llama", "torch.distributed.tensor", "accelerate", "sympy")


@pytest.fixture(scope="module")
def cache(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory holding the bundled GGUF's one-time conversion, made once for this module (it reads the
    file through transformers' Auto classes: ~18 s on a 2-core host)."""
    root = tmp_path_factory.mktemp("gguf-cache")
    converted(smollm2_gguf, root)
    return root


def converted(gguf: Path, cache: Path) -> Path:
    path, found = loader.resolve_model_path(ModelConfig(path=str(gguf), cache_dir=str(cache)))
    assert found == gguf
    return path


def test_the_plain_config_holds_what_the_auto_class_reads(smollm2_gguf: Path, cache: Path) -> None:
    path = converted(smollm2_gguf, cache)
    plain, auto = loader._read_config(path, smollm2_gguf), AutoConfig.from_pretrained(path)
    assert type(plain) is PretrainedConfig and type(auto) is not PretrainedConfig
    expected = auto.to_dict()
    # to_dict names the class's model_type ("" for the plain class); the attribute is the file's
    assert plain.model_type == expected.pop("model_type") == "llama"
    expected.pop("_name_or_path")
    expected.pop("use_cache")  # transformers 5's base class takes it out of the fields (nothing here reads it)
    got = plain.to_dict()
    assert {key: got.get(key, "missing") for key in expected} == expected
    assert plain.get_text_config() is plain


def test_the_plain_tokenizer_encodes_and_decodes_as_the_auto_class(smollm2_gguf: Path, cache: Path) -> None:
    path = converted(smollm2_gguf, cache)
    plain, auto = loader._read_tokenizer(path, smollm2_gguf), AutoTokenizer.from_pretrained(path)
    assert len(plain) == len(auto)
    assert (plain.eos_token_id, plain.bos_token_id, plain.pad_token_id) == (
        auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)
    for text in TEXTS:
        ids = auto(text)["input_ids"]
        assert plain(text)["input_ids"] == ids
        assert plain.decode(ids) == auto.decode(ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    assert (plain.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_the_converted_tokenizer_is_the_one_transformers_reads_from_the_file(
        smollm2_gguf: Path, cache: Path, smollm2_tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    # The conversion asks the generic class directly where AutoTokenizer would pick it (loader._gguf_tokenizer):
    # the files it wrote are the ones AutoTokenizer's reading of the GGUF saves, byte for byte.
    path = converted(smollm2_gguf, cache)
    smollm2_tokenizer.save_pretrained(tmp_path)
    saved = sorted(f.name for f in tmp_path.iterdir())
    assert "tokenizer.json" in saved
    for name in saved:
        assert (path / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_a_config_alias_is_written_under_both_names(tmp_path: Path) -> None:
    # Qwen3-MoE stores num_local_experts; the MoE model reads num_experts, an alias of the class's attribute_map
    config = Qwen3MoeConfig(num_experts=6, num_experts_per_tok=2, hidden_size=32, intermediate_size=64,
                            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config.architectures = ["Qwen3MoeForCausalLM"]
    loader._save_config(config, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_experts"] == 6
    plain = loader._read_config(tmp_path, tmp_path / "model.gguf")
    assert plain.num_experts == plain.num_local_experts == 6
    assert AutoConfig.from_pretrained(tmp_path).num_local_experts == 6  # the extra name changes nothing for it


def test_serving_a_gguf_imports_no_model_type_module(smollm2_gguf: Path, cache: Path) -> None:
    # The cache holds the conversion already: the one-time conversion reads the file through the Auto classes.
    code = f"""
import json, sys
from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig
from lmrpc.server.engine.async_engine import AsyncEngine
engine = AsyncEngine.start(EngineConfig(model=ModelConfig(path={str(smollm2_gguf)!r}, cache_dir={str(cache)!r}),
                                        cache=CacheConfig(num_tokens=256)))
print(json.dumps([name for name in {HEAVY!r} if name in sys.modules]))
engine.shutdown()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
