"""lmrpc.client against a fake in-process GenerateService: request conversion, stream vs merged results, batch and
n merging by index, error decoding, health, and the async client's parity with the sync one."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fake_generate_server import VIOLATION, FakeGenerateService, expected_ids, expected_text, running_fake_server
from google.protobuf import json_format

from lmrpc.client import (
    AsyncClient,
    Client,
    FinishReason,
    LmrpcError,
    ServingStatus,
    channel_options,
    response_format,
    sampling_params_to_pb,
    tls,
)
from lmrpc.client.convert import build_generate_request
from lmrpc.v1 import generate_pb2

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeGenerateService]]:
    with running_fake_server() as s:
        yield s


@pytest.fixture
def client(server: tuple[str, FakeGenerateService]) -> Iterator[Client]:
    with Client(server[0], timeout=10) as c:
        yield c


# --- conversion -------------------------------------------------------------------------------------------------

def test_sampling_params_sets_only_given_fields() -> None:
    pb = sampling_params_to_pb({"max_new_tokens": 32, "temperature": 0, "stop": "\n", "logit_bias": {"5": 1.0},
                                "sampling_seed": 1, "top_p": None, "custom_params": {"token_ids": [1, 2]}})
    assert pb.HasField("temperature") and pb.temperature == 0.0  # an explicit 0 travels (greedy), not "unset"
    assert pb.max_new_tokens == 32 and pb.sampling_seed == 1
    assert not pb.HasField("top_p") and not pb.HasField("top_k") and not pb.HasField("n")  # None / absent: unset
    assert list(pb.stop) == ["\n"]
    assert dict(pb.logit_bias) == {5: 1.0}
    assert json_format.MessageToDict(pb.custom_params) == {"token_ids": [1.0, 2.0]}
    assert pb.WhichOneof("constraint") is None


def test_sampling_params_schema_dict_and_constraint_exclusive() -> None:
    pb = sampling_params_to_pb({"json_schema": {"type": "object"}})
    assert json.loads(pb.json_schema) == {"type": "object"}
    with pytest.raises(ValueError, match="at most one"):
        sampling_params_to_pb({"json_schema": "{}", "regex": "a+"})


def test_sampling_params_rejects_unknown_keys_and_bad_types() -> None:
    with pytest.raises(TypeError, match="'temprature'"):
        sampling_params_to_pb({"temprature": 0.5})
    with pytest.raises(TypeError, match="'max_new_tokens'"):
        sampling_params_to_pb({"max_new_tokens": "many"})
    with pytest.raises(TypeError):
        sampling_params_to_pb(["max_new_tokens"])  # type: ignore[arg-type]


def test_build_request_shapes() -> None:
    common: dict[str, Any] = {"sampling_params": None, "rid": None, "return_logprob": False, "logprob_start_len": None,
              "top_logprobs_num": 0, "token_ids_logprob": None, "return_text_in_logprobs": False,
              "custom_logit_processor": None, "stream": False}
    one = build_generate_request(None, input_ids=[1, 2, 3], **common)
    assert [list(t.ids) for t in one.input_ids] == [[1, 2, 3]] and not one.HasField("logprob_start_len")
    batch = build_generate_request(None, input_ids=[[1], [2, 3]], **{**common, "rid": ["a", "b"]})
    assert [list(t.ids) for t in batch.input_ids] == [[1], [2, 3]] and list(batch.rid) == ["a", "b"]
    per_prompt = build_generate_request(["x", "y"], input_ids=None, **{
        **common, "sampling_params": [{"n": 2}, generate_pb2.SamplingParams(n=2)], "logprob_start_len": 0})
    assert len(per_prompt.sampling_params) == 2 and per_prompt.logprob_start_len == 0
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request("x", input_ids=[1], **common)
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request(None, input_ids=None, **common)
    with pytest.raises(TypeError, match="mix"):
        build_generate_request(None, input_ids=[1, [2]], **common)  # type: ignore[arg-type]


def test_response_format_mapping() -> None:
    assert response_format({"type": "json_object"}) == {"json_schema": '{"type": "object"}'}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    mapped = response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(mapped["json_schema"]) == schema
    assert response_format({"type": "text"}) == {}
    with pytest.raises(ValueError):
        response_format({"type": "xml"})
    with pytest.raises(ValueError):
        response_format({"type": "json_schema", "json_schema": {"name": "no schema"}})
    assert sampling_params_to_pb({**mapped, "max_new_tokens": 8}).json_schema == mapped["json_schema"]


# --- sync client ------------------------------------------------------------------------------------------------

def test_generate_merged_single(client: Client, server: tuple[str, FakeGenerateService]) -> None:
    results = client.generate("The capital of France is", sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert len(results) == 1
    r = results[0]
    assert (r.index, r.rid, r.text, r.token_ids) == (0, "rid-0", expected_text(0), expected_ids(0))
    assert r.finish.reason is FinishReason.STOP_STRING and r.finish.matched == "\n"
    assert r.finish_reason is r.finish.reason
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens) == (3, 4, 1)
    sent = server[1].requests[-1]
    assert not sent.stream and list(sent.text) == ["The capital of France is"]
    assert sent.sampling_params[0].HasField("temperature") and not sent.sampling_params[0].HasField("top_p")


def test_generate_stream_deltas_concatenate_to_merged(client: Client) -> None:
    deltas = list(client.generate("hi", stream=True))
    assert [d.text for d in deltas] == ["Paris", ".", " It", " #0"]
    assert all(d.finish is None for d in deltas[:-1]) and deltas[-1].finish is not None
    assert deltas[-1].usage is not None
    merged = client.generate("hi")[0]
    assert "".join(d.text for d in deltas) == merged.text
    assert [t for d in deltas for t in d.token_ids] == merged.token_ids


@pytest.mark.parametrize("stream", [False, True])
def test_batch_and_n_merge_by_index(client: Client, stream: bool) -> None:
    kwargs: dict[str, Any] = {"sampling_params": {"n": 2}, "rid": ["a", "b"], "return_logprob": True,
                              "top_logprobs_num": 2, "logprob_start_len": 0}
    if stream:
        from lmrpc.client import merge
        results = merge(client.generate(["p0", "p1"], stream=True, **kwargs))
    else:
        results = client.generate(["p0", "p1"], **kwargs)
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert [r.rid for r in results] == ["a", "a", "b", "b"]
    assert [r.text for r in results] == [expected_text(i) for i in range(4)]
    assert [r.token_ids for r in results] == [expected_ids(i) for i in range(4)]
    assert [r.finish.reason for r in results] == [FinishReason.STOP_STRING] + [FinishReason.LENGTH] * 3
    for r in results:
        assert [p.chosen.token_id for p in r.output_logprobs if p.chosen] == r.token_ids
        assert all(len(p.top) == 2 and p.top[0].logprob == -0.5 for p in r.output_logprobs)
        assert len(r.input_logprobs) == 1 and r.input_logprobs[0].chosen is not None
        assert r.input_logprobs[0].chosen.logprob is None  # unset on the wire -> None, not 0.0


def test_input_ids_and_metadata(server: tuple[str, FakeGenerateService]) -> None:
    with Client(server[0], metadata=[("x-tenant", "t1")]) as c:
        c.generate(input_ids=[5, 6], metadata=[("x-request-id", "abc")])
    assert [list(t.ids) for t in server[1].requests[-1].input_ids] == [[5, 6]]
    seen = server[1].metadata[-1]
    assert seen["x-tenant"] == "t1" and seen["x-request-id"] == "abc"


def test_error_decodes_bad_request(client: Client) -> None:
    with pytest.raises(LmrpcError) as info:
        client.generate("invalid")
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == "invalid sampling parameters"
    assert [(v.field, v.description) for v in err.field_violations] == [VIOLATION]
    assert VIOLATION[0] in str(err)


def test_finish_error_is_a_result_not_an_exception(client: Client) -> None:
    r = client.generate("fail")[0]
    assert r.finish.reason is FinishReason.ERROR and r.finish.message == "boom"


def test_leaving_a_stream_early_cancels_the_call(client: Client, server: tuple[str, FakeGenerateService]) -> None:
    server[1].cancelled.clear()
    stream = client.generate("slow", stream=True)
    first = next(stream)
    assert first.text == "x"
    stream.close()  # what `break` out of a for loop does once the generator is collected
    assert server[1].cancelled.wait(10)


def test_unavailable_server_raises_lmrpc_error() -> None:
    with Client("127.0.0.1:1", timeout=5) as c, pytest.raises(LmrpcError) as info:
        c.model_info()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_unary_methods(client: Client) -> None:
    info = client.model_info()
    assert (info.served_model_name, info.vocab_size, info.eos_token_ids) == ("fake", 1000, [2])
    assert info.default_sampling_params == {"temperature": 0.5, "max_new_tokens": 128}
    assert client.tokenize("ab cde") == [1, 2, 3]
    assert client.tokenize("ab cde", add_special_tokens=False) == [2, 3]
    assert client.detokenize([1, 7]) == "w7"
    assert client.detokenize([1, 7], skip_special_tokens=False) == "w1 w7"
    assert client.abort("r9") == ["r9"]
    assert client.abort(abort_all=True) == ["r1", "r2"]
    assert client.health() is ServingStatus.SERVING
    client.wait_until_ready(5)


def test_wait_until_ready_times_out_when_not_serving() -> None:
    with running_fake_server(serving=False) as (target, _), Client(target) as c:
        assert c.health() is ServingStatus.NOT_SERVING
        with pytest.raises(TimeoutError, match="NOT_SERVING"):
            c.wait_until_ready(0.6)


# --- async client -----------------------------------------------------------------------------------------------

async def test_async_client_parity(server: tuple[str, FakeGenerateService]) -> None:
    async with AsyncClient(server[0], timeout=10) as c:
        merged = await c.generate(["p0", "p1"], sampling_params={"n": 2})
        assert [(r.index, r.text) for r in merged] == [(i, expected_text(i)) for i in range(4)]
        deltas = [d async for d in await c.generate("hi", stream=True)]
        assert "".join(d.text for d in deltas) == expected_text(0)
        assert deltas[-1].finish is not None and deltas[-1].finish.reason is FinishReason.STOP_STRING
        with pytest.raises(LmrpcError) as info:
            await c.generate("invalid")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [(v.field, v.description) for v in info.value.field_violations] == [VIOLATION]
        assert (await c.model_info()).vocab_size == 1000
        assert await c.tokenize("ab") == [1, 2]
        assert await c.detokenize([3]) == "w3"
        assert await c.abort(["x"]) == ["x"]
        assert await c.health() is ServingStatus.SERVING
        await c.wait_until_ready(5)


async def test_async_stream_early_exit_cancels(server: tuple[str, FakeGenerateService]) -> None:
    server[1].cancelled.clear()
    async with AsyncClient(server[0]) as c:
        stream = await c.generate("slow", stream=True)
        async for delta in stream:
            assert delta.text == "x"
            break
        await stream.aclose()
    assert server[1].cancelled.wait(10)



# --- transport options (TLS itself is exercised in test_transport.py and tests/e2e/test_tls.py) ---------------

def test_tls_checks_its_arguments(tmp_path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    assert isinstance(tls(), grpc.ChannelCredentials)  # the system's roots, no client certificate
    assert isinstance(tls(ca_cert=pem), grpc.ChannelCredentials)
    with pytest.raises(ValueError, match="client_cert and client_key must be given together"):
        tls(ca_cert=pem, client_cert=pem)
    with pytest.raises(ValueError, match="client_key: the bytes given are not PEM"):
        tls(client_cert=pem, client_key=b"secret")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="is not PEM"):
        tls(ca_cert=not_pem)
    with pytest.raises(FileNotFoundError):
        tls(ca_cert=tmp_path / "missing.pem")


def test_channel_options() -> None:
    assert channel_options() == []
    assert dict(channel_options(keepalive_time=30, keepalive_timeout=5.5, max_message_size=1 << 20)) == {
        "grpc.keepalive_time_ms": 30_000, "grpc.http2.max_pings_without_data": 0,
        "grpc.keepalive_permit_without_calls": 0, "grpc.keepalive_timeout_ms": 5_500,
        "grpc.max_send_message_length": 1 << 20, "grpc.max_receive_message_length": 1 << 20,
    }
    assert dict(channel_options(keepalive_time=10, keepalive_without_calls=True))[
        "grpc.keepalive_permit_without_calls"] == 1
    for bad in ({"keepalive_time": 0}, {"keepalive_timeout": -1}, {"max_message_size": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            channel_options(**bad)


def test_channel_options_override_the_defaults(server: tuple[str, FakeGenerateService]) -> None:
    with Client(server[0], options=channel_options(max_message_size=64), timeout=10) as c:
        assert dict(c._options)["grpc.max_receive_message_length"] == 64  # over the 256 MiB default
        assert dict(c._options)["grpc.initial_reconnect_backoff_ms"] == 200  # other defaults stay
        with pytest.raises(LmrpcError) as err:
            c.tokenize("x" * 100)  # the request is over the client's own send limit
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.health() is ServingStatus.SERVING


def test_client_does_not_import_torch() -> None:
    code = "import sys, lmrpc.client, lmrpc.client.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": ":".join(sys.path)})
