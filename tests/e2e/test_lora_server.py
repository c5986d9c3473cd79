"""LoRA adapters on a real server (the tiny random Llama, adapters made with peft at test time): lora_path and
"base:adapter", the lifecycle RPCs, eviction under --max-loaded-loras 2 with 4 adapters in rotation, unload while a
request is in flight, and every error status, the server serving on after each; the `lmrpc lora` CLI against it, and
a server without --enable-lora-admin."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from lora_adapters import make_adapter

from lmrpc.client import Client, FinishReason, LmrpcError
from lmrpc.client.cli import main as cli

if TYPE_CHECKING:
    from conftest import RunningServer

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> tuple[Path, Path]:
    """(root, modules): r1..r4 under the root (loaded by path), big (rank 32) under it too; m1 outside it (loaded
    at start only)."""
    root = tmp_path_factory.mktemp("lora-root")
    modules = tmp_path_factory.mktemp("lora-modules")
    for i in range(1, 5):
        make_adapter(tiny_llama_dir, root / f"r{i}", rank=4 * i, seed=10 + i)
    make_adapter(tiny_llama_dir, root / "big", rank=32, seed=20)
    make_adapter(tiny_llama_dir, modules / "m1", rank=8, seed=30)
    return root, modules


@pytest.fixture(scope="module")
def lora_server(launch_server: Callable[..., RunningServer], tiny_llama_dir: Path,
                adapters: tuple[Path, Path]) -> Iterator[RunningServer]:
    root, modules = adapters
    running = launch_server(
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--sampling-defaults", "openai",
        "--lora-modules", f"m1={modules / 'm1'}", "--lora-root", str(root), "--max-loaded-loras", "2",
        "--max-lora-rank", "16", "--enable-lora-admin", "--kv-cache-tokens", "16384", "--metrics-port", "0")
    yield running
    assert running.stop() == 0


@pytest.fixture()
def lc(lora_server: RunningServer) -> Iterator[Client]:
    with Client(lora_server.target) as c:
        yield c


def _tokens(client: Client, prompt: str, adapter: str | None) -> list[int]:
    [result] = client.generate(prompt, sampling_params=GREEDY, lora_path=adapter)
    return result.token_ids


def _error(call: Callable[[], object]) -> LmrpcError:
    with pytest.raises(LmrpcError) as err:
        call()
    return err.value


def test_adapters_change_outputs_and_base_adapter_model_names_one(lc: Client) -> None:
    [base] = lc.generate("Once upon a time", sampling_params=GREEDY)
    [m1] = lc.generate("Once upon a time", sampling_params=GREEDY, lora_path="m1")
    assert m1.token_ids != base.token_ids
    served = lc.model_info().served_model_name
    completion = lc.complete(prompt="Once upon a time", model=f"{served}:m1", max_tokens=8, temperature=0,
                             ignore_eos=True)
    assert completion.model == f"{served}:m1"
    assert completion.choices[0].text == m1.text  # the same adapter by either name
    plain = lc.complete(prompt="Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)
    assert plain.choices[0].text == base.text
    assert [a.name for a in lc.list_lora_adapters()] == ["m1"]
    assert "m1" in lc.model_info().lora_adapters


def test_metrics_count_requests_and_tokens_by_adapter(lc: Client, lora_server: RunningServer) -> None:
    lc.generate(["x", "y"], sampling_params=GREEDY, lora_path="m1")

    def scrape() -> str:
        with urllib.request.urlopen(f"http://{lora_server.metrics_target}/metrics", timeout=10) as response:
            return str(response.read().decode())

    text = scrape()
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line and not line.startswith("#")}
    assert lines['lmrpc:lora_requests_total{adapter="m1"}'] >= 2
    assert lines['lmrpc:lora_generation_tokens_total{adapter="m1"}'] >= 16
    assert lines["lmrpc:lora_adapters_loaded"] >= 1


def test_errors_name_the_problem_and_the_server_serves_on(lc: Client) -> None:
    err = _error(lambda: lc.generate("hi", sampling_params=GREEDY, lora_path="nope"))
    assert err.code == grpc.StatusCode.NOT_FOUND and "'nope'" in err.message and "'m1'" in err.message
    err = _error(lambda: lc.generate("hi", sampling_params=GREEDY, lora_path="../lora-modules0/m1"))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED and "--lora-root" in err.message
    err = _error(lambda: lc.generate("hi", sampling_params=GREEDY, lora_path="big"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-lora-rank" in err.message
    err = _error(lambda: lc.generate(["a", "b", "c"], sampling_params=GREEDY, lora_path=["m1", "m1"]))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "lora_path" in err.message
    served = lc.model_info().served_model_name
    err = _error(lambda: lc.complete(prompt="hi", model=f"{served}:nope", max_tokens=2))
    assert err.code == grpc.StatusCode.NOT_FOUND and "'nope'" in err.message
    err = _error(lambda: lc.load_lora_adapter("m1", "r1"))
    assert err.code == grpc.StatusCode.ALREADY_EXISTS
    err = _error(lambda: lc.load_lora_adapter("x", "/etc"))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED
    err = _error(lambda: lc.unload_lora_adapter("never-loaded"))
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert len(_tokens(lc, "hi", None)) == 8 and len(_tokens(lc, "hi", "m1")) == 8


def test_four_adapters_rotate_through_two_slots(lc: Client) -> None:
    prompts = [f"Story number {i}:" for i in range(8)]
    names = ["r1", "r2", "r3", "r4"]
    alone = {(p, n): _tokens(lc, p, n) for p in prompts[:2] for n in names}  # one at a time: loads and evictions
    assert len({tuple(t) for t in alone.values()}) > 2  # the adapters differ (random weights: some outputs agree)
    names_loaded = [a.name for a in lc.list_lora_adapters()]
    assert "m1" in names_loaded and len(names_loaded) == 2  # m1 pinned (loaded at start); never more than the limit
    jobs = [(p, n) for p in prompts[:2] for n in names] * 2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: _tokens(lc, job[0], job[1]), jobs))
    for job, tokens in zip(jobs, got, strict=True):
        assert tokens == alone[job], job
    loaded = lc.list_lora_adapters()  # requests for a third adapter waited for a slot rather than exceed the limit
    assert len(loaded) == 2 and "m1" in {a.name for a in loaded} and all(a.in_use == 0 for a in loaded)


def test_unload_in_flight_lets_the_request_finish(lc: Client) -> None:
    loaded = lc.load_lora_adapter("u1", "r1")  # a name of its own: after the unload, no directory answers to it
    assert loaded.name == "u1" and loaded.rank == 4 and loaded.in_use == 0
    expected = _tokens(lc, "A long tale", "u1")
    long_params = {**GREEDY, "max_new_tokens": 200}
    started = threading.Event()
    outcome: list[object] = []

    def run() -> None:
        tokens: list[int] = []
        finish = None
        for delta in lc.generate("A long tale", sampling_params=long_params, lora_path="u1", stream=True):
            tokens.extend(delta.token_ids)
            started.set()
            finish = delta.finish or finish
        outcome.extend([tokens, finish])

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    assert any(a.name == "u1" and a.in_use == 1 for a in lc.list_lora_adapters())
    # m1 (pinned) and u1 (in use) fill --max-loaded-loras 2: an admin load fails at once rather than wait
    err = _error(lambda: lc.load_lora_adapter("u2", "r2"))
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-loaded-loras" in err.message
    lc.unload_lora_adapter("u1")
    thread.join(120)
    tokens, finish = outcome
    assert isinstance(tokens, list) and len(tokens) == 200 and tokens[:8] == expected
    assert finish is not None and finish.reason is FinishReason.LENGTH  # type: ignore[attr-defined]
    err = _error(lambda: lc.generate("hi", sampling_params=GREEDY, lora_path="u1"))
    assert err.code == grpc.StatusCode.NOT_FOUND and "'u1'" in err.message
    assert all(a.name != "u1" for a in lc.list_lora_adapters())


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_lora_load_list_generate_unload(lc: Client, lora_server: RunningServer,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    target = ("--target", lora_server.target)
    code, out, err = _cli(capsys, "lora", "load", "c1", "r3", *target)
    assert code == 0, err
    assert out.startswith("c1\t") and "\trank 12\t" in out and "in use 0" in out
    code, out, _ = _cli(capsys, "lora", "list", *target)
    listed = [line.split("\t")[0] for line in out.splitlines()]
    assert code == 0 and "c1" in listed and "m1" in listed
    code, out, _ = _cli(capsys, "lora", "list", "--json", *target)
    assert code == 0 and [json.loads(line)["name"] for line in out.splitlines()] == listed
    code, out, err = _cli(capsys, "generate", "Once upon a time", "--lora", "c1", "--max-new-tokens", "8",
                          "--temperature", "0", "--ignore-eos", *target)
    [expected] = lc.generate("Once upon a time", sampling_params=GREEDY, lora_path="c1")
    assert code == 0 and out == expected.text + "\n", err
    code, out, err = _cli(capsys, "lora", "unload", "c1", *target)
    assert code == 0 and out == "" and err == ""
    assert "c1" not in [a.name for a in lc.list_lora_adapters()]
    code, out, err = _cli(capsys, "lora", "unload", "c1", *target)
    assert code == 1 and out == "" and err.startswith("lmrpc: error: NOT_FOUND") and "'c1'" in err
    code, _, err = _cli(capsys, "lora", "load", "c2", "../outside", *target)
    assert code == 1 and "PERMISSION_DENIED" in err and "--lora-root" in err


def test_without_the_admin_flag_load_and_unload_answer_permission_denied(
        launch_server: Callable[..., RunningServer], tiny_llama_dir: Path, adapters: tuple[Path, Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = adapters
    running = launch_server("--model", str(tiny_llama_dir), "--dtype", "float32", "--lora-root", str(root),
                            "--kv-cache-tokens", "4096")
    try:
        with Client(running.target) as c:
            for call in (lambda: c.load_lora_adapter("x", "r1"), lambda: c.unload_lora_adapter("x")):
                err = _error(call)
                assert err.code == grpc.StatusCode.PERMISSION_DENIED and "--enable-lora-admin" in err.message
            assert c.list_lora_adapters() == []  # listing is always served
            assert len(_tokens(c, "hi", "r1")) == 8  # requests still load adapters by path under the root
            assert [a.name for a in c.list_lora_adapters()] == ["r1"]
        for argv in (("lora", "load", "x", "r1"), ("lora", "unload", "r1")):
            code, out, err = _cli(capsys, *argv, "--target", running.target)
            assert code == 1 and out == ""
            assert err.startswith("lmrpc: error: PERMISSION_DENIED") and "--enable-lora-admin" in err
        code, out, _ = _cli(capsys, "lora", "list", "--target", running.target)
        assert code == 0 and out.startswith("r1\t")
    finally:
        assert running.stop() == 0
