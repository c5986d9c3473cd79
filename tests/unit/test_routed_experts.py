"""return_routed_experts refused where it cannot work, through the real GenerateService on an in-process server:
a server without --enable-return-routed-experts is FAILED_PRECONDITION naming the flag; a dense model, a
routed_experts_start_len without the flag or out of range are INVALID_ARGUMENT naming the field. (What it returns is
tests/e2e/test_moe_server.py.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from inprocess_service import engine_config, served

from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.v1 import generate_pb2, generate_pb2_grpc


def request(*, routed: bool = True, start: int | None = None) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(
        input_ids=[generate_pb2.TokenIds(ids=[300, 301, 302])], return_routed_experts=routed,
        sampling_params=[generate_pb2.SamplingParams(max_new_tokens=2, temperature=0.0)])
    if start is not None:
        req.routed_experts_start_len = start
    return req


async def refused(stub: generate_pb2_grpc.GenerateServiceStub, req: generate_pb2.GenerateRequest
                  ) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(req):
            pass
    return info.value


async def test_refusals_name_why(tiny_moe_dir: Path, tiny_llama_dir: Path) -> None:
    config = engine_config(str(tiny_moe_dir), "float32")
    engine = AsyncEngine.start(config)
    try:
        async with served(engine, config) as stub:  # without the flag
            err = await refused(stub, request())
            assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "--enable-return-routed-experts" in (err.details() or "")
            info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
            assert info.experts.num_experts == 8 and not info.experts.return_enabled
        enabled = replace(config, enable_return_routed_experts=True)
        async with served(engine, enabled) as stub:
            for req, field in ((request(routed=False, start=1), "routed_experts_start_len"),
                               (request(start=4), "routed_experts_start_len"),
                               (request(start=-1), "routed_experts_start_len")):
                err = await refused(stub, req)
                assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and field in (err.details() or "")
            [msg] = [m async for m in stub.Generate(request(start=3))]
            assert list(msg.routed_experts.shape) == [1, 2, 2] and msg.routed_experts.start_position == 3
    finally:
        engine.shutdown()
    dense_config = replace(engine_config(str(tiny_llama_dir), "float32"), enable_return_routed_experts=True)
    dense = AsyncEngine.start(dense_config)
    try:
        async with served(dense, dense_config) as stub:
            err = await refused(stub, request())
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "return_routed_experts" in (err.details() or "") and "no experts" in (err.details() or "")
            info = await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
            assert not info.HasField("experts")
    finally:
        dense.shutdown()
