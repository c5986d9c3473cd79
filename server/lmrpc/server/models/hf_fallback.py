"""The generic fallback: any `transformers` AutoModelForCausalLM behind our CausalLM interface. Correct, slower.

Architectures without a native implementation in the registry land here. Instead of keys and values, the "KV
cache" stores each position's token id (one int64 per slot, `TokenSlots`): the scheduler, page tables, prefix cache
and preemption all work unchanged, and each step re-runs every scheduled sequence's whole context (read back from
its slots) through the HF model, keeping the logits of its new positions. Cost grows with context length squared,
which is why native implementations exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmrpc.kernels.paged import AttentionMetadata, ChunkSpec, QKNorm, build_metadata
from lmrpc.server.models import ForwardContext

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class TokenSlots:
    """The fallback's "KV cache": the token id at each slot (page * page_size + offset)."""

    dtype = torch.int64

    def __init__(self, num_pages: int, page_size: int, device: torch.device) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        self.tokens = torch.zeros(num_pages * page_size, dtype=torch.int64, device=device)  # [slots]

    def plan(self, chunks: Sequence[ChunkSpec], positions: torch.Tensor,
             rope_positions: torch.Tensor | None = None) -> AttentionMetadata:
        del positions  # contexts are re-run from position 0
        assert rope_positions is None, "M-RoPE positions come only from multimodal families, never served here"
        return build_metadata([(c.start, c.num_tokens, torch.tensor(c.pages, dtype=torch.int64)) for c in chunks],
                              self.page_size, self.device)

    def __call__(self, layer: int, qkv: torch.Tensor, plan: AttentionMetadata, qk_norm: QKNorm | None) -> torch.Tensor:
        raise NotImplementedError("the transformers fallback attends inside the HF model")

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        src, dst = src_page * self.page_size, dst_page * self.page_size
        self.tokens[dst : dst + num_tokens] = self.tokens[src : src + num_tokens]


class HFCausalLM:
    """Wraps an HF causal LM; `forward` returns logits where native models return hidden states."""

    accepts_embeddings = False  # its "KV cache" holds token ids, so a prompt must be token ids

    def __init__(self, model: PreTrainedModel, device: torch.device) -> None:
        self.hf = model
        self.device = device

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype, device: torch.device) -> HFCausalLM:
        # Imported here, not at the top: transformers' modeling modules take 2 s to import, at every server start,
        # and only a model without a native family needs them.
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": device})
        return cls(model.eval(), device)

    @property
    def kv_bytes_per_token(self) -> int:
        return 8  # one token id

    def make_attention(self, num_pages: int, page_size: int) -> TokenSlots:
        return TokenSlots(num_pages, page_size, self.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the transformers fallback takes token ids only")

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, input_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [T] -> logits [T', vocab] (the "hidden" rows `compute_logits` passes through)."""
        assert input_embeds is None, "the transformers fallback takes token ids only (accepts_embeddings)"
        slots = ctx.attention
        assert isinstance(slots, TokenSlots)
        meta: AttentionMetadata = ctx.plan
        slots.tokens.index_copy_(0, meta.slot_mapping, input_ids)
        pieces: list[torch.Tensor] = []
        if meta.num_decodes:
            assert meta.decode_slots is not None
            for row, length in zip(meta.decode_slots, meta.decode_lengths, strict=True):
                pieces.append(self._logits(slots.tokens[row[:length]], 1))
        for p in meta.prefills:
            pieces.append(self._logits(slots.tokens[p.slots], p.num_tokens))
        return torch.cat(pieces)

    __call__ = forward

    def _logits(self, context: torch.Tensor, num_new: int) -> torch.Tensor:
        """context [length] token ids -> logits of its last num_new positions [num_new, vocab]."""
        with torch.inference_mode():
            out = self.hf(input_ids=context[None], use_cache=False, logits_to_keep=num_new)
        return out.logits[0, -num_new:]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the transformers fallback's forward gives logits, not hidden states")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float()
