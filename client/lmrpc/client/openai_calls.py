"""complete() and chat(): the OpenAIService methods of Client and AsyncClient (mixed into both).

Each returns the merged answer, or with stream=True an iterator of chunks (leaving it early cancels the call).
Keyword arguments are the request's fields in OpenAI's shapes (see openai_convert.CompleteParams/ChatParams).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import grpc
from grpc import aio

from lmrpc.client.errors import LmrpcError
from lmrpc.client.openai_convert import MessageLike, Prompt, build_chat_request, build_complete_request
from lmrpc.client.openai_results import ChatCompletion, Completion, merge_chat, merge_completion
from lmrpc.v1 import openai_pb2_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from lmrpc.client.openai_convert import ChatParams, CompleteParams

Metadata = Sequence[tuple[str, str]]
T = TypeVar("T")
CompletionStream = Generator[Completion, None, None]  # complete(stream=True); close() cancels the call
ChatStream = Generator[ChatCompletion, None, None]  # chat(stream=True)
AsyncCompletionStream = AsyncGenerator[Completion, None]
AsyncChatStream = AsyncGenerator[ChatCompletion, None]


class OpenAIMethods:
    """Client's complete() and chat(); needs `_openai` (a stub) and `_call_kwargs` from the client."""

    _openai: openai_pb2_grpc.OpenAIServiceStub

    def _call_kwargs(self, timeout: float | None, metadata: Metadata | None) -> dict[str, Any]:
        raise NotImplementedError  # provided by the client class

    @overload
    def complete(self, prompt: Prompt, *, stream: Literal[False] = ..., timeout: float | None = ...,
                 metadata: Metadata | None = ..., **params: Unpack[CompleteParams]) -> Completion: ...

    @overload
    def complete(self, prompt: Prompt, *, stream: Literal[True], timeout: float | None = ...,
                 metadata: Metadata | None = ..., **params: Unpack[CompleteParams]) -> CompletionStream: ...

    def complete(self, prompt: Prompt, *, stream: bool = False, timeout: float | None = None,
                 metadata: Metadata | None = None, **params: Unpack[CompleteParams]) -> Completion | CompletionStream:
        """Complete a prompt (a string, strings, token ids, or lists of token ids), OpenAI /v1/completions."""
        request = build_complete_request(prompt, params, stream)
        chunks = self._stream(self._openai.Complete(request, **self._call_kwargs(timeout, metadata)),
                              Completion.from_pb)
        return chunks if stream else merge_completion(chunks)

    @overload
    def chat(self, messages: str | Sequence[MessageLike], *, stream: Literal[False] = ...,
             timeout: float | None = ..., metadata: Metadata | None = ...,
             **params: Unpack[ChatParams]) -> ChatCompletion: ...

    @overload
    def chat(self, messages: str | Sequence[MessageLike], *, stream: Literal[True], timeout: float | None = ...,
             metadata: Metadata | None = ..., **params: Unpack[ChatParams]) -> ChatStream: ...

    def chat(self, messages: str | Sequence[MessageLike], *, stream: bool = False, timeout: float | None = None,
             metadata: Metadata | None = None, **params: Unpack[ChatParams]) -> ChatCompletion | ChatStream:
        """Answer a conversation (a string is one user message), OpenAI /v1/chat/completions."""
        request = build_chat_request(messages, params, stream)
        chunks = self._stream(self._openai.ChatComplete(request, **self._call_kwargs(timeout, metadata)),
                              ChatCompletion.from_pb)
        return chunks if stream else merge_chat(chunks)

    @staticmethod
    def _stream(call: Any, decode: Callable[[Any], T]) -> Generator[T, None, None]:
        try:
            for response in call:
                yield decode(response)
        except grpc.RpcError as e:
            raise LmrpcError.from_rpc_error(e) from None
        finally:
            call.cancel()  # a no-op once the stream ended; frees the server's work if the caller stopped early


class AsyncOpenAIMethods:
    """AsyncClient's complete() and chat() (coroutines; stream=True: `async for c in await client.chat(...)`)."""

    _openai: openai_pb2_grpc.OpenAIServiceAsyncStub

    def _call_kwargs(self, timeout: float | None, metadata: Metadata | None) -> dict[str, Any]:
        raise NotImplementedError  # provided by the client class

    @overload
    async def complete(self, prompt: Prompt, *, stream: Literal[False] = ..., timeout: float | None = ...,
                       metadata: Metadata | None = ..., **params: Unpack[CompleteParams]) -> Completion: ...

    @overload
    async def complete(self, prompt: Prompt, *, stream: Literal[True], timeout: float | None = ...,
                       metadata: Metadata | None = ...,
                       **params: Unpack[CompleteParams]) -> AsyncCompletionStream: ...

    async def complete(self, prompt: Prompt, *, stream: bool = False, timeout: float | None = None,
                       metadata: Metadata | None = None,
                       **params: Unpack[CompleteParams]) -> Completion | AsyncCompletionStream:
        request = build_complete_request(prompt, params, stream)
        chunks = self._stream(self._openai.Complete(request, **self._call_kwargs(timeout, metadata)),
                              Completion.from_pb)
        return chunks if stream else merge_completion([c async for c in chunks])

    @overload
    async def chat(self, messages: str | Sequence[MessageLike], *, stream: Literal[False] = ...,
                   timeout: float | None = ..., metadata: Metadata | None = ...,
                   **params: Unpack[ChatParams]) -> ChatCompletion: ...

    @overload
    async def chat(self, messages: str | Sequence[MessageLike], *, stream: Literal[True],
                   timeout: float | None = ..., metadata: Metadata | None = ...,
                   **params: Unpack[ChatParams]) -> AsyncChatStream: ...

    async def chat(self, messages: str | Sequence[MessageLike], *, stream: bool = False,
                   timeout: float | None = None, metadata: Metadata | None = None,
                   **params: Unpack[ChatParams]) -> ChatCompletion | AsyncChatStream:
        request = build_chat_request(messages, params, stream)
        chunks = self._stream(self._openai.ChatComplete(request, **self._call_kwargs(timeout, metadata)),
                              ChatCompletion.from_pb)
        return chunks if stream else merge_chat([c async for c in chunks])

    @staticmethod
    async def _stream(call: Any, decode: Callable[[Any], T]) -> AsyncGenerator[T, None]:
        try:
            async for response in call:
                yield decode(response)
        except aio.AioRpcError as e:
            raise LmrpcError.from_rpc_error(e) from None
        finally:
            call.cancel()
