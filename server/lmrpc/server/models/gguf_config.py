"""A GGUF file's HF config dict, built from its header without transformers' legacy GGUF reader.

Asked for a llama, qwen2 or qwen3 GGUF file's config, transformers (5.x) goes through its legacy reader, which turns
every string of the vocabulary and the merge table into numpy views first: 9.3 s for a 1.7B file with a 49k-token
vocabulary on a 2-core host, the largest part of serving a new file's first start. Its newer header reader rebuilds
configs for a few other architectures only. For the architectures listed here, the legacy config is nothing but the
file's metadata renamed by transformers' own table (GGUF_CONFIG_MAPPING), its defaults table, tied embeddings when
the file has no output.weight, and the vocabulary's length where no vocab_size is stated: the same dict is built here
from the newer reader's output, with those tables. tests/unit/test_gguf_config.py holds the two equal for each
architecture listed and for the bundled model; any other file (or transformers 4) gets None and goes through
AutoConfig.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

# Architectures whose legacy config is renames alone (no special case in transformers' load_gguf_checkpoint)
RENAMED_ONLY = frozenset({"llama", "qwen2", "qwen3"})


def fast_config_dict(gguf: Path) -> dict[str, object] | None:
    """The config dict AutoConfig reads from this file, or None where it is not built here."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:  # transformers 4 has no newer reader
        return None
    try:
        # [key] = a scalar, a string, a list of numbers, or a string array's length (the reader skips its strings)
        metadata, tensor_names = read_gguf_metadata(str(gguf))
    except ValueError:  # a field this reader refuses (arrays of arrays): AutoConfig answers, as it always did
        return None
    architecture = metadata["general.architecture"]
    # transformers reads a llama file named exactly "mistral" as a Mistral model
    if architecture not in RENAMED_ONLY or metadata.get("general.name") == "mistral":
        return None
    config: dict[str, object] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, name = key.partition(".")
        renamed = cast(dict[str, object], GGUF_CONFIG_MAPPING.get(prefix, {})).get(name)
        if not isinstance(renamed, str):  # not mapped, or mapped to None / -1: transformers' "read, set nothing"
            continue
        if isinstance(value, list):  # the legacy reader unwraps one-element arrays: not a case worth mirroring
            return None
        config[renamed] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]
    return config
