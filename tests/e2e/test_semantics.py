"""Issue 4's acceptance over a real server with the real SmolLM2 model: the seeds' /generate semantics over gRPC
(streaming equals merged, every finish reason, n and batch indices, logprobs, request ids, validation of every
kind of bad input, custom logit processors)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from lmrpc.client import Client, FinishReason, GenerateResult, LmrpcError
from lmrpc.v1 import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.e2e

EOS = 2  # SmolLM2's <|im_end|>
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def greedy(n: int, **extra: object) -> dict[str, object]:
    return {"max_new_tokens": n, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def stub(server) -> Iterator[generate_pb2_grpc.GenerateServiceStub]:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(server.target) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)


# ---- streaming -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [
    "Once upon a time",
    CHAT.format("Write 东京 and 北京 in Chinese characters, with some emoji 🙂🎉."),
    "日本語の文章: 今日は",
])
@pytest.mark.parametrize("params", [greedy(24), {"max_new_tokens": 24, "temperature": 1.3, "sampling_seed": 11}])
def test_stream_concatenates_to_the_merged_output(client: Client, prompt: str, params: dict[str, object]) -> None:
    # Cold: the streamed call computes the prompt, the merged one is a prefix-cache hit; the outputs still agree.
    deltas = list(client.generate(prompt, sampling_params=params, stream=True))
    [merged] = client.generate(prompt, sampling_params=params)
    assert "".join(d.text for d in deltas) == merged.text
    assert [t for d in deltas for t in d.token_ids] == merged.token_ids
    if "\ufffd" not in merged.text:  # (a sampled output may hold bytes that never form a character)
        assert all("\ufffd" not in d.text for d in deltas), "a delta showed half a UTF-8 character"
    assert [d.finish is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]


def _greedy_text(client: Client, prompt: str, n: int) -> GenerateResult:
    [r] = client.generate(prompt, sampling_params=greedy(n, ignore_eos=True))
    return r


def test_stop_string_trimmed_never_streamed_and_untrimmed_with_no_stop_trim(client: Client) -> None:
    prompt = "The capital of France is Paris. The capital of Germany is"
    full = _greedy_text(client, prompt, 32).text
    stop = full[len(full) // 3 : len(full) // 3 + 4]  # spans token boundaries more often than not
    assert stop.strip(), full
    deltas = list(client.generate(prompt, sampling_params=greedy(32, stop=[stop]), stream=True))
    assert all(stop not in d.text for d in deltas)
    text = "".join(d.text for d in deltas)
    assert text == full[: full.index(stop)]
    assert deltas[-1].finish is not None
    assert deltas[-1].finish.reason == FinishReason.STOP_STRING and deltas[-1].finish.matched == stop
    [kept] = client.generate(prompt, sampling_params=greedy(32, stop=[stop], no_stop_trim=True))
    assert kept.text == full[: full.index(stop) + len(stop)]
    assert kept.finish.reason == FinishReason.STOP_STRING


# ---- finish reasons ------------------------------------------------------------------------------------------


def test_finish_length_including_zero_tokens(client: Client) -> None:
    [r] = client.generate("Hello", sampling_params=greedy(3, ignore_eos=True))
    assert r.finish.reason == FinishReason.LENGTH and len(r.token_ids) == 3
    assert r.usage is not None and r.usage.completion_tokens == 3
    [z] = client.generate("Hello", sampling_params=greedy(0))
    assert z.finish.reason == FinishReason.LENGTH and z.token_ids == [] and z.text == ""
    assert z.usage is not None and z.usage.completion_tokens == 0 and z.usage.prompt_tokens > 0


def test_finish_eos_with_matched_id(client: Client) -> None:
    [r] = client.generate(CHAT.format("What is 2+2? Answer with just the number."), sampling_params=greedy(64))
    assert r.finish.reason == FinishReason.EOS and r.finish.matched == EOS
    assert r.token_ids[-1] == EOS and "<|im_end|>" not in r.text


def test_finish_stop_token(client: Client) -> None:
    prompt = "One, two, three, four,"
    ids = _greedy_text(client, prompt, 8).token_ids
    target = ids[3]
    [r] = client.generate(prompt, sampling_params=greedy(8, stop_token_ids=[target]))
    assert r.finish.reason == FinishReason.STOP_TOKEN and r.finish.matched == target
    assert r.token_ids == ids[: ids.index(target) + 1]  # the stop token is returned, not decoded into text


def test_finish_stop_regex(client: Client) -> None:
    [r] = client.generate("Count: 1, 2, 3,", sampling_params=greedy(16, stop_regex=[r"[5-9]"]))
    assert r.finish.reason == FinishReason.STOP_REGEX and r.finish.matched == r"[5-9]"


def test_finish_abort_by_rid_ends_every_sample(client: Client, server) -> None:  # type: ignore[no-untyped-def]
    results: list[GenerateResult] = []

    def run() -> None:
        results.extend(client.generate(["Tell me a long story.", "Count to a thousand:"], rid=["ab-1", "ab-2"],
                                       sampling_params={"max_new_tokens": 2000, "ignore_eos": True, "n": 2}))

    thread = threading.Thread(target=run)
    thread.start()
    with Client(server.target) as other:
        deadline = time.monotonic() + 60
        while not other.abort("ab-1") and time.monotonic() < deadline:
            time.sleep(0.05)
        other.abort("ab-2")
    thread.join(timeout=60)
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert all(r.finish.reason == FinishReason.ABORT for r in results)
    assert all(len(r.token_ids) < 2000 for r in results)


# ---- batches, n, request ids ------------------------------------------------------------------------------------


def test_batch_of_three_with_n2_is_prompt_major(client: Client) -> None:
    prompts = ["Red is", "Blue is", "Green is"]
    results = client.generate(prompts, rid=["p0", "p1", "p2"],
                              sampling_params={"max_new_tokens": 6, "n": 2, "temperature": 1.0, "sampling_seed": 3})
    assert [r.index for r in results] == [0, 1, 2, 3, 4, 5]
    assert [r.rid for r in results] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert all(r.usage is not None and r.usage.completion_tokens == len(r.token_ids) for r in results)
    # Same prompt, same seed: the two samples of a prompt still differ (each sample gets its own stream).
    assert any(results[2 * i].token_ids != results[2 * i + 1].token_ids for i in range(3))


def test_x_request_id_becomes_the_rid_and_is_echoed(stub: generate_pb2_grpc.GenerateServiceStub) -> None:
    call = stub.Generate(generate_pb2.GenerateRequest(
        text=["Hi"], sampling_params=[generate_pb2.SamplingParams(max_new_tokens=2, temperature=0)]),
        metadata=(("x-request-id", "trace-42"),))
    messages = list(call)
    assert dict(call.initial_metadata())["x-request-id"] == "trace-42"
    assert {m.rid for m in messages} == {"trace-42"}


# ---- logprobs ---------------------------------------------------------------------------------------------------


def test_output_logprobs_chosen_and_sorted_top(client: Client) -> None:
    [r] = client.generate("The weather today is", sampling_params=greedy(8), return_logprob=True,
                          top_logprobs_num=5, token_ids_logprob=[11, 13], return_text_in_logprobs=True)
    assert len(r.output_logprobs) == len(r.token_ids) == 8
    for pos, token in zip(r.output_logprobs, r.token_ids, strict=True):
        assert pos.chosen is not None and pos.chosen.token_id == token and pos.chosen.logprob is not None
        values = [t.logprob for t in pos.top]
        assert len(values) == 5 and values == sorted(values, reverse=True)  # type: ignore[type-var]
        assert pos.top[0].token_id == token  # greedy: the best alternative is the chosen token
        assert [t.token_id for t in pos.requested] == [11, 13]
        assert pos.chosen.text != "" or token == EOS


def test_prompt_logprobs_first_absent_and_start_len(client: Client) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    n = len(client.tokenize(prompt))
    [full] = client.generate(prompt, sampling_params=greedy(1), return_logprob=True, logprob_start_len=0)
    assert len(full.input_logprobs) == n
    assert full.input_logprobs[0].chosen is not None and full.input_logprobs[0].chosen.logprob is None
    assert all(p.chosen is not None and p.chosen.logprob is not None for p in full.input_logprobs[1:])
    [part] = client.generate(prompt, sampling_params=greedy(1), return_logprob=True, logprob_start_len=4)
    assert len(part.input_logprobs) == n - 4
    assert [p.chosen.logprob for p in part.input_logprobs] == pytest.approx(  # type: ignore[union-attr]
        [p.chosen.logprob for p in full.input_logprobs[4:]], abs=1e-3)  # type: ignore[union-attr]


def test_rescoring_a_sample_reproduces_its_logprobs(client: Client) -> None:
    prompt_ids = client.tokenize("My favourite animal is")
    [sample] = client.generate(input_ids=prompt_ids, return_logprob=True,
                               sampling_params={"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 5,
                                                "ignore_eos": True})
    [scored] = client.generate(input_ids=prompt_ids + sample.token_ids, sampling_params={"max_new_tokens": 0},
                               return_logprob=True, logprob_start_len=len(prompt_ids))
    assert scored.token_ids == []
    sampled = [p.chosen.logprob for p in sample.output_logprobs]  # type: ignore[union-attr]
    rescored = [p.chosen.logprob for p in scored.input_logprobs]  # type: ignore[union-attr]
    assert [p.chosen.token_id for p in scored.input_logprobs] == sample.token_ids  # type: ignore[union-attr]
    assert rescored == pytest.approx(sampled, abs=0.35)


# ---- custom logit processors ------------------------------------------------------------------------------------


def test_disallowed_tokens_never_appear(client: Client, stub: generate_pb2_grpc.GenerateServiceStub) -> None:
    prompt = "One, two, three, four, five,"
    banned = sorted(set(_greedy_text(client, prompt, 12).token_ids[:4]))
    params = generate_pb2.SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    params.custom_params.update({"token_ids": banned})
    for seed_params in (params, _with(params, temperature=1.2, sampling_seed=9)):
        [msg] = list(stub.Generate(generate_pb2.GenerateRequest(
            text=[prompt], sampling_params=[seed_params], custom_logit_processor="disallowed_tokens")))
        assert len(msg.token_ids) == 24 and not set(msg.token_ids) & set(banned)


def _with(params: generate_pb2.SamplingParams, **fields: object) -> generate_pb2.SamplingParams:
    copy = generate_pb2.SamplingParams()
    copy.CopyFrom(params)
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy


# ---- validation -------------------------------------------------------------------------------------------------


def _sp(**fields: object) -> generate_pb2.SamplingParams:
    sp = generate_pb2.SamplingParams(max_new_tokens=4)
    for name, value in fields.items():
        if name == "logit_bias":
            sp.logit_bias.update(value)  # type: ignore[arg-type]
        elif isinstance(value, list):
            getattr(sp, name).extend(value)
        else:
            setattr(sp, name, value)
    return sp


def _req(**fields: object) -> Callable[[], generate_pb2.GenerateRequest]:
    def build() -> generate_pb2.GenerateRequest:
        req = generate_pb2.GenerateRequest()
        if "text" not in fields and "input_ids" not in fields and "no_input" not in fields:
            req.text.append("Hello")
        for name, value in fields.items():
            if name == "no_input":
                continue
            if name == "input_ids":
                for ids in value:  # type: ignore[attr-defined]
                    req.input_ids.add().ids.extend(ids)
            elif name == "sampling_params":
                req.sampling_params.extend(value)  # type: ignore[arg-type]
            elif isinstance(value, list):
                getattr(req, name).extend(value)
            else:
                setattr(req, name, value)
        return req

    return build


INVALID = {
    "no input": (_req(no_input=True), "text"),
    "text and input_ids": (_req(text=["a"], input_ids=[[1, 2]]), "input_ids"),
    "empty text": (_req(text=[""]), "text[0]"),
    "empty input_ids": (_req(input_ids=[[]]), "input_ids[0]"),
    "sampling_params count": (_req(text=["a", "b"], sampling_params=[_sp(), _sp(), _sp()]), "sampling_params"),
    "rid count": (_req(text=["a", "b"], rid=["x"]), "rid"),
    "duplicate rids": (_req(text=["a", "b"], rid=["x", "x"]), "rid"),
    "token outside vocab": (_req(input_ids=[[1, 49152]]), "input_ids[0]"),
    "prompt longer than context": (_req(input_ids=[[100] * 8200]), "input_ids[0]"),
    "unknown logit processor": (_req(custom_logit_processor="no_such_processor"), "custom_logit_processor"),
    "temperature": (_req(sampling_params=[_sp(temperature=-1)]), "temperature"),
    "top_p": (_req(sampling_params=[_sp(top_p=0)]), "top_p"),
    "top_k": (_req(sampling_params=[_sp(top_k=0)]), "top_k"),
    "min_p": (_req(sampling_params=[_sp(min_p=1.5)]), "min_p"),
    "frequency_penalty": (_req(sampling_params=[_sp(frequency_penalty=2.5)]), "frequency_penalty"),
    "presence_penalty": (_req(sampling_params=[_sp(presence_penalty=-2.5)]), "presence_penalty"),
    "repetition_penalty": (_req(sampling_params=[_sp(repetition_penalty=3)]), "repetition_penalty"),
    "max_new_tokens": (_req(sampling_params=[_sp(max_new_tokens=-1)]), "max_new_tokens"),
    "min_new_tokens": (_req(sampling_params=[_sp(max_new_tokens=4, min_new_tokens=5)]), "min_new_tokens"),
    "n": (_req(sampling_params=[_sp(n=0)]), ".n"),
    "n differs across prompts": (_req(text=["a", "b"], sampling_params=[_sp(n=1), _sp(n=2)]), "n"),
    "logit_bias key": (_req(sampling_params=[_sp(logit_bias={60000: 1.0})]), "logit_bias"),
    "logit_bias value": (_req(sampling_params=[_sp(logit_bias={5: 500.0})]), "logit_bias"),
    "stop_token_ids": (_req(sampling_params=[_sp(stop_token_ids=[-3])]), "stop_token_ids"),
    "empty stop string": (_req(sampling_params=[_sp(stop=[""])]), "stop"),
    "stop_regex": (_req(sampling_params=[_sp(stop_regex=["(unclosed"])]), "stop_regex"),
    "top_logprobs_num": (_req(return_logprob=True, top_logprobs_num=-1), "top_logprobs_num"),
    "logprob_start_len": (_req(return_logprob=True, logprob_start_len=1000), "logprob_start_len"),
    "token_ids_logprob": (_req(return_logprob=True, token_ids_logprob=[49152]), "token_ids_logprob"),
    "json_schema": (_req(sampling_params=[_sp(json_schema="{not json")]), "json_schema"),
    "regex": (_req(sampling_params=[_sp(regex="(a")]), "regex"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_input_is_invalid_argument_naming_the_field(
    case: str, stub: generate_pb2_grpc.GenerateServiceStub
) -> None:
    build, field = INVALID[case]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(build(), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert field in (err.value.details() or "")
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert any(field in v.field for v in bad.field_violations)


def test_server_still_serves_after_every_invalid_input(client: Client) -> None:
    [r] = client.generate("The capital of France is", sampling_params=greedy(4))
    assert r.finish.reason == FinishReason.LENGTH and r.text


def test_client_raises_typed_error(client: Client) -> None:
    with pytest.raises(LmrpcError) as err:
        client.generate("hi", sampling_params={"temperature": -1})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert any(v.field.endswith("temperature") for v in err.value.field_violations)


