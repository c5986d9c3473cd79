"""Hostile requests against the real server: each answers its code in under a second, the server's RSS grows less
than 100 MiB for the call, the error fits in the 8 KiB of trailers a default gRPC client accepts, and the server
answers a normal request with the same greedy tokens afterwards. The seven rows of the issue that found them, and
their neighbours an order of magnitude around each limit.

The generating rows run on the shared default-model server (tests/e2e/conftest.py); the LoRA rows on a server of
the tiny random Llama with --lora-root and --enable-lora-admin."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from lora_adapters import make_adapter

from lmrpc.v1 import generate_pb2, generate_pb2_grpc, openai_pb2, openai_pb2_grpc

if TYPE_CHECKING:
    from conftest import RunningServer

pytestmark = pytest.mark.e2e

MIB = 1 << 20
RSS_MARGIN = 100 * MIB  # what one refused call may add to the server's resident memory
TIME_BOUND = 1.0  # seconds a refused call may take
TRAILER_LIMIT = 8 * 1024  # gRPC's default for a client's received metadata
PROBE = generate_pb2.GenerateRequest(
    text=["The capital of France is"],
    sampling_params=[generate_pb2.SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)])


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _chain_ebnf(rules: int) -> str:
    """root ::= r0; r{i} ::= "x" r{i+1} | "y": a chain `rules` deep (the grammar that overflowed the compiler)."""
    lines = ["root ::= r0"] + [f'r{i} ::= "x" r{i + 1} | "y"' for i in range(rules - 1)] + [f'r{rules - 1} ::= "y"']
    return "\n".join(lines)


def _nested_schema(depth: int) -> str:
    """An object schema `depth` levels of JSON deep (written as text: json.dumps itself recurses per level)."""
    levels = depth // 2  # each object nests two levels: itself and its "properties"
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


def _sampling(**fields: object) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(max_new_tokens=4, temperature=0, **fields)  # type: ignore[arg-type]


class Hostile:
    """One server, a plain channel with gRPC's default limits, and the checks every refused call gets."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.channel = grpc.insecure_channel(server.target)  # default options: 8 KiB of metadata received
        self.stub = generate_pb2_grpc.GenerateServiceStub(self.channel)
        self.openai = openai_pb2_grpc.OpenAIServiceStub(self.channel)
        self.expected = self._probe()

    def _probe(self) -> list[int]:
        [out] = list(self.stub.Generate(PROBE, timeout=60))
        return list(out.token_ids)

    def refused(self, call: Callable[[], object], code: grpc.StatusCode) -> dict[str, str]:
        """Run `call`; it must fail with `code` within TIME_BOUND, the server's RSS grow < RSS_MARGIN, the status
        fit in TRAILER_LIMIT, and the server still answer PROBE as before. Returns the BadRequest violations."""
        before = _rss(self.server.process.pid)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            call()
        elapsed = time.monotonic() - start
        err = info.value
        assert isinstance(err, grpc.Call)
        assert err.code() is code, f"{err.code()}: {err.details()}"  # type: ignore[attr-defined]
        assert elapsed < TIME_BOUND, f"refused after {elapsed:.2f} s"
        trailers = sum(len(k) + len(v) for k, v in err.trailing_metadata() or ())
        assert len((err.details() or "").encode()) + trailers < TRAILER_LIMIT  # type: ignore[attr-defined]
        grown = _rss(self.server.process.pid) - before
        assert grown < RSS_MARGIN, f"RSS grew {grown / MIB:.0f} MiB"
        assert self._probe() == self.expected
        violations: dict[str, str] = {}
        status = rpc_status.from_call(err)
        for detail in status.details if status is not None else ():
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad):
                violations.update({v.field: v.description for v in bad.field_violations})
        return violations

    def generate(self, req: generate_pb2.GenerateRequest) -> Callable[[], object]:
        return lambda: list(self.stub.Generate(req, timeout=30))


@pytest.fixture(scope="module")
def hostile(server: RunningServer) -> Iterator[Hostile]:
    h = Hostile(server)
    yield h
    h.channel.close()


