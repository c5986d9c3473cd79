"""Scale-out behind the real SMG (smg 1.13.0): scripts/cluster.sh starts two lmrpc-server replicas of the bundled
model (at most 2 running outputs and none queued each, so a full replica is reachable) and `smg launch --policy
cache_aware` in front, which subscribes to their KV events; every call goes through the `openai` SDK on SMG's HTTP
port. Greedy chat and completions, streamed and merged, equal lmrpc's own ChatComplete/Complete on a replica; n = 2,
logprobs and stops pass through; requests sharing a 256-token prefix land on one replica and are served from its
prefix cache; a client that leaves frees the replica's engine; a killed replica loses no later request; a full
replica's RESOURCE_EXHAUSTED is served by the other. One cluster for the module; the kill test runs last."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from lmrpc.client import Client, LmrpcError
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SMG = ROOT / ".venv" / "bin" / "smg"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
MAX_RUNNING = 2  # per replica; with no queue, a third output is RESOURCE_EXHAUSTED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    pid: int
    target: str  # host:port of its gRPC server
    metrics: str  # host:port of its /metrics
    alive: bool = True


@dataclass
class Cluster:
    process: subprocess.Popen[str]
    base: str  # SMG's OpenAI base URL
    replicas: list[Replica]
    output: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not SMG.exists():
        pytest.skip("smg is not installed (pip install smg==1.13.0: requirements-dev.txt)")
    logs = tmp_path_factory.mktemp("cluster")
    process = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "cluster.sh"), "-n", "2", "--port", str(free_port()),
         "--smg-arg", "--log-level", "--smg-arg", "warn", "--",
         "--max-running-requests", str(MAX_RUNNING), "--max-queued-requests", "0", "--sampling-defaults", "openai",
         "--kv-cache-tokens", "16384",
         "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "LMRPC_CLUSTER_LOGS": str(logs), "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    pids: dict[int, tuple[int, str]] = {}
    base = ""
    for line in process.stdout:
        if m := re.match(r"cluster: worker (\d+) pid (\d+) grpc://(\S+)", line):
            pids[int(m[1])] = (int(m[2]), m[3])
        if m := re.match(r"cluster: ready (\S+)", line):
            base = m[1]
            break
    if not base:
        process.wait(timeout=60)
        raise RuntimeError(f"cluster.sh did not start: {[p.read_text()[-2000:] for p in logs.iterdir()]}")
    replicas = []
    for i in sorted(pids):
        log = (logs / f"worker{i}.log").read_text()
        metrics = re.search(r"lmrpc-server metrics on \S+:(\d+)", log)
        assert metrics is not None
        replicas.append(Replica(pids[i][0], pids[i][1], f"127.0.0.1:{metrics[1]}"))
    running = Cluster(process, base, replicas)
    threading.Thread(target=lambda: running.output.extend(process.stdout or ()), daemon=True).start()
    yield running
    process.send_signal(signal.SIGTERM)  # cluster.sh stops SMG and the replicas it started
    try:
        process.wait(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()


@pytest.fixture
def sdk(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base, api_key="none", max_retries=0, timeout=300)


def finished_outputs(replica: Replica) -> int:
    """lmrpc:requests_total summed over finish reasons: the outputs this replica finished."""
    text = urllib.request.urlopen(f"http://{replica.metrics}/metrics", timeout=10).read().decode()
    return int(sum(float(v) for v in re.findall(r"^lmrpc:requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE)))


def in_flight(replica: Replica) -> int:
    with grpc.insecure_channel(replica.target) as channel:
        load = generate_pb2_grpc.GenerateServiceStub(channel).GetLoad(generate_pb2.GetLoadRequest(), timeout=10)
    return int(load.running_outputs + load.waiting_outputs)


def live(cluster: Cluster) -> list[Replica]:
    return [r for r in cluster.replicas if r.alive]


# ---- equal to lmrpc's own OpenAI service -------------------------------------------------------------------------


def test_chat_equals_lmrpcs_own_streamed_and_merged(cluster: Cluster, sdk: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": QUESTION}]
    answer = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    with Client(cluster.replicas[0].target) as lmrpc:
        own = lmrpc.chat(QUESTION, temperature=0, max_tokens=24)
    assert answer.choices[0].message.content == own.choices[0].message.content
    assert answer.usage is not None and own.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (own.usage.prompt_tokens,
                                                                            own.usage.completion_tokens)
    streamed: Any = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                                stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == own.choices[0].message.content


def test_completion_equals_lmrpcs_own_streamed_and_merged(cluster: Cluster, sdk: openai.OpenAI) -> None:
    prompt = "The three primary colors are"
    answer = sdk.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
    with Client(cluster.replicas[1].target) as lmrpc:
        own = lmrpc.complete(prompt, temperature=0, max_tokens=24)
    assert answer.choices[0].text == own.choices[0].text and answer.choices[0].text
    streamed = sdk.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == own.choices[0].text


def test_n2_and_stops(cluster: Cluster, sdk: openai.OpenAI) -> None:
    prompt = "Count: one, two, three, four,"
    two = sdk.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.choices[0].text == two.choices[1].text  # greedy: both samples agree
    with Client(cluster.replicas[0].target) as lmrpc:
        own = lmrpc.complete(prompt, temperature=0, max_tokens=8)
    full = own.choices[0].text
    assert two.choices[0].text == full
    words = full.split()
    assert len(words) >= 3
    for stop in (",", f" {words[1]}"):  # one token, then a word's several characters
        cut = sdk.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == full[:full.index(stop)]


@pytest.mark.xfail(strict=True, reason=(
    "SMG's gRPC router never maps logprobs for /v1/completions. Measured with smg 1.13.0: it sends "
    "return_logprob=true and top_logprobs_num=2, the worker answers output_logprobs on every chunk and on the "
    "GenerateComplete, and SMG answers choices[0].logprobs = None (chat completions do carry them). In smg's "
    "source, model_gateway/src/routers/grpc/regular/processor.rs, "
    "ResponseProcessor::process_non_streaming_completion_response sets "
    "`logprobs: None, // TODO: wire legacy LogProbs from backend token_logprobs`, and regular/streaming.rs, "
    "StreamingProcessor::process_completion_streaming_chunks, drops them (`_request_logprobs`, a TODO)"))
def test_logprobs_equal_lmrpcs_own(cluster: Cluster, sdk: openai.OpenAI) -> None:
    prompt = "Count: one, two, three, four,"
    answer = sdk.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=2)
    with Client(cluster.replicas[0].target) as lmrpc:
        own = lmrpc.complete(prompt, temperature=0, max_tokens=8, logprobs=2)
    lp, own_lp = answer.choices[0].logprobs, own.choices[0].logprobs
    assert lp is not None and own_lp is not None and lp.tokens == own_lp.tokens
    assert lp.token_logprobs is not None and own_lp.token_logprobs is not None
    assert lp.token_logprobs == pytest.approx(own_lp.token_logprobs, abs=1e-4)


# ---- routing ------------------------------------------------------------------------------------------------------


def test_a_shared_prefix_lands_on_one_replica_and_is_served_from_its_cache(cluster: Cluster,
                                                                          sdk: openai.OpenAI) -> None:
    # SMG takes text prompts only: 256 tokens' text, each request adding its own question after it
    with Client(cluster.replicas[0].target) as lmrpc:
        ids = lmrpc.tokenize(" ".join(f"Fact {i}: the sky over field {i} was clear." for i in range(40)))
        prefix = lmrpc.detokenize(ids[:256])
    before = [finished_outputs(r) for r in cluster.replicas]
    cached: list[int] = []
    for i in range(10):
        answer = sdk.completions.create(model=MODEL, prompt=f"{prefix} Question {i}:", temperature=0, max_tokens=2)
        assert answer.usage is not None and answer.usage.prompt_tokens >= 256
        details = answer.usage.prompt_tokens_details
        cached.append(details.cached_tokens or 0 if details is not None else -1)
    landed = [finished_outputs(r) - b for r, b in zip(cluster.replicas, before, strict=True)]
    assert sum(landed) == 10 and max(landed) >= 9, f"landed per replica: {landed}"
    assert all(c >= 240 for c in cached[1:]), f"cached tokens per request: {cached}"


def test_a_client_that_leaves_frees_the_replica(cluster: Cluster, sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}], temperature=0, max_tokens=3000,
        stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    assert sum(in_flight(r) for r in live(cluster)) == 1
    stream.close()
    deadline = time.monotonic() + 20
    while sum(in_flight(r) for r in live(cluster)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(in_flight(r) for r in live(cluster)) == 0


def test_a_full_replica_refuses_and_the_other_serves(cluster: Cluster, sdk: openai.OpenAI) -> None:
    """Replica 0 is filled with its own callers (SMG does not see them); every request through SMG is served,
    whichever replica it picks first: a RESOURCE_EXHAUSTED from replica 0 is retried on replica 1."""
    full = cluster.replicas[0]
    stop = threading.Event()
    with Client(full.target) as lmrpc, ThreadPoolExecutor(MAX_RUNNING) as pool:

        def occupy() -> None:
            for _ in lmrpc.complete("Once upon a time", stream=True, max_tokens=3000, temperature=0,
                                    ignore_eos=True):
                if stop.is_set():
                    return

        holders = [pool.submit(occupy) for _ in range(MAX_RUNNING)]
        try:
            deadline = time.monotonic() + 60
            while in_flight(full) < MAX_RUNNING and time.monotonic() < deadline:
                time.sleep(0.1)
            with pytest.raises(LmrpcError) as refused:  # the replica itself is at capacity
                lmrpc.complete("Hi", max_tokens=1)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            before = finished_outputs(cluster.replicas[1])
            for i in range(4):
                answer = sdk.completions.create(model=MODEL, prompt=f"Request {i}: hello", temperature=0,
                                                max_tokens=2)
                assert answer.choices[0].text is not None
            assert finished_outputs(cluster.replicas[1]) - before == 4
        finally:
            stop.set()
            for holder in holders:
                holder.exception(timeout=120)


def test_killing_a_replica_loses_no_later_request(cluster: Cluster, sdk: openai.OpenAI) -> None:
    """Runs last in this module: replica 1 is killed (SIGKILL, as a crash) between requests."""
    victim = cluster.replicas[1]
    results: list[str] = []
    for i in range(3):
        results.append(sdk.completions.create(model=MODEL, prompt=f"Warm {i}", max_tokens=2, temperature=0)
                       .choices[0].text)
    os.kill(victim.pid, signal.SIGKILL)
    victim.alive = False
    before = finished_outputs(cluster.replicas[0])
    for i in range(8):
        answer = sdk.completions.create(model=MODEL, prompt=f"After {i}", max_tokens=2, temperature=0)
        results.append(answer.choices[0].text)
    assert finished_outputs(cluster.replicas[0]) - before == 8
    assert len(results) == 11
