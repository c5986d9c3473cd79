"""The generic fallback: any `transformers` AutoModelForCausalLM behind our CausalLM interface. Correct, slower.

Architectures without a native implementation in the registry land here. Instead of keys and values, the "KV
cache" stores each position's token id (one int64 per slot): the scheduler, page tables, prefix cache and
preemption all work unchanged, and each step re-runs every scheduled sequence's whole context (read back from its
slots) through the HF model, keeping the logits of its new positions. Cost grows with context length squared,
which is why native implementations exist.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from lmrpc.kernels.attention import AttentionFn, AttentionMetadata


class HFCausalLM(nn.Module):
    """Wraps an HF causal LM; `forward` returns logits where native models return hidden states."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.hf = model

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype, device: torch.device) -> HFCausalLM:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": device})
        return cls(model.eval())

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return 1, 1, 1  # one value per slot: the token id

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.int64

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """input_ids, positions [T] -> logits [T, vocab] (the "hidden" rows `compute_logits` passes through)."""
        del positions, attention  # contexts are re-run from position 0; HF attends by itself
        tokens = kv_cache[0, 0, :, 0, 0]  # [slots] int64: the token id held by each slot
        tokens.index_copy_(0, meta.slot_mapping, input_ids)
        pieces: list[torch.Tensor] = []
        if meta.num_decodes:
            assert meta.decode_slots is not None
            for slots, length in zip(meta.decode_slots, meta.decode_lengths, strict=True):
                pieces.append(self._logits(tokens[slots[:length]], 1))
        for p in meta.prefills:
            pieces.append(self._logits(tokens[p.slots], p.num_tokens))
        return torch.cat(pieces)

    def _logits(self, context: torch.Tensor, num_new: int) -> torch.Tensor:
        """context [length] token ids -> logits of its last num_new positions [num_new, vocab]."""
        out = self.hf(input_ids=context[None], use_cache=False, logits_to_keep=num_new)
        return out.logits[0, -num_new:]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float()
