"""The tokenizer SMG runs for this worker: an HF-layout directory (tokenizer.json, tokenizer_config.json,
chat_template.jinja, generation_config.json) written once per model under lmrpc's cache, reported as GetModelInfo's
tokenizer_path (a gateway on the same host reads it there) and streamed as a zip by GetTokenizer (one elsewhere).

It is the engine's own tokenizer saved as it is (a GGUF model's was read from the GGUF file by transformers), with
the chat template the server renders (--chat-template's, else the model's) and a generation_config.json naming the
model's EOS ids and the sampling defaults the server applies, so that the gateway renders, stops and defaults as
lmrpc's own ChatComplete does.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHUNK_BYTES = 1 << 20  # GetTokenizer's chunk size (gRPC's default receive limit is 4 MiB)
MAX_ENTRIES = 50  # SMG refuses a bundle with more files


@dataclass(frozen=True)
class TokenizerBundle:
    """The directory and its zip."""

    path: Path  # the HF-layout directory
    zipped: bytes  # its files, as GetTokenizer streams them
    sha256: str  # hex digest of `zipped`, sent on the last chunk

    def chunks(self) -> Iterator[tuple[bytes, str]]:
        """(data, sha256 on the last chunk only)."""
        total = len(self.zipped)
        for start in range(0, max(total, 1), CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, total)
            yield self.zipped[start:end], self.sha256 if end == total else ""


def _generation_config(eos_token_ids: tuple[int, ...], defaults: Mapping[str, float],
                       bos_token_id: int | None) -> dict[str, object]:
    config: dict[str, object] = {"eos_token_id": list(eos_token_ids) if len(eos_token_ids) != 1
                                 else eos_token_ids[0]}
    if bos_token_id is not None:
        config["bos_token_id"] = bos_token_id
    config.update({k: (int(v) if k == "top_k" else v) for k, v in defaults.items()})
    return config


def write_bundle(root: Path, tokenizer: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...],
                 defaults: Mapping[str, float], chat_template: str | None) -> TokenizerBundle:
    """The tokenizer directory under `root` (written once: its name is a digest of what goes in, and it is written
    through a temporary directory, so a crash never leaves half of it), and its zip. Blocking: call it off the
    event loop."""
    generation = _generation_config(eos_token_ids, defaults, tokenizer.bos_token_id)
    template = chat_template if chat_template is not None else tokenizer.chat_template
    key = json.dumps([tokenizer.name_or_path, len(tokenizer), generation, template], sort_keys=True, default=str)
    target = root / f"sglang-tokenizer-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not (target / "tokenizer_config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=root))
        try:
            tokenizer.save_pretrained(tmp)
            if isinstance(template, str):
                (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            os.replace(tmp, target)
        except OSError:
            if not (target / "tokenizer_config.json").exists():  # not another process that finished first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    zipped = zip_directory(target)
    return TokenizerBundle(target, zipped, hashlib.sha256(zipped).hexdigest())


def zip_directory(path: Path) -> bytes:
    """The directory's files (not its subdirectories), deflated, in name order: the same bytes for the same files."""
    files = sorted(p for p in path.iterdir() if p.is_file())
    if len(files) > MAX_ENTRIES:
        raise ValueError(f"{path} holds {len(files)} files; a tokenizer bundle takes at most {MAX_ENTRIES}")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        for file in files:
            info = zipfile.ZipInfo(file.name, date_time=(1980, 1, 1, 0, 0, 0))  # fixed: a stable sha256
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, file.read_bytes())
    return buffer.getvalue()
