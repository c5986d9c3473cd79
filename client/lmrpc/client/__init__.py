"""lmrpc.client: a typed Python client (sync and asyncio) and the `lmrpc` CLI for the lmrpc generation service.

    from lmrpc.client import Client
    with Client("localhost:50051") as client:
        for delta in client.generate("The capital of France is", sampling_params={"max_new_tokens": 16},
                                     stream=True):
            print(delta.text, end="", flush=True)
        answer = client.chat("What is the capital of France?", max_tokens=32, temperature=0)  # OpenAI's shapes
        print(answer.content)

Needs only grpcio, grpcio-status, grpcio-health-checking and protobuf (no torch).
"""

from __future__ import annotations

from lmrpc.client.channel import DEFAULT_TARGET, channel_options, tls
from lmrpc.client.client import AsyncClient, Client
from lmrpc.client.convert import SamplingParamsLike, response_format, sampling_params_to_pb
from lmrpc.client.errors import FieldViolation, LmrpcError
from lmrpc.client.lora_calls import LoraAdapter
from lmrpc.client.openai_convert import ChatParams, CompleteParams
from lmrpc.client.openai_results import (
    ChatChoice,
    ChatCompletion,
    ChatMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    Completion,
    CompletionChoice,
    CompletionFinishReason,
    CompletionLogprobs,
    CompletionUsage,
    FunctionCall,
    ToolCall,
    merge_chat,
    merge_completion,
)
from lmrpc.client.results import (
    Finish,
    FinishReason,
    GenerateDelta,
    GenerateResult,
    Load,
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
    "ChatChoice",
    "ChatCompletion",
    "ChatMessage",
    "ChatParams",
    "ChatTokenLogprob",
    "ChatTopLogprob",
    "Client",
    "CompleteParams",
    "Completion",
    "CompletionChoice",
    "CompletionFinishReason",
    "CompletionLogprobs",
    "CompletionUsage",
    "FieldViolation",
    "Finish",
    "FinishReason",
    "FunctionCall",
    "GenerateDelta",
    "GenerateResult",
    "LmrpcError",
    "Load",
    "LoraAdapter",
    "ModelInfo",
    "PositionLogprobs",
    "SamplingParamsLike",
    "ServingStatus",
    "TokenLogprob",
    "ToolCall",
    "Usage",
    "channel_options",
    "merge",
    "merge_chat",
    "merge_completion",
    "response_format",
    "sampling_params_to_pb",
    "tls",
]
