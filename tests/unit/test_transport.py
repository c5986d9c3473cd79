"""Server transport: TransportConfig validation, the flags, the grpc options it maps to, and TLS/mutual TLS and
message limits on an in-process grpc.aio server (health service only; no model)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tls_certs import Pki, make_pki

from lmrpc.client import AsyncClient, LmrpcError, ServingStatus, channel_options, tls
from lmrpc.server.__main__ import parse_args, transport_config
from lmrpc.server.config import ServerConfig, TransportConfig
from lmrpc.server.transport import MIN_CLIENT_PING_INTERVAL_MS, add_port, server_options

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_defaults_are_plaintext_and_grpc_defaults() -> None:
    config = ServerConfig().transport
    assert not config.tls
    options = dict(server_options(config))
    # Only the client-ping tolerance and gRPC's own 20 s ping timeout: no limits, no age, no server pings.
    assert options == {"grpc.keepalive_permit_without_calls": 1,
                       "grpc.http2.min_ping_interval_without_data_ms": MIN_CLIENT_PING_INTERVAL_MS,
                       "grpc.keepalive_timeout_ms": 20_000}


def test_flags_map_to_grpc_options(pki: Pki) -> None:
    args = parse_args(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                       "--tls-client-ca", str(pki.ca), "--keepalive-time", "30", "--keepalive-timeout", "5",
                       "--max-connection-age", "600", "--max-connection-age-grace", "60.5",
                       "--max-message-size", "1048576"])
    config = transport_config(args)
    assert config.tls and config.tls_client_ca == str(pki.ca)
    assert dict(server_options(config)) == {
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.min_ping_interval_without_data_ms": MIN_CLIENT_PING_INTERVAL_MS,
        "grpc.keepalive_time_ms": 30_000,
        "grpc.http2.max_pings_without_data": 0,
        "grpc.keepalive_timeout_ms": 5_000,
        "grpc.max_connection_age_ms": 600_000,
        "grpc.max_connection_age_grace_ms": 60_500,
        "grpc.max_send_message_length": 1048576,
        "grpc.max_receive_message_length": 1048576,
    }


@pytest.mark.parametrize(("flags", "message"), [
    (["--tls-cert", "{cert}"], "--tls-cert and --tls-key must be given together"),
    (["--tls-key", "{key}"], "--tls-cert and --tls-key must be given together"),
    (["--tls-client-ca", "{ca}"], "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key"),
    (["--tls-cert", "{cert}", "--tls-key", "/nonexistent/key.pem"], "--tls-key: cannot read '/nonexistent/key.pem'"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{notpem}"], "is not a PEM file"),
    (["--keepalive-time", "0"], "--keepalive-time must be in [0.001,"),
    (["--keepalive-timeout", "-1"], "--keepalive-timeout must be in"),
    (["--max-connection-age-grace", "5"], "--max-connection-age-grace needs --max-connection-age"),
    (["--max-connection-age", "60", "--max-connection-age-grace", "-1"], "--max-connection-age-grace must be in"),
    (["--max-message-size", "0"], "--max-message-size must be in [1,"),
    (["--max-message-size", str(2**31)], "--max-message-size must be in [1,"),
])
def test_bad_flags_exit_2_naming_the_flag(pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          flags: list[str], message: str) -> None:
    notpem = tmp_path / "notpem.txt"
    notpem.write_text("hello")
    paths = {"cert": pki.server_cert, "key": pki.server_key, "ca": pki.ca, "notpem": notpem}
    args = parse_args([f.format(**paths) for f in flags])
    with pytest.raises(SystemExit) as exc:
        transport_config(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_config_rejects_nan() -> None:
    with pytest.raises(ValueError, match="keepalive_time"):
        TransportConfig(keepalive_time=float("nan"))


async def _health_server(config: TransportConfig) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=server_options(config))
    servicer = health.aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = add_port(server, "127.0.0.1:0", config)
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def mtls_target(pki: Pki) -> AsyncIterator[str]:
    config = TransportConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca),
                             max_message_size=1024)
    server, target = await _health_server(config)
    yield target
    await server.stop(None)


async def _status(target: str, credentials: grpc.ChannelCredentials | None, service: str = "") -> ServingStatus:
    async with AsyncClient(target, credentials=credentials, timeout=10) as client:
        return await client.health(service)


async def test_mutual_tls_serves_only_clients_of_the_ca(pki: Pki, mtls_target: str) -> None:
    good = tls(ca_cert=pki.ca, client_cert=pki.client_cert, client_key=pki.client_key)
    assert await _status(mtls_target, good) is ServingStatus.SERVING
    # PEM bytes work as well as paths.
    as_bytes = tls(ca_cert=pki.ca.read_bytes(), client_cert=pki.client_cert.read_bytes(),
                   client_key=pki.client_key.read_bytes())
    assert await _status(mtls_target, as_bytes) is ServingStatus.SERVING
    refused = {
        "no client certificate": tls(ca_cert=pki.ca),
        "client certificate of another CA": tls(ca_cert=pki.ca, client_cert=pki.other_client_cert,
                                                client_key=pki.other_client_key),
        "plaintext": None,
    }
    for what, credentials in refused.items():
        with pytest.raises(LmrpcError) as err:
            await _status(mtls_target, credentials)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, what


async def test_max_message_size_rejects_larger_requests(pki: Pki, mtls_target: str) -> None:
    good = tls(ca_cert=pki.ca, client_cert=pki.client_cert, client_key=pki.client_key)
    with pytest.raises(LmrpcError) as err:
        await _status(mtls_target, good, service="x" * 2000)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The client's own limit fails the call before it is sent.
    async with AsyncClient(mtls_target, credentials=good, options=channel_options(max_message_size=100)) as client:
        with pytest.raises(LmrpcError) as err:
            await client.health("y" * 200, timeout=10)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await client.health(timeout=10) is ServingStatus.SERVING

