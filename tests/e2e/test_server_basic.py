"""Issue 2's acceptance over a real server with the real SmolLM2 model."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lmrpc.client import Client, FinishReason
from lmrpc.server.models.linear import resolve_dtype
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.e2e

GREEDY = {"max_new_tokens": 16, "temperature": 0}


def test_stream_real_text(client: Client) -> None:
    deltas = list(client.generate("The capital of France is", sampling_params=GREEDY, stream=True))
    text = "".join(d.text for d in deltas)
    assert "Paris" in text
    assert len(deltas) > 1
    assert deltas[-1].finish is not None


def test_non_stream_one_message_per_index(server) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            text=["Hello", "The sky is"],
            sampling_params=[generate_pb2.SamplingParams(max_new_tokens=8, temperature=0.0, n=2)],
        )
        messages = list(stub.Generate(request))
    assert sorted(m.index for m in messages) == [0, 1, 2, 3]
    for m in messages:
        assert m.finish.reason != generate_pb2.FINISH_REASON_UNSPECIFIED
        assert m.usage.completion_tokens == len(m.token_ids) > 0
        assert m.usage.prompt_tokens > 0


def test_greedy_stream_equals_non_stream(client: Client) -> None:
    streamed = "".join(d.text for d in client.generate("Once upon a time", sampling_params=GREEDY, stream=True))
    [merged] = client.generate("Once upon a time", sampling_params=GREEDY)
    assert streamed == merged.text


def test_tokenize_detokenize_round_trip(client: Client) -> None:
    text = "Hello, world! Ünïcödé 東京 🙂"
    ids = client.tokenize(text)
    assert ids and client.detokenize(ids) == text


def test_model_info(client: Client) -> None:
    info = client.model_info()
    # the bundled GGUF served as it is: Q4_1 layers, the Q8_0 tied embedding/output projection; --dtype auto is
    # bfloat16 where this host multiplies it natively, else float32
    auto = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    assert info.quantization == "int4" and info.weight_formats == ["q4_1", "q8_0"] and info.dtype == auto
    assert info.vocab_size == 49152
    assert info.max_context_length == 8192
    assert list(info.eos_token_ids) == [2]


def test_health_serving_and_reflection(server) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "lmrpc.v1.GenerateService", "lmrpc.v1.OpenAIService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in answer.list_services_response.service}
    assert {"lmrpc.v1.GenerateService", "lmrpc.v1.OpenAIService", "grpc.health.v1.Health"} <= names


def test_invalid_argument_names_field_and_server_keeps_serving(client: Client) -> None:
    from lmrpc.client import LmrpcError

    with pytest.raises(LmrpcError) as err:
        client.generate("hi", sampling_params={"top_p": 1.5})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in str(err.value)
    assert any("top_p" in v.field for v in err.value.field_violations)
    [ok] = client.generate("hi", sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert ok.finish is not None and ok.finish.reason in (FinishReason.LENGTH, FinishReason.EOS)


@pytest.mark.parametrize("field", ["image_data", "audio_data"])
def test_media_on_the_text_only_model_is_refused_naming_the_item(server, field: str) -> None:
    """SmolLM2 takes text only: an image or audio item is INVALID_ARGUMENT naming it, before anything is fetched
    (the URL is never read: example.com is not reachable from here)."""
    request = generate_pb2.GenerateRequest(text=["hi"])
    getattr(request, field).add().items.add().url = "https://example.com/x"
    with grpc.insecure_channel(server.target) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field}[0].items[0]" in (err.value.details() or "")
    assert "takes no" in (err.value.details() or "")


def test_input_embeds_are_checked_against_the_served_model(server) -> None:
    """SmolLM2's hidden size is 576: a narrower row, or a prompt given both as text and embeddings, is refused with
    the field named (the bitwise equality with token prompts is tests/unit/test_input_embeds.py)."""
    narrow = generate_pb2.GenerateRequest()
    narrow.input_embeds.add().positions.add().values.extend([0.5] * 575)
    both = generate_pb2.GenerateRequest(text=["hi"])
    both.input_embeds.add().positions.add().values.extend([0.5] * 576)
    good = generate_pb2.GenerateRequest(sampling_params=[generate_pb2.SamplingParams(max_new_tokens=3)])
    good.input_embeds.add().positions.extend([generate_pb2.Embedding(values=[0.01 * (i % 7)] * 576)
                                              for i in range(5)])
    with grpc.insecure_channel(server.target) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
        assert info.hidden_size == 576 and info.accepts_input_embeds
        for request, field in ((narrow, "input_embeds[0].positions[0].values"), (both, "input_embeds")):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in (err.value.details() or "")
        [out] = list(stub.Generate(good))
    assert len(out.token_ids) == 3 and out.usage.prompt_tokens == 5


def test_hidden_states_through_the_server(server) -> None:
    """Streamed hidden states concatenate to the merged ones (bitwise); LAST mode is one vector, the last of them."""
    def req(stream: bool, mode: int = 0) -> generate_pb2.GenerateRequest:
        return generate_pb2.GenerateRequest(
            text=["Name three colours:"], stream=stream, return_hidden_states=True,
            hidden_states_mode=mode,  # type: ignore[arg-type]
            sampling_params=[generate_pb2.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)])

    def vectors(msgs: list[generate_pb2.GenerateResponse]) -> list[list[float]]:
        return [list(e.values) for m in msgs for e in m.hidden_states]

    with grpc.insecure_channel(server.target) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        [merged] = list(stub.Generate(req(False)))
        streamed = list(stub.Generate(req(True)))
        [last] = list(stub.Generate(req(False, generate_pb2.HIDDEN_STATES_MODE_LAST)))
    full = vectors([merged])
    assert len(full) == merged.usage.prompt_tokens + merged.usage.completion_tokens - 1
    assert all(len(v) == 576 for v in full)
    assert vectors(streamed) == full
    assert vectors([last]) == full[-1:]


def test_routed_experts_on_a_dense_model_are_invalid(server) -> None:
    request = generate_pb2.GenerateRequest(text=["hi"], return_routed_experts=True)
    with grpc.insecure_channel(server.target) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request))
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "return_routed_experts" in (err.value.details() or "") and "no experts" in (err.value.details() or "")
    assert not info.HasField("experts")
