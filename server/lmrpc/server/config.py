"""Frozen, self-validating configuration, one dataclass per layer. argparse lives only in __main__."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from lmrpc.server.engine.grammar_limits import GrammarLimits
from lmrpc.server.lora.errors import NAME_RULE, valid_name
from lmrpc.server.userinput import clip

if TYPE_CHECKING:
    from lmrpc.server.auth import ApiKeys

SamplingDefaultsSource = Literal["model", "openai"]
DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how."""

    path: str | None = None  # local HF model directory or GGUF file; None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # one of DTYPES; auto: bfloat16 where matmuls run natively in it, else float32
    device: str = "auto"  # "auto": cuda if available, else cpu
    cache_dir: str | None = None  # converted-model cache; None: $LMRPC_CACHE or ~/.cache/lmrpc
    served_model_name: str | None = None  # name reported by GetModelInfo; None: derived from the path
    # weight-only quantization of the linear layers, one of QUANTIZATIONS; auto: a GGUF file's own formats where a
    # kernel exists (the bundled model: its Q4_1 blocks), else none (see models/quantized.py)
    quantization: str = "auto"
    # int8 (Q8) weights also keep their codes expanded to bfloat16 (2 bytes per weight more), up to 128 MiB a model
    # (models/quantized.py: EXPANDED_CODES_BUDGET): products over more than two rows read those instead of making
    # the codes bf16 on every call (int4 weights expand theirs in registers, which is faster than reading such a
    # copy). The same results either way.
    expand_codes: bool = True
    # 4-bit weights, with bfloat16 compute on CPUs with AVX512-VNNI or float32 compute on AVX2 CPUs: activations
    # enter the products as int8 (per row and group of 32 inputs, one scale), each group summed exactly in integers:
    # 1.4-2x faster products, every row count alike (route-invariant), but less precise (off by default:
    # SmolLM2-135M's greedy chat answers degrade).
    int8_activations: bool = False
    # dtype auto on AVX2 CPUs (no AVX512-BF16, so float32 compute): block weights' products take int16 activations
    # (per row and group of 32 inputs, d = max|x| / 32767), summed exactly against the codes in integers. Each input
    # moves by at most max|x| / 65534, less than the bfloat16 rounding that auto means on AVX512 hosts moves all but a
    # group's smallest inputs; one-row products 1.4-1.7x faster (kernels/csrc/linear_int16.cpp). An explicit float32
    # dtype, or False here, keeps exact float32 inputs.
    int16_activations: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")


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
    # tokens computed per step (decodes + prefill chunks); None: sized to the model once it is loaded
    # (engine/step_budget.py)
    max_batched_tokens: int | None = None
    max_prefill_chunk: int | None = None  # longest prefill chunk of one sequence per step; None: max_batched_tokens

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if any(b is not None and b < 1 for b in (self.max_batched_tokens, self.max_prefill_chunk)):
            raise ValueError("token budgets must be >= 1")

    def with_budget(self, tokens: int) -> SchedulerConfig:
        """These limits with an unset step budget set to `tokens`, and an unset chunk limit to the step budget."""
        batched = tokens if self.max_batched_tokens is None else self.max_batched_tokens
        chunk = batched if self.max_prefill_chunk is None else self.max_prefill_chunk
        return replace(self, max_batched_tokens=batched, max_prefill_chunk=chunk)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (server/lmrpc/server/lora/). Field names are the flags' (--lora-modules, ...)."""

    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, directory) of adapters loaded at start, pinned
    max_lora_rank: int = 64  # largest adapter rank accepted; range [1, 1024]
    max_loras_per_batch: int = 8  # distinct adapters among the running outputs (one step's rows); range >= 1
    max_loaded_loras: int = 16  # adapters held, never more (lora/registry.py: eviction, pins, waits); range >= 1
    lora_root: str | None = None  # directory requests and LoadLoraAdapter may load adapters from; None: no loading
    #   by path
    enable_lora_admin: bool = False  # LoadLoraAdapter and UnloadLoraAdapter are served (ListLoraAdapters always is)

    def __post_init__(self) -> None:
        if not 1 <= self.max_lora_rank <= 1024:
            raise ValueError(f"max_lora_rank must be in [1, 1024], got {self.max_lora_rank}")
        if self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_loaded_loras < 1:
            raise ValueError(f"max_loaded_loras must be >= 1, got {self.max_loaded_loras}")
        names = [name for name, _ in self.lora_modules]
        bad = [name for name in names if not valid_name(name)]
        if bad:
            raise ValueError(f"lora_modules names must be {NAME_RULE}, got {clip(repr(bad[0]))}")
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be distinct, got {clip(repr(names))}")
        if len(names) > self.max_loaded_loras:
            raise ValueError(f"{len(names)} lora_modules exceed max_loaded_loras {self.max_loaded_loras}")
        if self.lora_root is not None and not os.path.isdir(self.lora_root):
            raise ValueError(f"lora_root {self.lora_root!r} is not a directory")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling_defaults: SamplingDefaultsSource = "model"  # where unset temperature/top_p/top_k/min_p/rep. come from
    enable_custom_logit_processor: bool = False  # allow requests to name a registered logit processor
    # allow requests to ask for the experts each position was routed to (MoE models): the routing is recorded
    # every step it is asked for, and a request asking for it computes its positions from routed_experts_start_len
    enable_return_routed_experts: bool = False
    # CUDA: decode steps of up to this many sequences replay CUDA graphs captured at warm-up; None: up to
    # scheduler.max_running_requests; 0: no graphs. Ignored on CPU.
    cuda_graph_max_batch: int | None = None
    # Backpressure: deltas of one output its client has not read before the output stops being scheduled (it
    # resumes when the client has read half of them).
    max_buffered_outputs: int = 64
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # structured-output constraints' size and depth

    def __post_init__(self) -> None:
        if self.sampling_defaults not in ("model", "openai"):
            raise ValueError("sampling_defaults must be 'model' or 'openai'")
        if not 2 <= self.max_buffered_outputs <= 1_000_000:
            raise ValueError(f"max_buffered_outputs must be in [2, 1000000], got {self.max_buffered_outputs}")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 0:
            raise ValueError("cuda_graph_max_batch must be >= 0")


