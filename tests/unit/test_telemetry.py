"""Tracing and request logs over the real GenerateService on an in-process grpc.aio server with a fake engine:
the server span continues the caller's trace and carries the call's figures; unconfigured, nothing is recorded;
one log record per finished output, whatever way the call ends; the JSON and text formatters."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from typing import Any

import grpc
import pytest
from fake_engine import CACHED, HANG, FakeEngine, ids_request, make_service, serving
from opentelemetry import trace
from opentelemetry.propagate import inject
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lmrpc.server.telemetry import (
    REQUEST_LOGGER,
    JsonFormatter,
    TextFormatter,
    configure_tracing,
    traces_exporters,
)
from lmrpc.v1 import generate_pb2

GENERATE = "/lmrpc.v1.GenerateService/Generate"


def server_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == GENERATE]


async def test_server_span_continues_the_callers_trace() -> None:
    exported = InMemorySpanExporter()
    tracing = configure_tracing({"OTEL_TRACES_EXPORTER": "otlp"}, exporter=exported)
    assert tracing is not None and len(tracing.interceptors) == 1
    client_provider = TracerProvider()
    client_provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracer = client_provider.get_tracer("test-client")
    service = make_service(FakeEngine())
    async with serving(service, tracing.interceptors) as stub:
        with tracer.start_as_current_span("client call") as client_span:
            carrier: dict[str, str] = {}
            inject(carrier)  # W3C traceparent of the client span
            assert "traceparent" in carrier
            call = stub.Generate(ids_request([5, 6, 7], [8, 9], rid=["a", "b"]), metadata=tuple(carrier.items()))
            responses = [r async for r in call]
    tracing.provider.force_flush()
    assert len(responses) == 2
    [span] = server_spans(exported)
    client = client_span.get_span_context()
    assert span.parent is not None and span.parent.is_remote
    assert (span.parent.trace_id, span.parent.span_id) == (client.trace_id, client.span_id)
    assert span.context is not None and span.context.trace_id == client.trace_id
    assert span.kind is trace.SpanKind.SERVER
    attributes = dict(span.attributes or {})
    assert attributes["lmrpc.rid"] == "a,b"
    assert attributes["lmrpc.prompt_tokens"] == 3 + 2
    assert attributes["lmrpc.completion_tokens"] == 3 + 2
    assert attributes["lmrpc.cached_tokens"] == 2 * CACHED
    assert attributes["lmrpc.finish_reason"] == "eos"
    assert attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    names = [e.name for e in span.events]
    assert names[0] == "queued"
    assert names.count("prefill_start") == names.count("first_token") == names.count("finished") == 2
    times = {e.name: e.timestamp for e in span.events}
    assert span.start_time is not None and span.end_time is not None
    assert all(span.start_time <= t <= span.end_time for t in times.values())
    tracing.shutdown()


async def test_unconfigured_tracing_installs_nothing_and_records_nothing() -> None:
    exported = InMemorySpanExporter()
    assert configure_tracing({}, exporter=exported) is None
    engine = FakeEngine()
    recording: list[bool] = []
    engine.on_generate.append(lambda: recording.append(trace.get_current_span().is_recording()))
    async with serving(make_service(engine)) as stub:  # what app.py does when configure_tracing gives None
        client_provider = TracerProvider()
        with client_provider.get_tracer("test-client").start_as_current_span("client call"):
            carrier: dict[str, str] = {}
            inject(carrier)
            [response] = [r async for r in stub.Generate(ids_request([5, 6]), metadata=tuple(carrier.items()))]
    assert response.finish.reason == generate_pb2.FINISH_REASON_EOS
    assert recording == [False]
    assert exported.get_finished_spans() == ()


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, ()),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
    ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ("otlp", "console")),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ()),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
])
def test_exporters_from_environment(environ: dict[str, str], expected: tuple[str, ...]) -> None:
    assert traces_exporters(environ) == expected


def test_unsupported_exporter_or_protocol_fails_at_start() -> None:
    with pytest.raises(ValueError, match="zipkin"):
        traces_exporters({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="grpc only"):
        configure_tracing({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})


def test_otlp_endpoint_builds_the_otlp_exporter() -> None:
    # The exporter connects lazily: nothing is sent, since no span is made.
    tracing = configure_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    assert tracing is not None
    expected = os.environ.get("OTEL_SERVICE_NAME", "lmrpc-server")  # Resource.create reads the real environment
    assert tracing.provider.resource.attributes["service.name"] == expected
    tracing.shutdown()


# ---- request logs --------------------------------------------------------------------------------------------


def request_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == REQUEST_LOGGER]  # type: ignore[attr-defined]


async def test_one_record_per_finished_output(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    async with serving(make_service(FakeEngine())) as stub:
        responses = [r async for r in stub.Generate(ids_request([5, 6, 7], [8, 9], rid=["a", "b"], stream=True))]
    assert len(responses) == 5
    records = sorted(request_records(caplog), key=lambda f: f["rid"])
    assert [(f["rid"], f["request_id"]) for f in records] == [("a", "a"), ("b", "b")]
    for f, n in zip(records, (3, 2), strict=True):
        assert (f["prompt_tokens"], f["completion_tokens"], f["cached_tokens"]) == (n, n, CACHED)
        assert f["finish_reason"] == "eos" and f["grpc_status"] == "OK"
        assert 0 <= f["queue_time"] <= f["ttft"] <= f["e2e"]


async def test_rejected_and_cancelled_calls_are_logged_with_their_status(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    async with serving(make_service(FakeEngine())) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await stub.Generate(ids_request([5000], rid=["bad"])).read()  # token id outside the vocabulary
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        call = stub.Generate(ids_request([HANG, 1, 2], rid=["hung"], stream=True))
        first = await call.read()
        assert isinstance(first, generate_pb2.GenerateResponse) and list(first.token_ids) == [10]
        call.cancel()
        for _ in range(200):  # the server sees the cancel asynchronously
            if len(request_records(caplog)) == 2:
                break
            await asyncio.sleep(0.01)
    rejected, cancelled = request_records(caplog)
    assert rejected["rid"] == "bad" and rejected["grpc_status"] == "INVALID_ARGUMENT"
    assert rejected["request_id"] is None and rejected["e2e"] is None
    assert cancelled["rid"] == "hung" and cancelled["grpc_status"] == "CANCELLED"
    assert cancelled["finish_reason"] == "abort" and cancelled["completion_tokens"] is None
    assert cancelled["ttft"] is not None and cancelled["e2e"] >= cancelled["ttft"]


def _record(**fields: Any) -> logging.LogRecord:
    record = logging.LogRecord(REQUEST_LOGGER, logging.INFO, __file__, 1, "request %s", ("finished",), None)
    if fields:
        record.fields = fields
    return record


def test_json_formatter_one_object_per_line() -> None:
    line = JsonFormatter().format(_record(rid="a", ttft=0.25, finish_reason=None))
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "request finished" and entry["level"] == "INFO" and entry["logger"] == REQUEST_LOGGER
    assert (entry["rid"], entry["ttft"], entry["finish_reason"]) == ("a", 0.25, None)
    assert entry["time"].endswith("Z")
    plain = json.loads(JsonFormatter().format(_record()))
    assert "rid" not in plain and plain["message"] == "request finished"
    try:
        raise KeyError("boom")
    except KeyError:
        failed = _record()
        failed.exc_info = sys.exc_info()
    assert "KeyError: 'boom'" in json.loads(JsonFormatter().format(failed))["exception"]


def test_text_formatter_appends_fields() -> None:
    line = TextFormatter().format(_record(rid="a", grpc_status="OK"))
    assert line.endswith("request finished rid=a grpc_status=OK")
