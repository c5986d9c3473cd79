"""A real lmrpc-server serving a tiny random Qwen2-MoE checkpoint (`--model DIR`, written by the tiny_moe_dir fixture)
with --enable-return-routed-experts: the routed experts of every position returned equal the top-k of
transformers' router logits; streamed pieces concatenate to the merged data; routed_experts_start_len returns from
there on; 16 concurrent requests equal their solo outputs; GetModelInfo tells the experts."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from lmrpc.v1 import generate_pb2, generate_pb2_grpc

if TYPE_CHECKING:
    from conftest import RunningServer

NEW = 12


@pytest.fixture(scope="module")
def moe_server(launch_server: Callable[..., RunningServer], tiny_moe_dir: Path) -> Iterator[RunningServer]:
    running = launch_server("--model", str(tiny_moe_dir), "--dtype", "float32", "--sampling-defaults", "openai",
                            "--enable-return-routed-experts")
    yield running
    if running.process.poll() is None:
        running.process.kill()
        running.process.wait()


def request(ids: list[int], *, stream: bool = False, start: int | None = None,
            logprobs: bool = False) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(
        input_ids=[generate_pb2.TokenIds(ids=ids)], stream=stream, return_routed_experts=True,
        return_logprob=logprobs, top_logprobs_num=3 if logprobs else 0,
        sampling_params=[generate_pb2.SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)])
    if start is not None:
        req.routed_experts_start_len = start
    return req


def experts(msgs: list[generate_pb2.GenerateResponse]) -> np.ndarray:
    """The routed experts of the messages, concatenated: [positions, moe layers, top_k] int32."""
    parts = [np.frombuffer(m.routed_experts.data, dtype="<i4").reshape(tuple(m.routed_experts.shape))
             for m in msgs if m.HasField("routed_experts")]
    return np.concatenate(parts)


def test_routed_experts_equal_transformers_router_top_k(moe_server: RunningServer, tiny_moe_dir: Path) -> None:
    ids = list(range(500, 531))  # 31 tokens
    with grpc.insecure_channel(moe_server.target) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
        [merged] = list(stub.Generate(request(ids)))
        streamed = list(stub.Generate(request(ids, stream=True)))
        [tail] = list(stub.Generate(request(ids, start=20)))
        [outputs_only] = list(stub.Generate(request(ids, start=len(ids))))
    assert info.architecture == "Qwen2MoeForCausalLM" and info.hidden_size == 64
    assert (info.experts.num_layers, info.experts.num_experts, info.experts.top_k) == (2, 8, 2)
    assert info.experts.return_enabled
    out = list(merged.token_ids)
    got = experts([merged])
    assert got.shape == (len(ids) + NEW - 1, 2, 2) and merged.routed_experts.start_position == 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        result = hf(torch.tensor([ids + out[:-1]]), output_router_logits=True)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert out == ref[0, len(ids):].tolist()
    layers = [logits.reshape(len(ids) + NEW - 1, -1) for logits in result.router_logits if logits is not None]
    assert len(layers) == 2  # the dense third layer routes nothing
    expected = np.stack([torch.topk(logits, 2, dim=-1).indices.numpy() for logits in layers], axis=1)
    np.testing.assert_array_equal(got, expected)
    # Streamed pieces carry only new positions and concatenate to the merged data.
    starts = [m.routed_experts.start_position for m in streamed if m.HasField("routed_experts")]
    assert len(starts) > 2 and starts[0] == 0
    np.testing.assert_array_equal(experts(streamed), got)
    # From routed_experts_start_len on (positions before it may be reused from the prefix cache).
    assert tail.routed_experts.start_position == 20
    np.testing.assert_array_equal(experts([tail]), got[20:])
    assert tail.usage.cached_tokens == 20
    assert outputs_only.routed_experts.start_position == len(ids)
    np.testing.assert_array_equal(experts([outputs_only]), got[len(ids):])


def test_sixteen_concurrent_moe_requests_equal_their_solo_outputs(moe_server: RunningServer) -> None:
    prompts = [list(range(900 + 41 * i, 900 + 41 * i + 4 + 5 * i)) for i in range(16)]
    with grpc.insecure_channel(moe_server.target) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)

        def run(ids: list[int]) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]]], bytes]:
            [msg] = list(stub.Generate(request(ids, logprobs=True)))
            lps = [(p.chosen.logprob, [(t.token_id, t.logprob) for t in p.top]) for p in msg.output_logprobs]
            return list(msg.token_ids), lps, msg.routed_experts.data

        solo = [run(p) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            together = list(pool.map(run, prompts))
    assert together == solo  # tokens, logprobs and routed experts, bitwise
