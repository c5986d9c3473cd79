"""The contract from outside Python: `buf curl` (Go gRPC, schema from server reflection, no proto files) against a
real server, asserting on its protobuf-JSON output."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.rpc import error_details_pb2

pytestmark = pytest.mark.e2e


def _buf() -> str:
    """The buf of the venv (buf-bin, a dev requirement), else one on PATH."""
    venv_buf = Path(sys.executable).parent / "buf"
    found = str(venv_buf) if venv_buf.is_file() else shutil.which("buf")
    assert found, "buf not found: install the dev requirements (buf-bin)"
    return found


def buf_curl(server: Any, method: str, data: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    command = [_buf(), "curl", "--protocol", "grpc", "--http2-prior-knowledge", "--reflect", "--connect-timeout", "30"]
    if data is not None:
        command += ["--data", json.dumps(data)]
    command.append(f"http://{server.target}/{method}")
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def json_documents(text: str) -> list[dict[str, Any]]:
    """buf curl prints one JSON document per response message, one after another."""
    decoder, documents, at = json.JSONDecoder(), [], 0
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        document, at = decoder.raw_decode(text, at)
        documents.append(document)
    return documents


def ok_documents(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert done.returncode == 0, f"buf curl failed (exit {done.returncode}):\n{done.stderr}"
    return json_documents(done.stdout)


def test_get_model_info(server: Any) -> None:
    [info] = ok_documents(buf_curl(server, "lmrpc.v1.GenerateService/GetModelInfo", {}))
    assert info["servedModelName"] == "SmolLM2-135M-Instruct"
    assert info["vocabSize"] == 49152
    assert info["maxContextLength"] == 8192
    assert info["eosTokenIds"] == [2]
    assert info["architecture"] == "LlamaForCausalLM"
    # The session server runs with --sampling-defaults openai.
    defaults = info["defaultSamplingParams"]
    assert defaults["temperature"] == 1 and defaults["topP"] == 1 and defaults["topK"] == -1
    assert defaults["maxNewTokens"] == 128


def test_generate_stream(server: Any) -> None:
    request = {
        "text": ["The capital of France is"],
        "samplingParams": [{"maxNewTokens": 4, "temperature": 0}],
        "stream": True,
    }
    messages = ok_documents(buf_curl(server, "lmrpc.v1.GenerateService/Generate", request))
    assert len(messages) > 1
    *deltas, last = messages
    assert all("finish" not in d and "usage" not in d for d in deltas)
    assert last["finish"]["reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS")
    assert len({m["rid"] for m in messages}) == 1
    assert all(m.get("index", 0) == 0 for m in messages)  # proto3 JSON leaves out the default 0
    token_ids = [t for m in messages for t in m.get("tokenIds", [])]
    assert last["usage"]["completionTokens"] == len(token_ids) <= 4
    assert last["usage"]["promptTokens"] > 0
    assert "Paris" in "".join(m.get("text", "") for m in messages)


def test_invalid_argument_carries_bad_request(server: Any) -> None:
    request = {"text": ["hi"], "samplingParams": [{"temperature": -1}]}
    done = buf_curl(server, "lmrpc.v1.GenerateService/Generate", request)
    assert done.returncode == 3 << 3, f"expected INVALID_ARGUMENT (exit 24), got {done.returncode}:\n{done.stderr}"
    [error] = json_documents(done.stderr)
    assert error["code"] == "invalid_argument"
    assert "sampling_params[0].temperature" in error["message"]
    [detail] = error["details"]
    assert detail["type"] == "google.rpc.BadRequest"
    value = detail["value"]
    bad_request = error_details_pb2.BadRequest.FromString(base64.b64decode(value + "=" * (-len(value) % 4)))
    assert [v.field for v in bad_request.field_violations] == ["sampling_params[0].temperature"]


def test_complete_reads_like_openai(server: Any) -> None:
    # The request is OpenAI's JSON as is (a string prompt is a list of one); the response's names are OpenAI's too.
    request = {"model": "SmolLM2-135M-Instruct", "prompt": ["The capital of France is"], "max_tokens": 4,
               "temperature": 0, "logprobs": 1, "echo": True}
    [completion] = ok_documents(buf_curl(server, "lmrpc.v1.OpenAIService/Complete", request))
    assert completion["object"] == "text_completion" and completion["id"].startswith("cmpl-")
    [choice] = completion["choices"]
    assert choice["text"].startswith("The capital of France is") and "Paris" in choice["text"]
    assert choice["finish_reason"] in ("COMPLETION_FINISH_REASON_LENGTH", "COMPLETION_FINISH_REASON_STOP")
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["text_offset"][0] == 0
    assert "".join(logprobs["tokens"]) == choice["text"]
    usage = completion["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_complete_streams_like_openai(server: Any) -> None:
    request = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}}
    *chunks, usage = ok_documents(buf_curl(server, "lmrpc.v1.OpenAIService/ChatComplete", request))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = "".join(c["choices"][0].get("delta", {}).get("content", "") for c in chunks)
    assert content and "finish_reason" in chunks[-1]["choices"][0]
    assert "choices" not in usage and usage["usage"]["completion_tokens"] <= 6


def test_openai_invalid_argument_names_the_field(server: Any) -> None:
    done = buf_curl(server, "lmrpc.v1.OpenAIService/ChatComplete", {"messages": [{"role": "robot"}]})
    assert done.returncode == 3 << 3, f"expected INVALID_ARGUMENT (exit 24), got {done.returncode}:\n{done.stderr}"
    [error] = json_documents(done.stderr)
    value = error["details"][0]["value"]
    bad_request = error_details_pb2.BadRequest.FromString(base64.b64decode(value + "=" * (-len(value) % 4)))
    assert [v.field for v in bad_request.field_violations] == ["messages[0].role"]


@pytest.mark.parametrize("service", ["", "lmrpc.v1.GenerateService", "lmrpc.v1.OpenAIService"])
def test_health_check(server: Any, service: str) -> None:
    [reply] = ok_documents(buf_curl(server, "grpc.health.v1.Health/Check", {"service": service}))
    assert reply == {"status": "SERVING"}