# gRPC channel arguments are C ints: durations in ms and sizes in bytes must stay below 2**31.
_MAX_GRPC_INT = 2**31 - 1


def _check_pem(name: str, path: str) -> None:
    """Fail at startup with the file's name rather than at the first handshake with an opaque SSL error."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
    except OSError as e:
        raise ValueError(f"{name}: cannot read {path!r}: {e.strerror or e}") from None
    if b"-----BEGIN " not in head:
        raise ValueError(f"{name}: {path!r} is not a PEM file")


@dataclass(frozen=True)
class TransportConfig:
    """TLS, keepalive, connection age and message limits of the listening socket (mapped in transport.py)."""

    tls_cert: str | None = None  # PEM server certificate (chain); with tls_key, the port speaks TLS only
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA bundle: mutual TLS, clients must present a certificate it signed
    keepalive_time: float | None = None  # seconds between the server's pings on a quiet connection; None: 2 h
    keepalive_timeout: float = 20.0  # seconds to wait for a ping's ack before closing the connection
    max_connection_age: float | None = None  # seconds before GOAWAY, so clients reconnect (and rebalance)
    max_connection_age_grace: float | None = None  # seconds in-flight calls get after that GOAWAY; None: no limit
    max_message_size: int | None = None  # bytes, each message sent and received; None: gRPC's (4 MiB receive)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None:
                _check_pem(name, path)
        for name in ("keepalive_time", "keepalive_timeout", "max_connection_age"):
            seconds = getattr(self, name)
            if seconds is not None and not 0.001 <= seconds <= _MAX_GRPC_INT / 1000:
                raise ValueError(f"{name} must be in [0.001, {_MAX_GRPC_INT // 1000}] seconds, got {seconds}")
        if self.max_connection_age_grace is not None:
            if self.max_connection_age is None:
                raise ValueError("max_connection_age_grace needs max_connection_age")
            if not 0 <= self.max_connection_age_grace <= _MAX_GRPC_INT / 1000:
                raise ValueError(f"max_connection_age_grace must be in [0, {_MAX_GRPC_INT // 1000}] seconds")
        if self.max_message_size is not None and not 1 <= self.max_message_size <= _MAX_GRPC_INT:
            raise ValueError(f"max_message_size must be in [1, {_MAX_GRPC_INT}] bytes, got {self.max_message_size}")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


MIB = 1 << 20


@dataclass(frozen=True)
class MediaConfig:
    """Where media items may come from and how large they may be (server/lmrpc/server/media/). Field names are the
    flags' (--allowed-media-domains, ...)."""

    # Hosts http(s) URLs may name (exact, case-insensitive; redirects are re-checked); None: any host, as vLLM
    # without the flag. An empty tuple: no URL at all.
    allowed_media_domains: tuple[str, ...] | None = None
    # file:// URLs and plain paths are read only from under this directory (symlinks and .. resolved first);
    # None: never read local files.
    allowed_local_media_path: str | None = None
    media_fetch_timeout: float = 10.0  # seconds one URL fetch may take in all (redirects included); (0, 3600]
    max_media_bytes: int = 20 * MIB  # encoded bytes of one item, however it came; [1, 2**31 - 1]
    max_image_pixels: int = 4096 * 4096  # width x height of one decoded image; [1, 2**31 - 1]
    max_audio_seconds: float = 600.0  # length of one decoded audio clip; (0, 86400]
    max_media_items: int = 16  # images and audio clips of one prompt together; [1, 1024]

    def __post_init__(self) -> None:
        if self.allowed_media_domains is not None:
            bad = [d for d in self.allowed_media_domains if not d or "/" in d or ":" in d or d != d.strip()]
            if bad:
                raise ValueError(f"allowed_media_domains must be host names (no scheme, port or path), got {bad}")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a directory")
        if not 0 < self.media_fetch_timeout <= 3600:
            raise ValueError(f"media_fetch_timeout must be in (0, 3600] seconds, got {self.media_fetch_timeout}")
        if not 1 <= self.max_media_bytes <= _MAX_GRPC_INT:
            raise ValueError(f"max_media_bytes must be in [1, {_MAX_GRPC_INT}], got {self.max_media_bytes}")
        if not 1 <= self.max_image_pixels <= _MAX_GRPC_INT:
            raise ValueError(f"max_image_pixels must be in [1, {_MAX_GRPC_INT}], got {self.max_image_pixels}")
        if not 0 < self.max_audio_seconds <= 86400:
            raise ValueError(f"max_audio_seconds must be in (0, 86400], got {self.max_audio_seconds}")
        if not 1 <= self.max_media_items <= 1024:
            raise ValueError(f"max_media_items must be in [1, 1024], got {self.max_media_items}")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, checked from the request's own numbers before any work is done for it
    (validation.check_sizes) and published in GetModelInfo's limits. Field names are the flags' (--max-logit-bias,
    ...); docs/reliability.md says why each default is what it is."""

    max_logit_bias: int = 4096  # logit_bias entries of one sampling params; [1, 1048576]
    max_stop: int = 1024  # stop strings, stop regexes and stop token ids of one sampling params, each; [1, 1048576]
    max_stop_chars: int = 1024  # characters of one stop string or stop regex; [1, 1048576]
    max_logprob_token_ids: int = 256  # token_ids_logprob entries (each output position answers one per id); [1, 1M]

    def __post_init__(self) -> None:
        for name in ("max_logit_bias", "max_stop", "max_stop_chars", "max_logprob_token_ids"):
            value = getattr(self, name)
            if not 1 <= value <= 1 << 20:
                raise ValueError(f"{name} must be in [1, {1 << 20}], got {value}")


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC front."""

    host: str = "0.0.0.0"  # address to bind
    port: int = 50051  # 0 picks a free port
    max_queued_requests: int = 256  # outputs waiting beyond max_running_requests before RESOURCE_EXHAUSTED
    shutdown_grace: float = 30.0  # seconds in-flight streams get to finish on SIGTERM
    drain_delay: float = 1.0  # seconds between NOT_SERVING and refusing new calls (lets balancers notice)
    transport: TransportConfig = field(default_factory=TransportConfig)  # TLS, keepalive, limits
    metrics_port: int | None = None  # Prometheus /metrics over HTTP on host:metrics_port (0: a free one); None: off
    chat_template: str | None = None  # Jinja chat template text (--chat-template FILE); None: the tokenizer's
    api_keys: ApiKeys | None = None  # --api-key-file's keys (digests only); None: no authentication
    # Seconds a streamed message may wait for a client that reads nothing before the call ends RESOURCE_EXHAUSTED
    # and its outputs are aborted (their pages freed).
    stalled_stream_timeout: float = 30.0
    # Outputs one client (API key, else peer address) may have waiting while no running slot is free; None: no cap.
    max_queued_per_client: int | None = None
    # Seconds the engine may go without coming round its loop, with work pending, before it is declared stuck:
    # services report NOT_SERVING and calls in flight end UNAVAILABLE (liveness fails at 3x, or when it died).
    engine_stall_timeout: float = 60.0
    media: MediaConfig = field(default_factory=MediaConfig)  # media items' sources and limits
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask for
    # Serve SMG's worker service (sglang.grpc.scheduler.SglangScheduler) on the same port, so the SGLang model
    # gateway can route to this server (server/lmrpc/server/sglang/)
    sglang_worker: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be in [0, 65535]")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.shutdown_grace < 0 or self.drain_delay < 0:
            raise ValueError("shutdown_grace and drain_delay must be >= 0")
        if not 0.1 <= self.stalled_stream_timeout <= 86400:
            raise ValueError(
                f"stalled_stream_timeout must be in [0.1, 86400] seconds, got {self.stalled_stream_timeout}")
        if self.max_queued_per_client is not None and self.max_queued_per_client < 0:
            raise ValueError(f"max_queued_per_client must be >= 0, got {self.max_queued_per_client}")
        if not 1 <= self.engine_stall_timeout <= 86400:
            raise ValueError(f"engine_stall_timeout must be in [1, 86400] seconds, got {self.engine_stall_timeout}")
