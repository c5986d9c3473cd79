"""lmrpc.client: a typed Python client (sync and asyncio) and the `lmrpc` CLI for the lmrpc generation service.

    from lmrpc.client import Client
    with Client("localhost:50051") as client:
        for delta in client.generate("The capital of France is", sampling_params={"max_new_tokens": 16},
                                     stream=True):
            print(delta.text, end="", flush=True)

Needs only grpcio, grpcio-status, grpcio-health-checking and protobuf (no torch).
"""

from __future__ import annotations

from lmrpc.client.client import DEFAULT_TARGET, AsyncClient, Client, channel_options, tls
from lmrpc.client.convert import SamplingParamsLike, response_format, sampling_params_to_pb
from lmrpc.client.errors import FieldViolation, LmrpcError
from lmrpc.client.results import (
    Finish,
    FinishReason,
    GenerateDelta,
    GenerateResult,
    ModelInfo,
    PositionLogprobs,
    ServingStatus,
    TokenLogprob,
    Usage,
    merge,
)

__all__ = [
    "DEFAULT_TARGET",
    "AsyncClient",
    "Client",
    "FieldViolation",
    "Finish",
    "FinishReason",
    "GenerateDelta",
    "GenerateResult",
    "LmrpcError",
    "ModelInfo",
    "PositionLogprobs",
    "SamplingParamsLike",
    "ServingStatus",
    "TokenLogprob",
    "Usage",
    "channel_options",
    "merge",
    "response_format",
    "sampling_params_to_pb",
    "tls",
]
