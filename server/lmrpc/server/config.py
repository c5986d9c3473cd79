"""Frozen, self-validating configuration, one dataclass per layer. argparse lives only in __main__."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SamplingDefaultsSource = Literal["model", "openai"]
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how."""

    path: str | None = None  # local HF model directory or GGUF file; None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # one of DTYPES; auto: bfloat16 where matmuls run natively in it, else float32
    device: str = "auto"  # "auto": cuda if available, else cpu
    cache_dir: str | None = None  # converted-model cache; None: $LMRPC_CACHE or ~/.cache/lmrpc
    served_model_name: str | None = None  # name reported by GetModelInfo; None: derived from the path

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    page_size: int = 16  # tokens per page
    num_tokens: int | None = None  # pool capacity in tokens; None: derived from memory_fraction
    memory_fraction: float = 0.25  # share of free memory (device, or host RAM on CPU) given to the pool
    enable_prefix_cache: bool = True  # reuse pages of identical prompt prefixes

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.num_tokens is not None and self.num_tokens < self.page_size:
            raise ValueError("num_tokens must hold at least one page")
        if not 0.0 < self.memory_fraction <= 0.95:
            raise ValueError("memory_fraction must be in (0, 0.95]")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_running_requests: int = 64  # sequences holding pages at once
    max_batched_tokens: int = 512  # tokens computed per step (decodes + prefill chunks)
    max_prefill_chunk: int = 512  # longest prefill chunk of one sequence per step

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_batched_tokens < 1 or self.max_prefill_chunk < 1:
            raise ValueError("token budgets must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling_defaults: SamplingDefaultsSource = "model"  # where unset temperature/top_p/top_k/min_p/rep. come from
    enable_custom_logit_processor: bool = False  # allow requests to name a registered logit processor

    def __post_init__(self) -> None:
        if self.sampling_defaults not in ("model", "openai"):
            raise ValueError("sampling_defaults must be 'model' or 'openai'")


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC front."""

    host: str = "0.0.0.0"  # address to bind
    port: int = 50051  # 0 picks a free port
    max_queued_requests: int = 256  # outputs waiting beyond max_running_requests before RESOURCE_EXHAUSTED
    shutdown_grace: float = 30.0  # seconds in-flight streams get to finish on SIGTERM
    drain_delay: float = 1.0  # seconds between NOT_SERVING and refusing new calls (lets balancers notice)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.shutdown_grace < 0 or self.drain_delay < 0:
            raise ValueError("shutdown_grace and drain_delay must be >= 0")
