"""LoRA adapter lifecycle: list_lora_adapters(), load_lora_adapter(), unload_lora_adapter() of Client and
AsyncClient (mixed into both), and the `LoraAdapter` they return. Requests pick an adapter with generate's
lora_path, or complete/chat's model "base:adapter"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

from lmrpc.client.errors import LmrpcError
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

Metadata = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class LoraAdapter:
    """One loaded LoRA adapter."""

    name: str  # what requests give in lora_path (or as "base:name" in complete/chat's model)
    path: str  # the directory it was read from
    rank: int  # r
    scale: float  # lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA)
    target_modules: list[str]  # PEFT module names, sorted
    in_use: int  # calls running with it now

    @classmethod
    def from_pb(cls, pb: generate_pb2.LoraAdapter) -> LoraAdapter:
        return cls(pb.name, pb.path, pb.rank, pb.scale, list(pb.target_modules), pb.in_use)


class LoraMethods:
    """Client's adapter calls; needs `_stub` and `_call_kwargs` from the client."""

    _stub: generate_pb2_grpc.GenerateServiceStub

    def _call_kwargs(self, timeout: float | None, metadata: Metadata | None) -> dict[str, Any]:
        raise NotImplementedError  # provided by the client class

    def _lora_call(self, method: grpc.UnaryUnaryMultiCallable, request: Any, timeout: float | None,
                   metadata: Metadata | None) -> Any:
        try:
            return method(request, **self._call_kwargs(timeout, metadata))
        except grpc.RpcError as e:
            raise LmrpcError.from_rpc_error(e) from None

    def list_lora_adapters(self, *, timeout: float | None = None,
                           metadata: Metadata | None = None) -> list[LoraAdapter]:
        """The loaded adapters, least recently used first."""
        response = self._lora_call(self._stub.ListLoraAdapters, generate_pb2.ListLoraAdaptersRequest(), timeout,
                                   metadata)
        return [LoraAdapter.from_pb(a) for a in response.adapters]

    def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None,
                          metadata: Metadata | None = None) -> LoraAdapter:
        """Load the adapter directory `path` (under the server's --lora-root) as `name` (needs the server's
        --enable-lora-admin)."""
        request = generate_pb2.LoadLoraAdapterRequest(name=name, path=path)
        return LoraAdapter.from_pb(self._lora_call(self._stub.LoadLoraAdapter, request, timeout, metadata).adapter)

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None,
                            metadata: Metadata | None = None) -> None:
        """Unload `name`: new requests no longer find it; those in flight finish with it."""
        self._lora_call(self._stub.UnloadLoraAdapter, generate_pb2.UnloadLoraAdapterRequest(name=name), timeout,
                        metadata)


class AsyncLoraMethods:
    """AsyncClient's adapter calls (as LoraMethods)."""

    _stub: generate_pb2_grpc.GenerateServiceAsyncStub

    def _call_kwargs(self, timeout: float | None, metadata: Metadata | None) -> dict[str, Any]:
        raise NotImplementedError  # provided by the client class

    async def _lora_call(self, method: aio.UnaryUnaryMultiCallable, request: Any, timeout: float | None,
                         metadata: Metadata | None) -> Any:
        try:
            return await method(request, **self._call_kwargs(timeout, metadata))
        except grpc.RpcError as e:
            raise LmrpcError.from_rpc_error(e) from None

    async def list_lora_adapters(self, *, timeout: float | None = None,
                                 metadata: Metadata | None = None) -> list[LoraAdapter]:
        response = await self._lora_call(self._stub.ListLoraAdapters, generate_pb2.ListLoraAdaptersRequest(),
                                         timeout, metadata)
        return [LoraAdapter.from_pb(a) for a in response.adapters]

    async def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None,
                                metadata: Metadata | None = None) -> LoraAdapter:
        request = generate_pb2.LoadLoraAdapterRequest(name=name, path=path)
        response = await self._lora_call(self._stub.LoadLoraAdapter, request, timeout, metadata)
        return LoraAdapter.from_pb(response.adapter)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None,
                                  metadata: Metadata | None = None) -> None:
        await self._lora_call(self._stub.UnloadLoraAdapter, generate_pb2.UnloadLoraAdapterRequest(name=name),
                              timeout, metadata)
