"""Client and AsyncClient: typed wrappers over the lmrpc.v1 GenerateService and OpenAIService (complete, chat: see
openai_calls.py) and grpc.health.v1 Health stubs.

Both have the same methods; AsyncClient's are coroutines. Failed RPCs raise LmrpcError.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any, Literal, overload

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmrpc.client.channel import DEFAULT_CHANNEL_OPTIONS, DEFAULT_TARGET
from lmrpc.client.convert import SamplingParamsLike, build_generate_request
from lmrpc.client.errors import LmrpcError
from lmrpc.client.lora_calls import AsyncLoraMethods, LoraMethods
from lmrpc.client.media import MediaArg
from lmrpc.client.openai_calls import AsyncOpenAIMethods, OpenAIMethods
from lmrpc.client.results import GenerateDelta, GenerateResult, Load, ModelInfo, ServingStatus, merge
from lmrpc.v1 import generate_pb2, generate_pb2_grpc, openai_pb2_grpc

Metadata = Sequence[tuple[str, str]]
DeltaStream = Generator[GenerateDelta, None, None]  # Client.generate(stream=True); close() cancels the call
AsyncDeltaStream = AsyncGenerator[GenerateDelta, None]  # AsyncClient.generate(stream=True); aclose() cancels

_RETRY_WHILE_WAITING = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_POLL_SECONDS = 0.25


class _Base:
    """What the two clients share: target, call defaults, channel options."""

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None,
                 options: Sequence[tuple[str, Any]] | None, timeout: float | None, metadata: Metadata | None,
                 api_key: str | None) -> None:
        self.target = target  # host:port of the server
        self.timeout = timeout  # default per-call deadline in seconds (None: no deadline)
        if api_key is not None and (not api_key or not api_key.isascii() or any(c.isspace() for c in api_key)):
            raise ValueError("api_key must be non-empty printable ASCII without spaces")
        auth = (("authorization", f"Bearer {api_key}"),) if api_key is not None else ()
        self.metadata: tuple[tuple[str, str], ...] = auth + tuple(metadata or ())  # sent with every call
        self._credentials = credentials  # None: plaintext
        self._options = list({**DEFAULT_CHANNEL_OPTIONS, **dict(options or ())}.items())

    def _open(self, module: Any) -> Any:
        """A channel from `grpc` or `grpc.aio` (same constructors), plaintext unless credentials were given."""
        if self._credentials is None:
            return module.insecure_channel(self.target, options=self._options)
        return module.secure_channel(self.target, self._credentials, options=self._options)

    def _call_kwargs(self, timeout: float | None, metadata: Metadata | None) -> dict[str, Any]:
        return {
            "timeout": self.timeout if timeout is None else timeout,
            "metadata": self.metadata + tuple(metadata or ()) or None,
        }


class Client(_Base, OpenAIMethods, LoraMethods):
    """Synchronous client. Use as a context manager, or call close()."""

    def __init__(self, target: str = DEFAULT_TARGET, *, credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, Any]] | None = None, timeout: float | None = None,
                 metadata: Metadata | None = None, api_key: str | None = None) -> None:
        super().__init__(target, credentials=credentials, options=options, timeout=timeout, metadata=metadata,
                         api_key=api_key)
        self._channel: grpc.Channel = self._open(grpc)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self._openai = openai_pb2_grpc.OpenAIServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @overload
    def generate(self, text: str | Sequence[str] | None = ..., *,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = ...,
                 sampling_params: SamplingParamsLike | Sequence[SamplingParamsLike] | None = ...,
                 rid: str | Sequence[str] | None = ..., return_logprob: bool = ...,
                 logprob_start_len: int | None = ..., top_logprobs_num: int = ...,
                 token_ids_logprob: Sequence[int] | None = ..., return_text_in_logprobs: bool = ...,
                 custom_logit_processor: str | None = ..., stream: Literal[False] = ...,
                 priority: int | None = ..., lora_path: str | Sequence[str] | None = ...,
                 image_data: MediaArg | None = ..., audio_data: MediaArg | None = ...,
                 timeout: float | None = ..., metadata: Metadata | None = ...) -> list[GenerateResult]: ...

    @overload
    def generate(self, text: str | Sequence[str] | None = ..., *,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = ...,
                 sampling_params: SamplingParamsLike | Sequence[SamplingParamsLike] | None = ...,
                 rid: str | Sequence[str] | None = ..., return_logprob: bool = ...,
                 logprob_start_len: int | None = ..., top_logprobs_num: int = ...,
                 token_ids_logprob: Sequence[int] | None = ..., return_text_in_logprobs: bool = ...,
                 custom_logit_processor: str | None = ..., stream: Literal[True],
                 priority: int | None = ..., lora_path: str | Sequence[str] | None = ...,
                 image_data: MediaArg | None = ..., audio_data: MediaArg | None = ...,
                 timeout: float | None = ..., metadata: Metadata | None = ...) -> DeltaStream: ...

    def generate(self, text: str | Sequence[str] | None = None, *,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 sampling_params: SamplingParamsLike | Sequence[SamplingParamsLike] | None = None,
                 rid: str | Sequence[str] | None = None, return_logprob: bool = False,
                 logprob_start_len: int | None = None, top_logprobs_num: int = 0,
                 token_ids_logprob: Sequence[int] | None = None, return_text_in_logprobs: bool = False,
                 custom_logit_processor: str | None = None, stream: bool = False,
                 priority: int | None = None, lora_path: str | Sequence[str] | None = None,
                 image_data: MediaArg | None = None, audio_data: MediaArg | None = None,
                 timeout: float | None = None,
                 metadata: Metadata | None = None) -> list[GenerateResult] | DeltaStream:
        """Generate from one prompt or a batch. stream=True: an iterator of deltas (leaving it early cancels the
        call); otherwise one merged result per output index, ordered by index. priority: lower is admitted first
        among waiting requests (default 0). lora_path: the LoRA adapter of every prompt (a str), or one per prompt
        ("" for the base model). image_data / audio_data: the prompts' images and audio clips (see
        lmrpc.client.media: URLs or paths the server reads, file bytes, processor output, embeddings), each filling
        one placeholder of its prompt in order."""
        request = build_generate_request(
            text, input_ids=input_ids, sampling_params=sampling_params, rid=rid, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob, return_text_in_logprobs=return_text_in_logprobs,
            custom_logit_processor=custom_logit_processor, stream=stream, priority=priority, lora_path=lora_path,
            image_data=image_data, audio_data=audio_data)
        deltas = self._generate_stream(request, self._call_kwargs(timeout, metadata))
        return deltas if stream else merge(deltas)

    def _generate_stream(self, request: generate_pb2.GenerateRequest,
                         kwargs: dict[str, Any]) -> DeltaStream:
        call = self._stub.Generate(request, **kwargs)
        try:
            for response in call:
                yield GenerateDelta.from_pb(response)
        except grpc.RpcError as e:
            raise LmrpcError.from_rpc_error(e) from None
        finally:
            call.cancel()  # a no-op once the stream ended; frees the server's work if the caller stopped early

    def abort(self, rid: str | Sequence[str] | None = None, *, abort_all: bool = False,
              timeout: float | None = None, metadata: Metadata | None = None) -> list[str]:
        """Abort requests by id (or all); returns the ids that were running or queued."""
        rids = [] if rid is None else [rid] if isinstance(rid, str) else list(rid)
        request = generate_pb2.AbortRequest(rid=rids, abort_all=abort_all)
        return list(self._unary(self._stub.Abort, request, timeout, metadata).aborted_rid)

    def model_info(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> ModelInfo:
        response = self._unary(self._stub.GetModelInfo, generate_pb2.GetModelInfoRequest(), timeout, metadata)
        return ModelInfo.from_pb(response)

    def tokenize(self, text: str, add_special_tokens: bool = True, *, timeout: float | None = None,
                 metadata: Metadata | None = None) -> list[int]:
        request = generate_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._unary(self._stub.Tokenize, request, timeout, metadata).token_ids)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True, *, timeout: float | None = None,
                   metadata: Metadata | None = None) -> str:
        request = generate_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens)
        return self._unary(self._stub.Detokenize, request, timeout, metadata).text

    def get_load(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> Load:
        """GetLoad: the server's load now and over the last minute (for routing and dashboards)."""
        return Load.from_pb(self._unary(self._stub.GetLoad, generate_pb2.GetLoadRequest(), timeout, metadata))

    def health(self, service: str = "", *, timeout: float | None = None,
               metadata: Metadata | None = None) -> ServingStatus:
        """grpc.health.v1 Check: the serving status of `service` ("" is the whole server)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return ServingStatus(self._unary(self._health.Check, request, timeout, metadata).status)

    def wait_until_ready(self, timeout: float = 60.0, *, service: str = "") -> None:
        """Poll health until SERVING; raise TimeoutError after `timeout` seconds. A server without the health
        service counts as ready once GetModelInfo answers."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                status = self.health(service, timeout=min(remaining, 5.0))
            except LmrpcError as e:
                if e.code == grpc.StatusCode.UNIMPLEMENTED:
                    self.model_info(timeout=remaining)
                    return
                if e.code not in _RETRY_WHILE_WAITING:
                    raise
                last = str(e)
            else:
                if status is ServingStatus.SERVING:
                    return
                last = status.name
            time.sleep(max(0.0, min(_POLL_SECONDS, deadline - time.monotonic())))
        raise TimeoutError(f"{self.target} not SERVING after {timeout:g} s (last: {last})")

    def _unary(self, method: grpc.UnaryUnaryMultiCallable, request: Any, timeout: float | None,
               metadata: Metadata | None) -> Any:
        try:
            return method(request, **self._call_kwargs(timeout, metadata))
        except grpc.RpcError as e:
            raise LmrpcError.from_rpc_error(e) from None


