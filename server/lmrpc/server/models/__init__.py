"""Model implementations, registered by the HF `architectures` name they serve."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from lmrpc.kernels.attention import AttentionFn, AttentionMetadata

class CausalLM(Protocol):
    """What the runner needs from a model implementation."""

    @property
    def kv_shape(self) -> tuple[int, int, int]: ...  # (layers, kv_heads, head_dim)

    @property
    def kv_dtype(self) -> torch.dtype: ...  # what the KV cache stores

    def parameters(self) -> object: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: torch.Tensor, attention: AttentionFn) -> torch.Tensor: ...  # [T] -> [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [N, hidden] -> [N, vocab] float32


ModelT = TypeVar("ModelT", bound=type[nn.Module])

# Filled by the @register decorators of the model modules when `load_registry` imports them.
REGISTRY: dict[str, type[nn.Module]] = {}


def register(*architectures: str) -> Callable[[ModelT], ModelT]:
    def wrap(cls: ModelT) -> ModelT:
        for name in architectures:
            REGISTRY[name] = cls
        return cls

    return wrap


def load_registry() -> dict[str, type[nn.Module]]:
    """Import every model module (registering it) and return the registry."""
    from lmrpc.server.models import llama  # noqa: F401  (registers on import)

    return REGISTRY
