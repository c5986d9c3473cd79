"""Request limits checked from the request's own counts before any work (validation.check_generate_sizes,
check_sizes, check_outputs, check_rids), and errors bounded so every gRPC client can read them (to_status)."""

from __future__ import annotations

import time

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from lmrpc.server import statuses, validation
from lmrpc.server.config import RequestLimits
from lmrpc.v1 import generate_pb2, openai_pb2

LIMITS = RequestLimits()
CAPACITY = 320


def _refused(req: generate_pb2.GenerateRequest) -> statuses.RequestError:
    with pytest.raises(statuses.RequestError) as info:
        validation.check_generate_sizes(req, validation.check_shape(req), LIMITS, CAPACITY)
    return info.value


def _trailer_bytes(error: statuses.RequestError) -> int:
    """What the status costs as trailers: grpc-status, grpc-message (percent-encoded at worst 3 bytes per byte of
    UTF-8 outside printable ASCII) and grpc-status-details-bin (base64)."""
    status = statuses.to_status(error)
    [(_, details)] = [kv for kv in status.trailing_metadata if kv[0] == "grpc-status-details-bin"]
    message = status.details.encode()
    encoded = sum(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in message)
    return len("grpc-status") + 2 + len("grpc-message") + encoded + len("grpc-status-details-bin") + \
        (len(details) + 2) // 3 * 4


def test_huge_n_is_refused_from_its_count_at_once() -> None:
    req = generate_pb2.GenerateRequest(text=["hi"], sampling_params=[generate_pb2.SamplingParams(n=2**31 - 1)])
    start = time.perf_counter()
    error = _refused(req)
    assert time.perf_counter() - start < 0.1  # nothing proportional to n was built
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.violations[0].field == "sampling_params.n"
    assert f"at most {CAPACITY}" in error.violations[0].description


def test_prompts_times_n_counts_against_the_capacity() -> None:
    ok = generate_pb2.GenerateRequest(input_ids=[generate_pb2.TokenIds(ids=[1])] * 32,
                                      sampling_params=[generate_pb2.SamplingParams(n=10)])
    validation.check_generate_sizes(ok, validation.check_shape(ok), LIMITS, CAPACITY)  # 320: at the limit
    over = generate_pb2.GenerateRequest(input_ids=[generate_pb2.TokenIds(ids=[1])] * 33,
                                        sampling_params=[generate_pb2.SamplingParams(n=10)])
    assert "asks for 330 outputs" in _refused(over).violations[0].description


@pytest.mark.parametrize(("field", "make", "limit"), [
    ("logit_bias", lambda k: generate_pb2.SamplingParams(logit_bias={i: 1.0 for i in range(k)}), LIMITS.max_logit_bias),
    ("stop", lambda k: generate_pb2.SamplingParams(stop=["x"] * k), LIMITS.max_stop),
    ("stop_token_ids", lambda k: generate_pb2.SamplingParams(stop_token_ids=[10**6] * k), LIMITS.max_stop),
    ("stop_regex", lambda k: generate_pb2.SamplingParams(stop_regex=["x"] * k), LIMITS.max_stop),
])
def test_sampling_lists_are_bounded_by_count(field: str, make, limit: int) -> None:  # type: ignore[no-untyped-def]
    at_limit = generate_pb2.GenerateRequest(text=["hi"], sampling_params=[make(limit)])
    validation.check_generate_sizes(at_limit, 1, LIMITS, CAPACITY)
    error = _refused(generate_pb2.GenerateRequest(text=["hi"], sampling_params=[make(limit + 1)]))
    [v] = error.violations
    assert v.field == f"sampling_params[0].{field}"
    assert f"has {limit + 1} entries" in v.description and f"at most {limit}" in v.description


def test_stop_strings_are_bounded_in_length() -> None:
    long = "x" * (LIMITS.max_stop_chars + 1)
    error = _refused(generate_pb2.GenerateRequest(
        text=["hi"], sampling_params=[generate_pb2.SamplingParams(stop=["a", long])]))
    assert error.violations[0].field == "sampling_params[0].stop"
    assert "--max-stop-chars" in error.violations[0].description


def test_token_ids_logprob_is_bounded() -> None:
    error = _refused(generate_pb2.GenerateRequest(
        text=["hi"], token_ids_logprob=list(range(LIMITS.max_logprob_token_ids + 1))))
    assert error.violations[0].field == "token_ids_logprob"


def test_openai_requests_are_bounded_by_the_same_rules() -> None:
    req = openai_pb2.ChatCompleteRequest(logit_bias={i: 1.0 for i in range(LIMITS.max_logit_bias + 1)})
    c = statuses.Collector()
    validation.check_sizes(c, [("", req)], LIMITS)
    assert [v.field for v in c.violations] == ["logit_bias"]