class AsyncClient(_Base, AsyncOpenAIMethods, AsyncLoraMethods):
    """asyncio client (grpc.aio); create it inside the running event loop. Use `async with`, or await close()."""

    def __init__(self, target: str = DEFAULT_TARGET, *, credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, Any]] | None = None, timeout: float | None = None,
                 metadata: Metadata | None = None, api_key: str | None = None) -> None:
        super().__init__(target, credentials=credentials, options=options, timeout=timeout, metadata=metadata,
                         api_key=api_key)
        self._channel: aio.Channel = self._open(aio)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)
        self._openai = openai_pb2_grpc.OpenAIServiceStub(self._channel)  # the aio stub, for an aio channel
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @overload
    async def generate(self, text: str | Sequence[str] | None = ..., *,
                       input_ids: Sequence[int] | Sequence[Sequence[int]] | None = ...,
                       sampling_params: SamplingParamsLike | Sequence[SamplingParamsLike] | None = ...,
                       rid: str | Sequence[str] | None = ..., return_logprob: bool = ...,
                       logprob_start_len: int | None = ..., top_logprobs_num: int = ...,
                       token_ids_logprob: Sequence[int] | None = ..., return_text_in_logprobs: bool = ...,
                       custom_logit_processor: str | None = ..., stream: Literal[False] = ...,
                       priority: int | None = ..., lora_path: str | Sequence[str] | None = ...,
                       image_data: MediaArg | None = ..., audio_data: MediaArg | None = ...,
                       timeout: float | None = ..., metadata: Metadata | None = ...) -> list[GenerateResult]: ...

    @overload
    async def generate(self, text: str | Sequence[str] | None = ..., *,
                       input_ids: Sequence[int] | Sequence[Sequence[int]] | None = ...,
                       sampling_params: SamplingParamsLike | Sequence[SamplingParamsLike] | None = ...,
                       rid: str | Sequence[str] | None = ..., return_logprob: bool = ...,
                       logprob_start_len: int | None = ..., top_logprobs_num: int = ...,
                       token_ids_logprob: Sequence[int] | None = ..., return_text_in_logprobs: bool = ...,
                       custom_logit_processor: str | None = ..., stream: Literal[True],
                       priority: int | None = ..., lora_path: str | Sequence[str] | None = ...,
                       image_data: MediaArg | None = ..., audio_data: MediaArg | None = ...,
                       timeout: float | None = ...,
                       metadata: Metadata | None = ...) -> AsyncDeltaStream: ...

    async def generate(self, text: str | Sequence[str] | None = None, *,
                       input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                       sampling_params: SamplingParamsLike | Sequence[SamplingParamsLike] | None = None,
                       rid: str | Sequence[str] | None = None, return_logprob: bool = False,
                       logprob_start_len: int | None = None, top_logprobs_num: int = 0,
                       token_ids_logprob: Sequence[int] | None = None, return_text_in_logprobs: bool = False,
                       custom_logit_processor: str | None = None, stream: bool = False,
                       priority: int | None = None, lora_path: str | Sequence[str] | None = None,
                       image_data: MediaArg | None = None, audio_data: MediaArg | None = None,
                       timeout: float | None = None,
                       metadata: Metadata | None = None) -> list[GenerateResult] | AsyncDeltaStream:
        """Like Client.generate. stream=True: `async for delta in await client.generate(..., stream=True)`."""
        request = build_generate_request(
            text, input_ids=input_ids, sampling_params=sampling_params, rid=rid, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob, return_text_in_logprobs=return_text_in_logprobs,
            custom_logit_processor=custom_logit_processor, stream=stream, priority=priority, lora_path=lora_path,
            image_data=image_data, audio_data=audio_data)
        deltas = self._generate_stream(request, self._call_kwargs(timeout, metadata))
        if stream:
            return deltas
        return merge([d async for d in deltas])

    async def _generate_stream(self, request: generate_pb2.GenerateRequest,
                               kwargs: dict[str, Any]) -> AsyncDeltaStream:
        call = self._stub.Generate(request, **kwargs)
        try:
            async for response in call:
                yield GenerateDelta.from_pb(response)
        except aio.AioRpcError as e:
            raise LmrpcError.from_rpc_error(e) from None
        finally:
            call.cancel()  # a no-op once the stream ended; frees the server's work if the caller stopped early

    async def abort(self, rid: str | Sequence[str] | None = None, *, abort_all: bool = False,
                    timeout: float | None = None, metadata: Metadata | None = None) -> list[str]:
        rids = [] if rid is None else [rid] if isinstance(rid, str) else list(rid)
        request = generate_pb2.AbortRequest(rid=rids, abort_all=abort_all)
        return list((await self._unary(self._stub.Abort, request, timeout, metadata)).aborted_rid)

    async def model_info(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> ModelInfo:
        request = generate_pb2.GetModelInfoRequest()
        return ModelInfo.from_pb(await self._unary(self._stub.GetModelInfo, request, timeout, metadata))

    async def tokenize(self, text: str, add_special_tokens: bool = True, *, timeout: float | None = None,
                       metadata: Metadata | None = None) -> list[int]:
        request = generate_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._unary(self._stub.Tokenize, request, timeout, metadata)).token_ids)

    async def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True, *,
                         timeout: float | None = None, metadata: Metadata | None = None) -> str:
        request = generate_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens)
        return str((await self._unary(self._stub.Detokenize, request, timeout, metadata)).text)

    async def get_load(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> Load:
        response = await self._unary(self._stub.GetLoad, generate_pb2.GetLoadRequest(), timeout, metadata)
        return Load.from_pb(response)

    async def health(self, service: str = "", *, timeout: float | None = None,
                     metadata: Metadata | None = None) -> ServingStatus:
        request = health_pb2.HealthCheckRequest(service=service)
        return ServingStatus((await self._unary(self._health.Check, request, timeout, metadata)).status)

    async def wait_until_ready(self, timeout: float = 60.0, *, service: str = "") -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                status = await self.health(service, timeout=min(remaining, 5.0))
            except LmrpcError as e:
                if e.code == grpc.StatusCode.UNIMPLEMENTED:
                    await self.model_info(timeout=remaining)
                    return
                if e.code not in _RETRY_WHILE_WAITING:
                    raise
                last = str(e)
            else:
                if status is ServingStatus.SERVING:
                    return
                last = status.name
            await asyncio.sleep(max(0.0, min(_POLL_SECONDS, deadline - time.monotonic())))
        raise TimeoutError(f"{self.target} not SERVING after {timeout:g} s (last: {last})")

    async def _unary(self, method: aio.UnaryUnaryMultiCallable, request: Any, timeout: float | None,
                     metadata: Metadata | None) -> Any:
        try:
            return await method(request, **self._call_kwargs(timeout, metadata))
        except aio.AioRpcError as e:
            raise LmrpcError.from_rpc_error(e) from None
