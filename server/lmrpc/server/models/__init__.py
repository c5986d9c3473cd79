"""Model implementations, registered by the HF `architectures` name they serve, and what the executor needs of
them (`CausalLM`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from lmrpc.kernels.paged import AttentionBackend


@dataclass(frozen=True)
class ForwardContext:
    """What one step's forward needs besides its tokens: the KV cache's backend and its plan for this step."""

    attention: AttentionBackend  # owns every layer's cache; runs a layer's attention
    plan: Any  # the backend's metadata for this step (AttentionBackend.plan)


class CausalLM(Protocol):
    """What the executor needs from a model implementation."""

    device: torch.device  # where it runs

    @property
    def kv_bytes_per_token(self) -> int: ...  # KV cache bytes one position costs (all layers)

    def make_attention(self, num_pages: int, page_size: int) -> AttentionBackend: ...  # its KV cache and backend

    # True when forward takes input_embeds (a prompt given as embeddings); the transformers fallback does not
    accepts_embeddings: bool

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...  # [T] -> [T, hidden] float32 embedding rows

    # [T] -> hidden [T, ...]; input_embeds [T, hidden] float32, when given, replaces the embedding lookup of input_ids
    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, input_embeds: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    # [N, ...] -> [N, hidden] float32: the final norm applied, the rows the output projection reads
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [N, ...] -> [N, vocab] float32


ModelT = TypeVar("ModelT", bound=type)

# Filled by the @register decorators of the model modules when `load_registry` imports them. Each class is built as
# cls(hf_config, weight_source, linear_builder).
REGISTRY: dict[str, type[Any]] = {}


def register(*architectures: str) -> Callable[[ModelT], ModelT]:
    def wrap(cls: ModelT) -> ModelT:
        for name in architectures:
            REGISTRY[name] = cls
        return cls

    return wrap


def load_registry(architecture: str | None = None) -> dict[str, type[Any]]:
    """Import the model modules (registering them) and return the registry: the text families always, the
    multimodal ones unless `architecture` is a text family's. Each multimodal module imports transformers' vision
    or audio modeling code (about 2 s together), which a text model's server start need not pay."""
    from lmrpc.server.models import llama, moe  # noqa: F401  (register on import)

    if architecture is None or architecture not in REGISTRY:
        from lmrpc.server.models.multimodal import llava, qwen2_audio, qwen2_vl  # noqa: F401  (register on import)

    return REGISTRY
