"""How a client reaches a server: TLS credentials (`tls`), channel options (`channel_options`: keepalive, message
size) and the defaults every Client and AsyncClient channel starts from."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc

DEFAULT_TARGET = "localhost:50051"

# Channel options unless the caller overrides them: logprob-heavy answers exceed gRPC's 4 MiB default, and a short
# reconnect backoff lets wait_until_ready notice a server that just came up within a second or two.
DEFAULT_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.max_receive_message_length": 256 * 1024 * 1024,
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 2000,
}
PemSource = str | os.PathLike[str] | bytes  # a path to a PEM file, or the PEM bytes themselves


def _read_pem(name: str, value: PemSource | None) -> bytes | None:
    if value is None:
        return None
    data = value if isinstance(value, bytes) else Path(value).read_bytes()
    if b"-----BEGIN " not in data:  # else gRPC fails later, at the handshake, with an opaque SSL error
        what = "the bytes given are" if isinstance(value, bytes) else f"{os.fspath(value)!r} is"
        raise ValueError(f"{name}: {what} not PEM")
    return data


def tls(ca_cert: PemSource | None = None, client_cert: PemSource | None = None,
        client_key: PemSource | None = None) -> grpc.ChannelCredentials:
    """TLS credentials for Client/AsyncClient(credentials=...).

    ca_cert: the CA (bundle) that signed the server's certificate; None trusts the system's roots.
    client_cert, client_key: the certificate (chain) and key to present to a server that requires one
    (lmrpc-server --tls-client-ca, mutual TLS); both or neither.
    """
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem("ca_cert", ca_cert),
        private_key=_read_pem("client_key", client_key),
        certificate_chain=_read_pem("client_cert", client_cert),
    )


def channel_options(*, keepalive_time: float | None = None, keepalive_timeout: float | None = None,
                    keepalive_without_calls: bool = False,
                    max_message_size: int | None = None) -> list[tuple[str, Any]]:
    """Channel options for Client/AsyncClient(options=...).

    keepalive_time: seconds between pings on a connection without activity, so a dead server, proxy or NAT
    entry is noticed (and a long quiet stream stays open through middleboxes). lmrpc-server accepts pings every
    10 s or more; other servers default to 5 minutes and answer more frequent pings with GOAWAY.
    keepalive_timeout: seconds to wait for a ping's ack before the connection is given up (gRPC default 20).
    keepalive_without_calls: also ping while no call is in flight (keeps an idle channel warm).
    max_message_size: bytes, each message sent and received (the default receives up to 256 MiB).
    """
    options: list[tuple[str, Any]] = []
    if keepalive_time is not None:
        if not keepalive_time > 0:
            raise ValueError(f"keepalive_time must be > 0 seconds, got {keepalive_time}")
        options += [("grpc.keepalive_time_ms", max(1, round(keepalive_time * 1000))),
                    # Without this gRPC stops after two pings while the client sends nothing, which is all of a
                    # server-streaming call after its request.
                    ("grpc.http2.max_pings_without_data", 0),
                    ("grpc.keepalive_permit_without_calls", int(keepalive_without_calls))]
    if keepalive_timeout is not None:
        if not keepalive_timeout > 0:
            raise ValueError(f"keepalive_timeout must be > 0 seconds, got {keepalive_timeout}")
        options.append(("grpc.keepalive_timeout_ms", max(1, round(keepalive_timeout * 1000))))
    if max_message_size is not None:
        if not 1 <= max_message_size < 2**31:
            raise ValueError(f"max_message_size must be in [1, 2**31 - 1] bytes, got {max_message_size}")
        options += [("grpc.max_send_message_length", max_message_size),
                    ("grpc.max_receive_message_length", max_message_size)]
    return options
