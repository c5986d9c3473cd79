"""Mutual TLS and the message-size limit on a real lmrpc-server, with certificates made at test time.

One server for the module (starting one costs ~30 s): --tls-cert/--tls-key/--tls-client-ca, --max-message-size,
and the keepalive and connection-age flags (so a server is shown to start and serve with every transport flag).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc
import pytest
from tls_certs import Pki, make_pki

from lmrpc.client import Client, FinishReason, LmrpcError, ServingStatus, tls
from lmrpc.client.cli import main as cli_main

if TYPE_CHECKING:
    from tests.e2e.conftest import RunningServer

pytestmark = pytest.mark.e2e

MAX_MESSAGE = 1024  # bytes; a short Generate request and its answer fit, a 2 KB prompt does not
SERVICE = "lmrpc.v1.GenerateService"
SHORT = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: Pki, launch_server: Callable[..., RunningServer]) -> Iterator[RunningServer]:
    running = launch_server(
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca),
        "--max-message-size", str(MAX_MESSAGE), "--keepalive-time", "20", "--keepalive-timeout", "5",
        "--max-connection-age", "600", "--max-connection-age-grace", "60",
        "--kv-cache-tokens", "4096", "--sampling-defaults", "openai")
    yield running
    assert running.stop() == 0


def _trusted(pki: Pki) -> grpc.ChannelCredentials:
    return tls(ca_cert=pki.ca, client_cert=pki.client_cert, client_key=pki.client_key)


def test_client_certificate_of_the_ca_is_served(tls_server: RunningServer, pki: Pki,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with Client(tls_server.target, credentials=_trusted(pki), timeout=60) as client:
        assert client.health() is ServingStatus.SERVING
        assert client.health(SERVICE) is ServingStatus.SERVING
        [result] = client.generate("The capital of France is", sampling_params=SHORT)
        assert result.finish.reason is not FinishReason.ERROR and result.text
        deltas = list(client.generate("The capital of France is", sampling_params=SHORT, stream=True))
        assert "".join(d.text for d in deltas) == result.text
    # The CLI with its TLS flags.
    code = cli_main(["generate", "Hello", "--max-new-tokens", "4", "--target", tls_server.target,
                     "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)])
    out, err = capsys.readouterr()
    assert code == 0 and out.strip() and "finish:" in err


@pytest.mark.parametrize("who", ["no client certificate", "a certificate of another CA", "plaintext"])
def test_other_clients_are_refused(tls_server: RunningServer, pki: Pki, who: str) -> None:
    credentials = {
        "no client certificate": tls(ca_cert=pki.ca),
        "a certificate of another CA": tls(ca_cert=pki.ca, client_cert=pki.other_client_cert,
                                           client_key=pki.other_client_key),
        "plaintext": None,
    }[who]
    with Client(tls_server.target, credentials=credentials, timeout=10) as client:
        for call in (client.health, lambda: client.generate("Hello", sampling_params=SHORT)):
            with pytest.raises(LmrpcError) as err:
                call()
            # The handshake fails, so no call reaches the server: UNAVAILABLE, never an answer.
            assert err.value.code == grpc.StatusCode.UNAVAILABLE, (who, err.value)


def test_max_message_size_rejects_a_larger_request(tls_server: RunningServer, pki: Pki) -> None:
    with Client(tls_server.target, credentials=_trusted(pki), timeout=60) as client:
        with pytest.raises(LmrpcError) as err:
            client.generate("word " * 400, sampling_params=SHORT)  # ~2 KB of prompt
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The connection and the server are fine after it.
        [result] = client.generate("Hi", sampling_params=SHORT)
        assert result.finish.reason is not FinishReason.ERROR
