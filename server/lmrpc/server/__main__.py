"""lmrpc-server: the command line (argparse lives only here)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import sys
from typing import NoReturn

import torch

from lmrpc.server.app import serve
from lmrpc.server.auth import ApiKeys
from lmrpc.server.config import (
    DTYPES,
    MIB,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    LoraConfig,
    MediaConfig,
    ModelConfig,
    RequestLimits,
    SchedulerConfig,
    ServerConfig,
    TransportConfig,
)
from lmrpc.server.engine.grammar_limits import (
    DEFAULT_MAX_GRAMMAR_BYTES,
    DEFAULT_MAX_GRAMMAR_DEPTH,
    DEFAULT_MAX_GRAMMAR_RULES,
    MAX_GRAMMAR_DEPTH_CEILING,
    MAX_GRAMMAR_RULES_CEILING,
    GrammarLimits,
)
from lmrpc.server.lora.errors import AdapterError
from lmrpc.server.memory import InsufficientMemoryError
from lmrpc.server.models.types import ModelLoadError
from lmrpc.server.openai.chat_template import compile_error
from lmrpc.server.telemetry import LOG_FORMATS, configure_logging
from lmrpc.server.transport import ListenError

EXIT_NO_MEMORY = 3  # the memory limit cannot hold the model and a minimal KV cache (2 is a flag error)
EXIT_BAD_MODEL = 4  # --model names no model, or one that cannot be served (models.types.ModelLoadError)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lmrpc-server", description="Serve an LLM over the lmrpc.v1 gRPC contract.")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one (default 50051)")
    p.add_argument("--model", default=None,
                   help="local HF model directory or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights dtype; auto (default): bfloat16 where it runs natively (CUDA, CPUs with "
                        "AVX512-BF16/AMX), else float32. bfloat16 elsewhere halves memory (float32 activations)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                   help="weight-only quantization of the linear layers (activations and the KV cache stay in "
                        "--dtype). auto (default): a GGUF file's own Q4_0/Q4_1/Q8_0 blocks as they are (the bundled "
                        "model: int4), else none; none: dense weights; int8: per-channel int8; int4: a GGUF file's "
                        "4-bit blocks, or groups of 32 quantized at load. Any choice keeps a request's output "
                        "independent of its batch; int8/int4 need the native CPU kernels")
    p.add_argument("--no-expand-codes", dest="expand_codes", action="store_false",
                   help="int8 weights (Q8_0 blocks, as the bundled model's output head; --quantization int8): do "
                        "not keep a bfloat16 copy of their codes for batched products (by default the first such "
                        "weights keep one, up to 128 MiB a model). Saves 2 bytes per copied weight (the bundled "
                        "model: 57 MB); batches of 8 rows or more then make the codes bf16 in registers on "
                        "every product. int4 weights keep no copy. Outputs are the same either way")
    p.add_argument("--int8-activations", action="store_true",
                   help="4-bit weights (int4, Q4_0/Q4_1/Q4_K blocks): products take int8 activations (each row's "
                        "inputs quantized per group of 32, one scale, summed exactly against the 4-bit codes; the "
                        "MLP's down projection keeps its float inputs), with bfloat16 compute on CPUs with "
                        "AVX512-VNNI or float32 compute on AVX2 CPUs: products 1.4-2x faster at any batch size, "
                        "but less precise: the bundled 135M model's greedy answer to 'What is the capital of "
                        "France?' no longer names Paris. Outputs stay independent of the batch")
    p.add_argument("--no-int16-activations", dest="int16_activations", action="store_false",
                   help="--dtype auto on AVX2 CPUs without AVX512-BF16 (float32 compute): keep the block weights' "
                        "products' inputs exact float32. By default they enter as int16 per group of 32 inputs (one "
                        "scale, error at most 1/65534 of the group's largest input: finer than the bfloat16 rounding "
                        "auto means on AVX512 hosts), summed exactly against the codes: one-row products 1.4-1.7x "
                        "faster. An explicit --dtype float32 keeps float32 inputs too. Outputs stay independent of "
                        "the batch either way")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available)")
    p.add_argument("--cuda-graph-max-batch", type=int, default=None,
                   help="CUDA: decode steps of up to this many sequences replay CUDA graphs captured at start "
                        "(default: --max-running-requests; 0: no graphs). Ignored on CPU")
    p.add_argument("--sampling-defaults", choices=("model", "openai"), default="model",
                   help="unset temperature/top_p/top_k/min_p/repetition_penalty come from the model's "
                        "generation_config.json (model) or the OpenAI constants (openai)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="Jinja chat template for ChatComplete, replacing the model's (needed for a model without one)")
    p.add_argument("--enable-custom-logit-processor", action="store_true",
                   help="let requests name a server-registered logit processor (e.g. disallowed_tokens)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="let requests ask for the experts each position was routed to (mixture-of-experts models)")
    p.add_argument("--max-running-requests", type=int, default=64, help="outputs decoded at once (64)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="outputs waiting beyond the running ones before RESOURCE_EXHAUSTED (256)")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="tokens computed per engine step (default: sized to the model, 512 for SmolLM2-135M down to "
                        "128 from ~1B parameters on a CPU; 512 on a GPU)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page (16)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV-cache capacity in tokens (default: a share of free memory)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight streams get to finish after SIGTERM (30)")
    p.add_argument("--drain-delay", type=float, default=1.0,
                   help="seconds between reporting NOT_SERVING and refusing new calls (1)")
    p.add_argument("--log-level", default="INFO", help="logging level (INFO)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="log lines as text or one JSON object each; either way, every finished output gets a "
                        "line on logger lmrpc.server.requests (tokens, timings, finish reason, gRPC status) (text)")
    p.add_argument("--sglang-worker", action=argparse.BooleanOptionalAction, default=True,
                   help="serve SMG's worker service (sglang.grpc.scheduler.SglangScheduler) beside lmrpc.v1 on the "
                        "same port, so the SGLang model gateway can route to this server: smg launch --worker-urls "
                        "grpc://HOST:PORT (default: on)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics; 0 picks a free port (default: off). "
                        "Traces: set the standard OTEL_* variables (e.g. OTEL_EXPORTER_OTLP_ENDPOINT)")
    _add_transport_flags(p)
    _add_hardening_flags(p)
    _add_lora_flags(p)
    _add_media_flags(p)
    _add_limit_flags(p)
    return p.parse_args(argv)


def _lora_module(text: str) -> tuple[str, str]:
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters", "PEFT adapters of the served model, mixed in one batch")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                   help="adapters loaded at start (a directory with adapter_config.json and "
                        "adapter_model.safetensors), named for requests' lora_path or model \"base:NAME\"; pinned: "
                        "never evicted (they count towards --max-loaded-loras)")
    g.add_argument("--max-lora-rank", type=int, default=64, metavar="R", help="largest adapter rank accepted (64)")
    g.add_argument("--max-loras-per-batch", type=int, default=8, metavar="N",
                   help="distinct adapters running at once; outputs of others wait, in arrival order (8)")
    g.add_argument("--max-loaded-loras", type=int, default=16, metavar="N",
                   help="adapters held in memory, never more; loading another evicts the least recently used one "
                        "not in use and not pinned. When none may be evicted, a request naming a new adapter waits "
                        "for a call to end; LoadLoraAdapter fails RESOURCE_EXHAUSTED (16)")
    g.add_argument("--lora-root", metavar="DIR",
                   help="requests and LoadLoraAdapter may load adapters by path from under DIR only (default: no "
                        "loading by path)")
    g.add_argument("--enable-lora-admin", action="store_true",
                   help="serve LoadLoraAdapter and UnloadLoraAdapter (ListLoraAdapters is always served)")


def _add_media_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("media", "images and audio in prompts (multimodal models): sources and limits")
    m.add_argument("--allowed-media-domains", nargs="*", metavar="HOST", default=None,
                   help="http(s) media URLs may name only these hosts (exact; redirects re-checked); given with no "
                        "host, no URL is fetched (default: any host)")
    m.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="file:// URLs and plain paths are read from under DIR only, symlinks and .. resolved; "
                        "elsewhere PERMISSION_DENIED (default: no local files)")
    m.add_argument("--media-fetch-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="one URL fetch, redirects included; slower is UNAVAILABLE (10)")
    m.add_argument("--max-media-bytes", type=int, default=20 * MIB, metavar="BYTES",
                   help="encoded size of one item (bytes, data: URI, download or file); a fetch stops reading past "
                        "it (20 MiB)")
    m.add_argument("--max-image-pixels", type=int, default=4096 * 4096, metavar="N",
                   help="width x height of one image, checked before it is decoded (16777216: 4096 x 4096)")
    m.add_argument("--max-audio-seconds", type=float, default=600.0, metavar="SECONDS",
                   help="length of one audio clip, checked before it is decoded (600)")
    m.add_argument("--max-media-items", type=int, default=16, metavar="N",
                   help="images and audio clips of one prompt together (16)")


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("request limits", "what one request may ask for, refused (INVALID_ARGUMENT) before any "
                                               "work; GetModelInfo reports them")
    g.add_argument("--max-logit-bias", type=int, default=4096, metavar="N",
                   help="logit_bias entries of one sampling params (4096)")
    g.add_argument("--max-stop", type=int, default=1024, metavar="N",
                   help="stop strings, stop regexes and stop token ids of one sampling params, each (1024)")
    g.add_argument("--max-stop-chars", type=int, default=1024, metavar="N",
                   help="characters of one stop string or stop regex (1024)")
    g.add_argument("--max-logprob-token-ids", type=int, default=256, metavar="N",
                   help="token_ids_logprob entries of one request (256)")
    g.add_argument("--max-grammar-bytes", type=int, default=DEFAULT_MAX_GRAMMAR_BYTES, metavar="BYTES",
                   help="bytes of one structured-output constraint: json_schema, regex, ebnf, structural_tag "
                        f"({DEFAULT_MAX_GRAMMAR_BYTES})")
    g.add_argument("--max-grammar-depth", type=int, default=DEFAULT_MAX_GRAMMAR_DEPTH, metavar="N",
                   help="nesting of a constraint: JSON arrays and objects, grammar groups "
                        f"({DEFAULT_MAX_GRAMMAR_DEPTH}; at most {MAX_GRAMMAR_DEPTH_CEILING})")
    g.add_argument("--max-grammar-rules", type=int, default=DEFAULT_MAX_GRAMMAR_RULES, metavar="N",
                   help="rules of an EBNF grammar, or distinct $ref targets of a JSON schema "
                        f"({DEFAULT_MAX_GRAMMAR_RULES}; at most {MAX_GRAMMAR_RULES_CEILING})")


def _add_hardening_flags(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("access, fairness and robustness")
    h.add_argument("--api-key-file", metavar="FILE",
                   help="require 'authorization: Bearer KEY' metadata on GenerateService and OpenAIService calls, KEY "
                        "one of the file's lines ('#' comments, blank lines skipped); health and reflection stay open "
                        "(default: no authentication)")
    h.add_argument("--max-queued-per-client", type=int, metavar="N",
                   help="outputs one client (API key, else peer address) may have waiting while every running slot "
                        "is taken; more get RESOURCE_EXHAUSTED with RetryInfo (default: no per-client cap)")
    h.add_argument("--max-buffered-outputs", type=int, default=64, metavar="N",
                   help="deltas of one output its client has not read before the output stops being scheduled (its "
                        "KV pages kept); it resumes when the client has read half (64)")
    h.add_argument("--stalled-stream-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a streamed message the client does not read for this long ends the call RESOURCE_EXHAUSTED "
                        "and aborts its outputs (30)")
    h.add_argument("--engine-stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="an engine making no progress this long with work pending is reported NOT_SERVING and its "
                        "calls end UNAVAILABLE; liveness fails at 3x, or at once if the engine thread dies (60)")


def _add_transport_flags(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("transport", "TLS, keepalive, connection lifetime and message size")
    t.add_argument("--tls-cert", metavar="PEM", help="server certificate (chain); with --tls-key, serve TLS only")
    t.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    t.add_argument("--tls-client-ca", metavar="PEM",
                   help="mutual TLS: require client certificates signed by this CA (needs --tls-cert/--tls-key)")
    t.add_argument("--keepalive-time", type=float, metavar="SECONDS",
                   help="ping a connection after this long without activity (default: gRPC's 2 hours)")
    t.add_argument("--keepalive-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="close a connection whose ping is not acknowledged within this (20)")
    t.add_argument("--max-connection-age", type=float, metavar="SECONDS",
                   help="send GOAWAY to connections older than this, so long-lived HTTP/2 connections "
                        "reconnect and rebalance across replicas (default: never)")
    t.add_argument("--max-connection-age-grace", type=float, metavar="SECONDS",
                   help="after that GOAWAY, in-flight calls get this long before being cut (default: unlimited)")
    t.add_argument("--max-message-size", type=int, metavar="BYTES",
                   help="largest message received or sent; bigger ones fail with RESOURCE_EXHAUSTED "
                        "(default: gRPC's 4 MiB receive, unlimited send)")


# Config fields whose flag is not their name spelled with dashes.
_FLAG_OF_FIELD = {"num_tokens": "--kv-cache-tokens", "max_prefill_chunk": "--max-batched-tokens"}


def _flag_error(error: ValueError, *configs: type) -> NoReturn:
    """Exit 2 with a config's message, its field names spelled as the flags the user typed (tls_cert -> --tls-cert)."""
    names = "|".join(f.name for config in configs for f in dataclasses.fields(config))
    message = re.sub(rf"\b({names})\b",
                     lambda m: _FLAG_OF_FIELD.get(m.group(1), "--" + m.group(1).replace("_", "-")), str(error))
    print(f"lmrpc-server: error: {message}", file=sys.stderr)
    sys.exit(2)


