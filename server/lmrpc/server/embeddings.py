"""Prompts given as embeddings (GenerateRequest.input_embeds): the wire's rows -> the engine's `PromptEmbeddings`.

The engine reads the rows back as float32 in the executor (they replace the embedding lookup of their positions);
the prefix cache keys each position by a digest of its row's bytes (see `PromptEmbeddings.position_keys`)."""

from __future__ import annotations

import hashlib

import numpy as np

from lmrpc.server.engine.types import PromptEmbeddings

DIGEST_BYTES = 16  # blake2b-128 per row: collisions are out of reach for any cache size


def prompt_embeddings(rows: np.ndarray) -> PromptEmbeddings:
    """rows [positions, hidden] float32, already validated (finite, the model's width) -> PromptEmbeddings."""
    rows = np.ascontiguousarray(rows, dtype="<f4")  # [positions, hidden]
    data = rows.tobytes()
    width = rows.shape[1] * 4
    keys = tuple(
        hashlib.blake2b(data[i * width : (i + 1) * width], digest_size=DIGEST_BYTES).digest()
        for i in range(rows.shape[0])
    )
    return PromptEmbeddings(data=data, num_positions=rows.shape[0], hidden=rows.shape[1], position_keys=keys)
