"""What SMG reads to register and route to this worker, from the engine's own figures: GetModelInfo (model id,
context window, EOS ids, the sampling defaults the gateway applies to fields a request leaves unset, the tokenizer
directory), GetServerInfo (the server arguments the gateway reads: max_running_requests, context_length, page_size)
and GetLoads (load.py's reading: running and waiting outputs, KV usage, generated tokens per second)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto import sglang_scheduler_pb2 as sgl

from lmrpc.server import validation
from lmrpc.server.config import EngineConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.load import Load
from lmrpc.server.models.types import ModelInfo

VERSION = "lmrpc"  # what GetLoads and GetServerInfo name as the engine's version
DEFAULT_MAX_NEW_TOKENS = 128  # validation.resolve_sampling's default when max_new_tokens is absent


def sampling_defaults(info: ModelInfo, config: EngineConfig) -> dict[str, float]:
    """The defaults lmrpc applies to unset temperature/top_p/top_k/min_p/repetition_penalty (--sampling-defaults)."""
    defaults = dict(validation.OPENAI_DEFAULTS)
    if config.sampling_defaults == "model":
        defaults.update(info.generation_defaults)
    return defaults


def model_info(info: ModelInfo, config: EngineConfig, tokenizer_path: str, bos_token_id: int | None,
               pad_token_id: int | None) -> sgl.GetModelInfoResponse:
    defaults = sampling_defaults(info, config)
    defaults["top_k"] = int(defaults["top_k"])
    return sgl.GetModelInfoResponse(
        model_path=info.path, tokenizer_path=tokenizer_path, is_generation=True,
        served_model_name=info.served_model_name, max_context_length=info.max_context_length,
        vocab_size=info.vocab_size, supports_vision=False, model_type=info.architecture,
        eos_token_ids=list(info.eos_token_ids), pad_token_id=pad_token_id if pad_token_id is not None else 0,
        bos_token_id=bos_token_id if bos_token_id is not None else 0,
        max_req_input_len=max(info.max_context_length - 1, 1), architectures=[info.architecture],
        default_sampling_params_json=json.dumps(defaults, separators=(",", ":")),
    )


def server_info(info: ModelInfo, config: EngineConfig, active_requests: int, started: float,
                draining: bool) -> sgl.GetServerInfoResponse:
    pool_tokens = None if config.cache.num_tokens is None else config.cache.num_tokens
    args = Struct()
    args.update({
        "model_path": info.path, "served_model_name": info.served_model_name,
        "max_running_requests": config.scheduler.max_running_requests, "context_length": info.max_context_length,
        "page_size": config.cache.page_size, "chunked_prefill_size": config.scheduler.max_prefill_chunk,
        "max_prefill_tokens": config.scheduler.max_batched_tokens, "dtype": info.dtype, "device": info.device,
        "disable_radix_cache": not config.cache.enable_prefix_cache, "skip_tokenizer_init": True,
        "sampling_defaults": config.sampling_defaults,
    })
    pb = sgl.GetServerInfoResponse(
        server_args=args, active_requests=active_requests, is_paused=draining, uptime_seconds=time.time() - started,
        sglang_version=VERSION, server_type="grpc", max_total_num_tokens=pool_tokens or 0,
        last_receive_timestamp=time.time(),
    )
    pb.start_time.FromSeconds(int(started))
    return pb


def waiting_prompt_tokens(engine: AsyncEngine) -> int:
    """Tokens the waiting outputs must compute before their first token: their prompts (and, for a preempted one,
    its output so far). Prefix-cache hits are found only at admission, so this counts them too (an upper bound).
    Read from the event loop: a snapshot of the scheduler's list, as its paused count is."""
    inner = getattr(engine, "engine", None)  # (a test's stand-in engine has no scheduler)
    scheduler = getattr(inner, "scheduler", None)
    if scheduler is None:
        return 0
    return sum(seq.num_tokens - seq.num_computed_tokens for seq in list(scheduler.waiting))


def loads(load: Load, page_size: int, waiting_tokens: int) -> sgl.GetLoadsResponse:
    slots = load.max_running or 1
    one = sgl.SchedulerLoad(
        dp_rank=0, num_running_reqs=load.running, num_waiting_reqs=load.waiting,
        num_total_reqs=load.running + load.waiting, num_used_tokens=load.used_pages * page_size,
        max_total_num_tokens=load.num_pages * page_size, token_usage=load.kv_usage,
        gen_throughput=load.generation_tokens_per_second, utilization=max(load.kv_usage, load.running / slots),
        max_running_requests=load.max_running, num_waiting_uncached_tokens=waiting_tokens,
        queues=sgl.QueueMetrics(waiting=load.waiting, paused=load.paused),
    )
    return sgl.GetLoadsResponse(
        timestamp=datetime.now(timezone.utc).isoformat(), version=VERSION, dp_rank_count=1, loads=[one],
        aggregate=sgl.AggregateMetrics(
            total_running_reqs=load.running, total_waiting_reqs=load.waiting, total_reqs=load.running + load.waiting,
            avg_token_usage=load.kv_usage, avg_throughput=load.generation_tokens_per_second,
            avg_utilization=one.utilization),
    )
