"""lmrpc-server behind SGLang's model gateway: the real `smg launch --worker-urls grpc://...` (smg 1.13.0) in front of
the shared e2e server (the bundled SmolLM2), called with the `openai` SDK. The gateway registers the worker over
SglangScheduler (its tokenizer from the directory the worker reports), a greedy chat completion through it equals
lmrpc's own ChatComplete, streamed and merged; a client that leaves a stream frees the worker's engine (SMG's
Abort); a request the worker refuses INVALID_ARGUMENT is the gateway's 400."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from conftest import RunningServer

from lmrpc.client import Client
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.e2e

SMG = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gateway(server: RunningServer) -> Iterator[str]:
    """SMG on a free port routing to the e2e server; its OpenAI base URL once it answers for the model (it lists
    the model before its tokenizer is registered, answering 503 meanwhile)."""
    if not Path(SMG).exists():
        pytest.skip("smg is not installed (pip install smg==1.13.0: requirements-dev.txt)")
    port = free_port()
    process = subprocess.Popen(
        [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
         "--worker-urls", f"grpc://{server.target}", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=10)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=1)
                break
            except (openai.APIConnectionError, openai.NotFoundError, openai.InternalServerError):
                pass
            if process.poll() is not None:
                raise RuntimeError(f"smg exited with {process.returncode}")
            time.sleep(0.5)
        else:
            raise RuntimeError("smg did not register the worker within 120 s")
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture
def sdk(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway, api_key="none", max_retries=0, timeout=120)


def test_greedy_chat_equals_lmrpcs_own(sdk: openai.OpenAI, server: RunningServer) -> None:
    messages: Any = [{"role": "user", "content": QUESTION}]  # (the SDK's typed dicts)
    answer = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
    with Client(server.target) as lmrpc:
        own = lmrpc.chat(QUESTION, temperature=0, max_tokens=32)
    [choice], [own_choice] = answer.choices, own.choices
    assert choice.message.content == own_choice.message.content and "Paris" in (choice.message.content or "")
    assert answer.usage is not None and own.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (own.usage.prompt_tokens,
                                                                            own.usage.completion_tokens)
    streamed: Any = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32,
                                                stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == own_choice.message.content


def running_outputs(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        load = generate_pb2_grpc.GenerateServiceStub(channel).GetLoad(generate_pb2.GetLoadRequest(), timeout=10)
    return int(load.running_outputs + load.waiting_outputs)


def test_a_client_that_leaves_frees_the_engine(sdk: openai.OpenAI, server: RunningServer) -> None:
    stream = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}], temperature=0, max_tokens=3000,
        stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    assert running_outputs(server.target) == 1
    stream.close()  # the gateway sees the client gone and sends Abort (or cancels the call)
    deadline = time.monotonic() + 20
    while running_outputs(server.target) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running_outputs(server.target) == 0


def test_invalid_argument_is_400(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                    extra_body={"regex": "("})
    assert "sampling_params.regex" in str(err.value)
