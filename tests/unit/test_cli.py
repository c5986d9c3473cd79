"""The `lmrpc` CLI against the fake GenerateService: what goes to stdout/stderr, and the exit codes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from fake_generate_server import FakeGenerateService, expected_text, running_fake_server
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tls_certs import Pki, make_pki

from lmrpc.client.cli import main
from lmrpc.server.config import TransportConfig
from lmrpc.server.transport import add_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeGenerateService]]:
    with running_fake_server() as s:
        yield s


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_stream_prints_text_then_summary(server: tuple[str, FakeGenerateService],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "generate", "The capital of France is", "--target", server[0], "--stream",
                         "--max-new-tokens", "32", "--temperature", "0", "--stop", "\\n", "--stop", "日\\t",
                         "--seed", "7")
    assert code == 0
    assert out == expected_text(0) + "\n"
    assert "finish: stop_string (matched '\\n')" in err and "usage: prompt 3, completion 4, cached 1" in err
    sent = server[1].requests[-1]
    assert sent.stream and list(sent.text) == ["The capital of France is"]
    params = sent.sampling_params[0]
    assert params.max_new_tokens == 32 and params.HasField("temperature") and params.temperature == 0
    assert list(params.stop) == ["\n", "日\t"]  # "\\n" on the command line is a newline; non-ASCII kept
    assert params.sampling_seed == 7
    assert not params.HasField("top_p") and not params.HasField("n")


def test_generate_batch_n_prints_each_output(server: tuple[str, FakeGenerateService],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    for extra in ([], ["--stream"]):
        code, out, err = run(capsys, "generate", "a", "b", "--n", "2", "--target", server[0], *extra)
        assert code == 0
        for i in range(4):
            assert f"--- output {i} (rid rid-{i // 2}) ---\n{expected_text(i)}\n" in out
            assert f"[{i}] finish:" in err


def test_generate_json_and_constraints(server: tuple[str, FakeGenerateService],
                                       capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    code, out, _ = run(capsys, "generate", "x", "--target", server[0], "--json", "--json-schema", f"@{schema}",
                       "--logprobs", "--top-logprobs", "1", "--sampling-params", '{"logit_bias": {"5": 2.5}}')
    assert code == 0
    result = json.loads(out)
    assert result["text"] == expected_text(0) and result["finish"]["reason"] == "STOP_STRING"
    assert len(result["output_logprobs"]) == 4
    sent = server[1].requests[-1]
    assert sent.sampling_params[0].json_schema == '{"type": "object"}' and sent.return_logprob
    assert dict(sent.sampling_params[0].logit_bias) == {5: 2.5}


def test_generate_exit_codes(server: tuple[str, FakeGenerateService], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "generate", "invalid", "--target", server[0])
    assert code == 1 and "INVALID_ARGUMENT" in err and "sampling_params[0].top_p" in err
    code, _, err = run(capsys, "generate", "fail", "--target", server[0])
    assert code == 1 and "finish: error: boom" in err
    code, _, err = run(capsys, "generate", "x", "--target", server[0], "--sampling-params", '{"bogus": 1}')
    assert code == 2 and "'bogus'" in err
    code, _, err = run(capsys, "generate", "x", "--target", server[0], "--json-schema", "@/nonexistent/schema.json")
    assert code == 2 and "nonexistent" in err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "x", "--regex", "a", "--json-object"])  # mutually exclusive constraints
    assert exc.value.code == 2
    code, _, err = run(capsys, "info", "--target", "127.0.0.1:1", "--timeout", "5")
    assert code == 1 and "UNAVAILABLE" in err


def test_other_commands(server: tuple[str, FakeGenerateService], capsys: pytest.CaptureFixture[str],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMRPC_TARGET", server[0])  # the default --target
    assert run(capsys, "tokenize", "ab cde") == (0, "1 2 3\n", "")
    assert run(capsys, "tokenize", "ab", "--no-special-tokens") == (0, "2\n", "")
    assert run(capsys, "detokenize", "1", "4") == (0, "w4\n", "")
    assert run(capsys, "detokenize", "1", "4", "--keep-special-tokens") == (0, "w1 w4\n", "")
    assert run(capsys, "health") == (0, "SERVING\n", "")
    assert run(capsys, "health", "--wait", "5") == (0, "SERVING\n", "")
    assert run(capsys, "abort", "r7") == (0, "r7\n", "")
    assert run(capsys, "abort", "--all") == (0, "r1\nr2\n", "")
    assert run(capsys, "abort")[0] == 2
    code, out, _ = run(capsys, "info")
    assert code == 0 and "served_model_name: fake" in out and '"temperature": 0.5' in out
    code, out, _ = run(capsys, "info", "--json")
    assert code == 0 and json.loads(out)["vocab_size"] == 1000


def test_health_not_serving_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with running_fake_server(serving=False) as (target, _):
        assert run(capsys, "health", "--target", target) == (1, "NOT_SERVING\n", "")
        code, _, err = run(capsys, "health", "--target", target, "--wait", "0.5")
        assert code == 1 and "not SERVING" in err


def test_help_explains_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--max-new-tokens", "--stream", "--temperature", "--json-schema", "--target", "--timeout"):
        assert flag in out


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Pki]]:
    """A health-only server that requires client certificates of the test CA (bound like lmrpc-server binds)."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    config = TransportConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca))
    port = add_port(server, "127.0.0.1:0", config)  # typed for grpc.aio; a sync server binds the same way
    server.start()
    yield f"127.0.0.1:{port}", pki
    server.stop(grace=None)


def test_tls_flags(mtls_server: tuple[str, Pki], capsys: pytest.CaptureFixture[str]) -> None:
    target, pki = mtls_server
    client_cert = ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    assert run(capsys, "health", "--target", target, "--tls-ca", str(pki.ca), *client_cert) == (0, "SERVING\n", "")
    # No client certificate, or none at all (plaintext to a TLS port): the handshake fails.
    for flags in (["--tls-ca", str(pki.ca)], []):
        code, _, err = run(capsys, "health", "--target", target, "--timeout", "10", *flags)
        assert code == 1 and "UNAVAILABLE" in err
    # Bad usage: exit 2, naming the flag.
    code, _, err = run(capsys, "health", "--target", target, "--tls-cert", str(pki.client_cert))
    assert code == 2 and "--tls-cert and --tls-key must be given together" in err
    code, _, err = run(capsys, "health", "--target", target, "--tls-ca", str(pki.client_key.parent / "none.pem"))
    assert code == 2 and "none.pem" in err
    code, _, err = run(capsys, "health", "--target", target, "--tls-ca", __file__)
    assert code == 2 and "--tls-ca:" in err and "is not PEM" in err