def transport_config(args: argparse.Namespace) -> TransportConfig:
    """The transport flags as a TransportConfig; a bad combination or an unreadable PEM exits 2 with the reason."""
    try:
        return TransportConfig(
            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
            keepalive_time=args.keepalive_time, keepalive_timeout=args.keepalive_timeout,
            max_connection_age=args.max_connection_age, max_connection_age_grace=args.max_connection_age_grace,
            max_message_size=args.max_message_size,
        )
    except ValueError as e:
        _flag_error(e, TransportConfig)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine flags as an EngineConfig; a value out of range exits 2 naming the flag."""
    try:
        return EngineConfig(
            model=ModelConfig(path=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
                              expand_codes=args.expand_codes, int8_activations=args.int8_activations,
                              int16_activations=args.int16_activations),
            cache=CacheConfig(page_size=args.page_size, num_tokens=args.kv_cache_tokens),
            scheduler=SchedulerConfig(max_running_requests=args.max_running_requests,
                                      max_batched_tokens=args.max_batched_tokens,
                                      max_prefill_chunk=args.max_batched_tokens),
            sampling_defaults=args.sampling_defaults,
            enable_custom_logit_processor=args.enable_custom_logit_processor,
            enable_return_routed_experts=args.enable_return_routed_experts,
            cuda_graph_max_batch=args.cuda_graph_max_batch,
            max_buffered_outputs=args.max_buffered_outputs,
            lora=LoraConfig(lora_modules=tuple(args.lora_modules), max_lora_rank=args.max_lora_rank,
                            max_loras_per_batch=args.max_loras_per_batch, max_loaded_loras=args.max_loaded_loras,
                            lora_root=args.lora_root, enable_lora_admin=args.enable_lora_admin),
            grammar=GrammarLimits(max_grammar_bytes=args.max_grammar_bytes, max_grammar_depth=args.max_grammar_depth,
                                  max_grammar_rules=args.max_grammar_rules),
        )
    except ValueError as e:
        _flag_error(e, ModelConfig, CacheConfig, SchedulerConfig, EngineConfig, LoraConfig, GrammarLimits)


def _check_device(device: str) -> None:
    """--device cuda on a machine (or a torch build) without CUDA: a flag error, not a failed assertion in torch."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"lmrpc-server: error: --device {device}: no CUDA device here (torch {torch.__version__}: "
              f"torch.cuda.is_available() is False); use --device cpu or auto", file=sys.stderr)
        sys.exit(2)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server flags as a ServerConfig; a value out of range or an unusable --api-key-file exits 2."""
    try:
        keys = ApiKeys.read(args.api_key_file) if args.api_key_file is not None else None
        return ServerConfig(host=args.host, port=args.port, max_queued_requests=args.max_queued_requests,
                            shutdown_grace=args.shutdown_grace, drain_delay=args.drain_delay,
                            transport=transport_config(args), metrics_port=args.metrics_port,
                            chat_template=read_chat_template(args.chat_template), api_keys=keys,
                            stalled_stream_timeout=args.stalled_stream_timeout,
                            max_queued_per_client=args.max_queued_per_client,
                            engine_stall_timeout=args.engine_stall_timeout, media=media_config(args),
                            sglang_worker=args.sglang_worker,
                            limits=RequestLimits(max_logit_bias=args.max_logit_bias, max_stop=args.max_stop,
                                                 max_stop_chars=args.max_stop_chars,
                                                 max_logprob_token_ids=args.max_logprob_token_ids))
    except ValueError as e:
        _flag_error(ValueError(str(e).replace("api_key_file", "--api-key-file")), ServerConfig, RequestLimits)


def media_config(args: argparse.Namespace) -> MediaConfig:
    """The media flags as a MediaConfig; a value out of range exits 2 naming the flag."""
    try:
        return MediaConfig(
            allowed_media_domains=None if args.allowed_media_domains is None else tuple(args.allowed_media_domains),
            allowed_local_media_path=args.allowed_local_media_path, media_fetch_timeout=args.media_fetch_timeout,
            max_media_bytes=args.max_media_bytes, max_image_pixels=args.max_image_pixels,
            max_audio_seconds=args.max_audio_seconds, max_media_items=args.max_media_items,
        )
    except ValueError as e:
        _flag_error(e, MediaConfig)


def read_chat_template(path: str | None) -> str | None:
    """--chat-template's text; an unreadable or empty file exits 2 with the reason."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        print(f"lmrpc-server: error: --chat-template: cannot read {path!r}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if not text.strip():
        print(f"lmrpc-server: error: --chat-template: {path!r} is empty", file=sys.stderr)
        raise SystemExit(2)
    error = compile_error(text)
    if error is not None:
        print(f"lmrpc-server: error: --chat-template: {path!r} is no valid template: {error}", file=sys.stderr)
        raise SystemExit(2)
    return text


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    engine = engine_config(args)
    _check_device(engine.model.device)
    server = server_config(args)
    try:
        asyncio.run(serve(engine, server))
    except InsufficientMemoryError as e:
        # Said plainly and at once, rather than loading on until the kernel's OOM killer ends the process unexplained.
        print(f"lmrpc-server: error: not enough memory: {e}", file=sys.stderr)
        raise SystemExit(EXIT_NO_MEMORY) from None
    except ListenError as e:
        print(f"lmrpc-server: error: {e}", file=sys.stderr)
        sys.exit(2)
    except AdapterError as e:  # only --lora-modules' adapters load before serving: requests' errors never get here
        print(f"lmrpc-server: error: --lora-modules: {e}", file=sys.stderr)
        sys.exit(2)
    except ModelLoadError as e:
        # The user's file (or path) is at fault: the message says which and what; a traceback would bury it.
        model = str(args.model) if args.model else "the default model"
        print(f"lmrpc-server: error: cannot serve {model}: {str(e).removeprefix(model + ': ')}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_MODEL) from None


if __name__ == "__main__":
    main()