def test_model_info_reports_the_limits(hostile: Hostile) -> None:
    limits = hostile.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30).limits
    assert limits.max_outputs_per_call == 64 + 256  # --max-running-requests + --max-queued-requests
    assert (limits.max_logit_bias, limits.max_stop, limits.max_stop_chars, limits.max_logprob_token_ids) == (
        4096, 1024, 1024, 256)
    assert (limits.max_grammar_bytes, limits.max_grammar_depth, limits.max_grammar_rules) == (256 * 1024, 64, 1000)
    assert (limits.max_top_logprobs, limits.max_request_id_chars, limits.max_adapter_name_chars) == (20, 256, 128)
    assert (limits.max_media_items, limits.max_image_pixels) == (16, 4096 * 4096)
    assert limits.max_audio_seconds == 0 and limits.audio_sampling_rate == 0  # a text-only model takes no audio


# ---- row 1: counts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [321, 100_000, 2**31 - 1])
def test_huge_n_is_refused_at_once(hostile: Hostile, n: int) -> None:
    req = generate_pb2.GenerateRequest(text=["hi"], sampling_params=[_sampling(n=n)])
    violations = hostile.refused(hostile.generate(req), grpc.StatusCode.INVALID_ARGUMENT)
    assert f"asks for {n} outputs" in violations["sampling_params.n"]


def test_chat_n_is_refused_at_once(hostile: Hostile) -> None:
    req = openai_pb2.ChatCompleteRequest(messages=[openai_pb2.ChatMessage(role="user", content="hi")], n=2**31 - 1)
    violations = hostile.refused(lambda: list(hostile.openai.ChatComplete(req, timeout=30)),
                                 grpc.StatusCode.INVALID_ARGUMENT)
    assert "n" in violations


# ---- rows 2, 5, 6: grammars ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rules", [5_000, 50_000])
def test_a_chain_of_rules_past_the_limit_is_refused(hostile: Hostile, rules: int) -> None:
    req = generate_pb2.GenerateRequest(text=["hi"], sampling_params=[_sampling(ebnf=_chain_ebnf(rules))])
    violations = hostile.refused(hostile.generate(req), grpc.StatusCode.INVALID_ARGUMENT)
    assert "--max-grammar" in violations["sampling_params[0].ebnf"]


@pytest.mark.parametrize("depth", [990, 1_200, 5_000, 50_000])
def test_deep_json_schemas_are_refused(hostile: Hostile, depth: int) -> None:
    req = generate_pb2.GenerateRequest(text=["hi"], sampling_params=[_sampling(json_schema=_nested_schema(depth))])
    violations = hostile.refused(hostile.generate(req), grpc.StatusCode.INVALID_ARGUMENT)
    # the depth, or for the deepest the size first (the cheapest check refuses it)
    assert "--max-grammar-depth" in violations["sampling_params[0].json_schema"] or depth > 10_000


def test_a_grammar_with_no_sentence_is_refused_at_validation(hostile: Hostile) -> None:
    req = generate_pb2.GenerateRequest(text=["hi"], sampling_params=[_sampling(ebnf='root ::= root "a"')])
    violations = hostile.refused(hostile.generate(req), grpc.StatusCode.INVALID_ARGUMENT)
    assert len(violations["sampling_params[0].ebnf"]) <= 200


# ---- row 3: errors every client can read -------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [
    _sampling(logit_bias={i: 1.0 for i in range(100_000)}),
    _sampling(stop_token_ids=list(range(10**6, 10**6 + 100_000))),
    _sampling(stop_token_ids=list(range(10**6, 10**6 + 1_000))),  # under --max-stop: 1,000 out-of-vocab ids
    _sampling(logit_bias={10**6 + i: 1.0 for i in range(4_000)}),  # under --max-logit-bias: 4,000 bad keys
], ids=["logit_bias-100k", "stop_token_ids-100k", "stop_token_ids-1k-out-of-vocab", "logit_bias-4k-out-of-vocab"])
def test_the_largest_errors_fit_in_the_trailers(hostile: Hostile, sampling: generate_pb2.SamplingParams) -> None:
    req = generate_pb2.GenerateRequest(text=["hi"], sampling_params=[sampling])
    violations = hostile.refused(hostile.generate(req), grpc.StatusCode.INVALID_ARGUMENT)
    assert any(f.startswith("sampling_params") for f in violations)


def test_a_long_lora_path_gets_its_own_status(hostile: Hostile) -> None:
    req = generate_pb2.GenerateRequest(text=["hi"], sampling_params=[_sampling()], lora_path=["a" * 10_000])
    violations = hostile.refused(hostile.generate(req), grpc.StatusCode.INVALID_ARGUMENT)
    assert "lora_path[0]" in violations


