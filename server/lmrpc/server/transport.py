"""TransportConfig -> grpc.aio server channel arguments, TLS credentials and the listening port."""

from __future__ import annotations

from pathlib import Path

import grpc

from lmrpc.server.config import TransportConfig

# Clients may ping this often on a connection with no data flowing. gRPC's server default (5 min, two strikes)
# answers the common 10-60 s client keepalive (lmrpc.client.channel_options, proxies, meshes) with a GOAWAY
# "too_many_pings", which drops every call on that connection.
MIN_CLIENT_PING_INTERVAL_MS = 10_000


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def server_options(config: TransportConfig) -> list[tuple[str, int]]:
    """The grpc.aio.server(options=...) for `config`; gRPC's defaults stand for every unset field."""
    options: list[tuple[str, int]] = [
        # Tolerate client keepalive pings, also on idle connections (clients that keep their channel warm).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
    ]
    if config.keepalive_time is not None:
        options += [
            ("grpc.keepalive_time_ms", _ms(config.keepalive_time)),
            # Keep pinging a quiet connection: the default stops after two pings without data, so a peer that
            # vanished behind a NAT or proxy would hold its connection (and its streams) until TCP gives up.
            ("grpc.http2.max_pings_without_data", 0),
        ]
    options.append(("grpc.keepalive_timeout_ms", _ms(config.keepalive_timeout)))
    if config.max_connection_age is not None:
        options.append(("grpc.max_connection_age_ms", _ms(config.max_connection_age)))
    if config.max_connection_age_grace is not None:
        options.append(("grpc.max_connection_age_grace_ms", _ms(config.max_connection_age_grace)))
    if config.max_message_size is not None:
        options += [
            ("grpc.max_send_message_length", config.max_message_size),
            ("grpc.max_receive_message_length", config.max_message_size),
        ]
    return options


def server_credentials(config: TransportConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the PEM files, or None for plaintext. With a client CA the handshake requires and
    verifies a client certificate, so a client without one never reaches a handler."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


class ListenError(OSError):
    """The server cannot listen where its flags say (a port in use, a host that is no address of this machine):
    `lmrpc-server` says so in one line and exits 2."""


def add_port(server: grpc.aio.Server, address: str, config: TransportConfig) -> int:
    """Bind `address` (TLS if configured, else plaintext); returns the bound port (the chosen one for port 0)."""
    credentials = server_credentials(config)
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as e:  # grpc's only word for a failed bind ("Failed to bind to address ...")
        raise ListenError(f"--host/--port: cannot listen on {address} (the port is in use, or the host is no address "
                          "of this machine)") from e
