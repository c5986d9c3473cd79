"""API keys (`--api-key-file`): calls to lmrpc's services need `authorization: Bearer KEY` metadata; the health and
reflection services stay open (probes and tools carry no key).

Keys are kept only as SHA-256 digests and compared in constant time (every digest is compared, whichever matches);
neither a key nor its digest is ever logged. A caller is identified for per-client accounting by a short
fingerprint of its key, or without keys by its peer's address (host only: one client's many connections are one
client).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from lmrpc.server.wire import aborting

AUTHORIZATION = "authorization"  # the metadata key (gRPC metadata keys are lower case)
OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                           "grpc.reflection.v1.ServerReflection"})
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send the metadata 'authorization: Bearer <key>'"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, repr=False)
class ApiKeys:
    """The accepted keys, as digests. Its repr says how many and nothing else, so a logged config leaks nothing."""

    digests: tuple[bytes, ...]  # SHA-256 of each accepted key

    def __post_init__(self) -> None:
        if not self.digests:
            raise ValueError("api_key_file: no key in the file")

    def __repr__(self) -> str:
        return f"ApiKeys({len(self.digests)} key{'s' if len(self.digests) != 1 else ''})"

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys:
        return cls(tuple(_digest(k) for k in keys))

    @classmethod
    def read(cls, path: str) -> ApiKeys:
        """One key per line; blank lines and lines starting with '#' are skipped. Raises ValueError (naming
        api_key_file, never a key) for an unreadable file, no key, or a key that cannot travel in metadata."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"api_key_file: cannot read {path!r}: {getattr(e, 'strerror', None) or e}") from None
        keys = []
        for number, line in enumerate(text.splitlines(), 1):
            key = line.strip()
            if not key or key.startswith("#"):
                continue
            if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
                raise ValueError(f"api_key_file: line {number} of {path!r} is not a key (printable ASCII without "
                                 "spaces)")
            keys.append(key)
        if not keys:
            raise ValueError(f"api_key_file: {path!r} holds no key (one per line; '#' starts a comment)")
        return cls.of(keys)

    def accepts(self, key: str) -> bool:
        """Constant time in the key: its digest is compared with every accepted digest."""
        presented = _digest(key)
        found = False
        for digest in self.digests:
            found |= hmac.compare_digest(presented, digest)
        return found


def bearer_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key of an `authorization: Bearer KEY` metadata entry, if any."""
    for name, value in metadata or ():
        if name != AUTHORIZATION or not isinstance(value, str):
            continue
        scheme, _, key = value.strip().partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            return key.strip()
    return None


def client_identity(metadata: Iterable[tuple[str, str | bytes]] | None, peer: str, keys: ApiKeys | None) -> str:
    """Who is calling, for per-client accounting: `key:<fingerprint>` when keys are required (the interceptor has
    checked the key by then), else `peer:<address without port>`."""
    if keys is not None:
        key = bearer_key(metadata)
        if key is not None:
            return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]
    return "peer:" + _peer_host(peer)


def _peer_host(peer: str) -> str:
    """'ipv4:10.1.2.3:5678' -> 'ipv4:10.1.2.3'; 'ipv6:[::1]:5678' -> 'ipv6:[::1]'; others as they are."""
    kind, _, address = peer.partition(":")
    if kind == "ipv4" and address.count(":") == 1:
        return f"ipv4:{address.rsplit(':', 1)[0]}"
    if kind == "ipv6" and address.startswith("[") and "]:" in address:
        return f"ipv6:{address.split(']:', 1)[0]}]"
    return peer


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Calls without a valid key end UNAUTHENTICATED before their handler runs; open services pass."""

    def __init__(self, keys: ApiKeys, open_services: frozenset[str] = OPEN_SERVICES) -> None:
        self._keys = keys
        self._open = open_services

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.strip("/").split("/", 1)[0]
        if handler is None or service in self._open:
            return handler
        metadata: Mapping[str, str] | Iterable[tuple[str, str | bytes]] = handler_call_details.invocation_metadata or ()
        key = bearer_key(metadata if not isinstance(metadata, Mapping) else metadata.items())
        if key is not None and self._keys.accepts(key):
            return handler
        return aborting(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
