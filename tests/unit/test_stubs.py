"""The committed stubs and the client cover the contract: every RPC has a client method, every SamplingParams field
is accepted by the dict converter, and the client's enums mirror the proto's."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2

from lmrpc.client import AsyncClient, Client, FinishReason, ServingStatus, sampling_params_to_pb
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

# RPC name -> client method name.
CLIENT_METHODS = {"Generate": "generate", "Abort": "abort", "GetModelInfo": "model_info",
                  "Tokenize": "tokenize", "Detokenize": "detokenize", "GetLoad": "get_load",
                  "LoadLoraAdapter": "load_lora_adapter", "UnloadLoraAdapter": "unload_lora_adapter",
                  "ListLoraAdapters": "list_lora_adapters"}


def test_every_rpc_has_a_client_method() -> None:
    service = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"]
    assert sorted(m.name for m in service.methods) == sorted(CLIENT_METHODS)
    stub_attrs = set(vars(generate_pb2_grpc.GenerateServiceServicer))
    for rpc, method in CLIENT_METHODS.items():
        assert rpc in stub_attrs
        assert callable(getattr(Client, method)) and callable(getattr(AsyncClient, method)), rpc


def test_finish_reason_mirrors_the_proto_enum() -> None:
    proto = {v.name.removeprefix("FINISH_REASON_"): v.number for v in generate_pb2.FinishReason.DESCRIPTOR.values}
    assert proto == {r.name: r.value for r in FinishReason}


def test_serving_status_mirrors_grpc_health() -> None:
    proto = {v.name: v.number for v in health_pb2.HealthCheckResponse.ServingStatus.DESCRIPTOR.values}
    assert proto == {s.name: s.value for s in ServingStatus}


# A valid value per scalar field type, and per field that is not a plain scalar.
SAMPLE_BY_TYPE = {FieldDescriptor.TYPE_INT32: 3, FieldDescriptor.TYPE_INT64: 3, FieldDescriptor.TYPE_FLOAT: 0.5,
                  FieldDescriptor.TYPE_BOOL: True, FieldDescriptor.TYPE_STRING: "x"}
SAMPLE_BY_NAME = {"logit_bias": {5: 1.0}, "custom_params": {"a": 1}, "stop": ["x"], "stop_regex": ["x+"],
                  "stop_token_ids": [2]}


@pytest.mark.parametrize("field", list(generate_pb2.SamplingParams.DESCRIPTOR.fields), ids=lambda f: f.name)
def test_every_sampling_field_is_accepted(field: FieldDescriptor) -> None:
    value = SAMPLE_BY_NAME[field.name] if field.name in SAMPLE_BY_NAME else SAMPLE_BY_TYPE[field.type]
    pb = sampling_params_to_pb({field.name: value})
    assert pb.ListFields() and pb.ListFields()[0][0].name == field.name