@pytest.mark.parametrize("rid", ["r" * (validation.MAX_RID_CHARS + 1), "a\nb", "a\x00b"])
def test_request_ids_are_short_and_printable(rid: str) -> None:
    with pytest.raises(statuses.RequestError) as info:
        validation.check_shape(generate_pb2.GenerateRequest(text=["hi"], rid=[rid]))
    assert info.value.violations[0].field == "rid"


def test_every_error_fits_in_8_kib_of_trailers() -> None:
    """10,000 violations of 10,000-character fields and descriptions, 4-byte characters in the description (the
    worst case for grpc-message's percent-encoding): the status names the first few, counts the rest, and costs
    well under the 8 KiB of trailers a default gRPC client accepts."""
    field, description = "f" * 10_000, "d\U0001F600" * 5_000
    error = statuses.RequestError(grpc.StatusCode.INVALID_ARGUMENT, [
        statuses.Violation(field + str(i), description) for i in range(10_000)])
    size = _trailer_bytes(error)
    assert size < 8 * 1024 - 1024  # a margin for grpc-status and the ORCA load report
    status = statuses.to_status(error)
    detail = error_details_pb2.BadRequest()
    [any_detail] = status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"]).details
    assert any_detail.Unpack(detail)
    violations = list(detail.field_violations)
    assert 1 < len(violations) <= statuses.MAX_VIOLATIONS + 1
    assert violations[-1].description.startswith("and ") and "more" in violations[-1].description
    assert all(len(v.field) <= statuses.MAX_FIELD_CHARS for v in violations)
    assert all(len(v.description) <= statuses.MAX_DESCRIPTION_CHARS for v in violations)


def test_a_few_short_violations_are_sent_whole() -> None:
    error = statuses.RequestError(grpc.StatusCode.INVALID_ARGUMENT, [
        statuses.Violation("top_p", "must be in (0, 1], got 2.0"), statuses.Violation("n", "must be >= 1")])
    status = statuses.to_status(error)
    assert status.details == "top_p: must be in (0, 1], got 2.0; n: must be >= 1"


def test_repetition_penalty_zero_is_refused_not_divided_by() -> None:
    from scripted_engine import INFO  # a model without generation defaults

    def resolve(value: float) -> object:
        pb = generate_pb2.SamplingParams(repetition_penalty=value)
        return validation.resolve_sampling(pb, "sampling_params", INFO, False, 4, "", False)

    with pytest.raises(statuses.RequestError) as info:
        resolve(0.0)
    [violation] = info.value.violations
    assert violation.field == "sampling_params.repetition_penalty" and "(0, 2]" in violation.description
    assert resolve(2.0).repetition_penalty == 2.0  # type: ignore[attr-defined]


def test_a_models_unusable_sampling_defaults_are_mapped_or_dropped(caplog: pytest.LogCaptureFixture) -> None:
    from lmrpc.server.models.loader import usable_sampling_defaults

    found = {"top_k": 0.0, "top_p": 0.0, "temperature": 0.7, "repetition_penalty": 0.0, "min_p": 0.05}
    # top_k 0 is Hugging Face's "off"; top_p 0 and repetition_penalty 0 no request may set: the server's own apply
    assert usable_sampling_defaults(found, "generation_config.json") == {"top_k": -1.0, "temperature": 0.7,
                                                                         "min_p": 0.05}
    assert "ignoring top_p = 0.0" in caplog.text and "ignoring repetition_penalty = 0.0" in caplog.text


def test_stop_regex_is_compiled_once_at_validation_and_reused_by_every_output(smollm2_tokenizer: object) -> None:
    import regex._main
    from scripted_engine import INFO

    from lmrpc.server.engine.detokenizer import OutputProcessor

    regex.purge()
    pb = generate_pb2.SamplingParams(stop_regex=[r"\d+ dollars", "(?i)done"], n=3)
    params = validation.resolve_sampling(pb, "sampling_params", INFO, False, 4, "", False)
    # users' patterns stay out of the regex module's own cache (500 of them kept tens of MiB after a burst)
    assert len(regex._main._cache) == 0
    assert [p.pattern for p in params.stop_patterns] == [r"\d+ dollars", "(?i)done"]
    # each output's processor (the engine thread) takes the compiled patterns: nothing is compiled there
    processors = [OutputProcessor(smollm2_tokenizer, [1, 2], params, (2,)) for _ in range(params.n)]  # type: ignore[arg-type]
    assert all(p.regexes is params.stop_patterns for p in processors)
    with pytest.raises(statuses.RequestError) as info:
        validation.resolve_sampling(generate_pb2.SamplingParams(stop_regex=["ok", "(unclosed"]), "sampling_params",
                                    INFO, False, 4, "", False)
    [violation] = info.value.violations
    assert violation.field == "sampling_params.stop_regex" and "(unclosed" in violation.description