# ---- rows 4, 7: paths ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_hostile(launch_server: Callable[..., RunningServer], tiny_llama_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    """A server with --lora-root ROOT: ROOT/good (an adapter), ROOT/linked (its two files symlinks to an adapter
    outside the root), ROOT/inside (symlinks to good's files: inside the root)."""
    root = tmp_path_factory.mktemp("hostile-lora-root")
    outside = tmp_path_factory.mktemp("hostile-outside") / "adapter"
    make_adapter(tiny_llama_dir, root / "good", rank=4, seed=1)
    make_adapter(tiny_llama_dir, outside, rank=4, seed=2)
    for name, source in (("linked", outside), ("inside", root / "good")):
        (root / name).mkdir()
        for f in os.listdir(source):
            (root / name / f).symlink_to(source / f)
    running = launch_server("--model", str(tiny_llama_dir), "--dtype", "float32", "--lora-root", str(root),
                            "--enable-lora-admin", "--kv-cache-tokens", "4096")
    h = Hostile(running)
    yield h
    h.channel.close()
    assert running.stop() == 0


def test_a_nul_byte_in_an_adapter_path_is_invalid(lora_hostile: Hostile) -> None:
    load = generate_pb2.LoadLoraAdapterRequest(name="nul", path="good\x00/../x")
    violations = lora_hostile.refused(lambda: lora_hostile.stub.LoadLoraAdapter(load, timeout=30),
                                      grpc.StatusCode.INVALID_ARGUMENT)
    assert "path" in violations
    req = generate_pb2.GenerateRequest(text=["hi"], sampling_params=[_sampling()], lora_path=["go\x00od"])
    violations = lora_hostile.refused(lora_hostile.generate(req), grpc.StatusCode.INVALID_ARGUMENT)
    assert "lora_path[0]" in violations


def test_file_symlinks_out_of_the_root_are_denied(lora_hostile: Hostile) -> None:
    load = generate_pb2.LoadLoraAdapterRequest(name="linked", path="linked")
    lora_hostile.refused(lambda: lora_hostile.stub.LoadLoraAdapter(load, timeout=30),
                         grpc.StatusCode.PERMISSION_DENIED)
    req = generate_pb2.GenerateRequest(text=["hi"], sampling_params=[_sampling()], lora_path=["linked"])
    lora_hostile.refused(lora_hostile.generate(req), grpc.StatusCode.PERMISSION_DENIED)
    # Symlinks that stay inside the root still load.
    inside = lora_hostile.stub.LoadLoraAdapter(generate_pb2.LoadLoraAdapterRequest(name="inside", path="inside"),
                                               timeout=30)
    assert inside.adapter.name == "inside"


@pytest.mark.parametrize("name", ["n" * 100_000, "a\x00b", "a\nb"])
def test_adapter_names_are_short_identifiers(lora_hostile: Hostile, name: str) -> None:
    load = generate_pb2.LoadLoraAdapterRequest(name=name, path="good")
    violations = lora_hostile.refused(lambda: lora_hostile.stub.LoadLoraAdapter(load, timeout=30),
                                      grpc.StatusCode.INVALID_ARGUMENT)
    assert "name" in violations


@pytest.mark.parametrize(("kind", "text"), [("ebnf", 'root ::= "a"{1000000}'), ("regex", "(a{1000}){1000}"),
                                            ("regex", "a{2147483647}")])
def test_grammars_past_the_parsers_limits_are_the_requests_fault(hostile: Hostile, kind: str, text: str) -> None:
    """Grammars within our limits whose parser state outgrows llguidance's own bounds while generating (found by
    bench/fuzz.py --mode limits): the call is INVALID_ARGUMENT, never INTERNAL, and the server serves on."""
    req = openai_pb2.ChatCompleteRequest(messages=[openai_pb2.ChatMessage(role="user", content="hi")], max_tokens=16,
                                         temperature=0, ignore_eos=True, **{kind: text})  # type: ignore[arg-type]
    try:
        [reply] = list(hostile.openai.ChatComplete(req, timeout=30))
    except grpc.RpcError as err:
        assert isinstance(err, grpc.Call)
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()  # type: ignore[attr-defined]
    else:
        assert reply.choices[0].message.content.startswith("a")
    assert hostile._probe() == hostile.expected
