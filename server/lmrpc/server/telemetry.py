"""OpenTelemetry tracing (configured from the standard OTEL_* variables) and structured request logs.

Tracing is opt-in: only when OTEL_TRACES_EXPORTER names an exporter, or an OTLP endpoint is set, does the server
get a TracerProvider and the gRPC server interceptor; otherwise nothing is installed, and the service's span calls
land on OpenTelemetry's non-recording span (a no-op). The provider is handed to the interceptor rather than
installed globally, so nothing else in the process changes behaviour because lmrpc traces.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from lmrpc.server.engine.types import EngineOutput, EngineRequest, FinishReason
from lmrpc.server.metrics import Metrics, OutputTimeline

REQUEST_LOGGER = "lmrpc.server.requests"  # one record per finished output, fields in `record.fields`
_request_log = logging.getLogger(REQUEST_LOGGER)
# A request record's fields besides rid and grpc_status (null for a call rejected before it had outputs).
_OUTPUT_FIELDS = ("request_id", "prompt_tokens", "completion_tokens", "cached_tokens", "queue_time", "ttft", "e2e",
                  "finish_reason")
LOG_FORMATS = ("text", "json")
EXPORTERS = ("otlp", "console")  # what OTEL_TRACES_EXPORTER may name ("none" disables)
DEFAULT_SERVICE_NAME = "lmrpc-server"

# ---- tracing ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tracing:
    """A configured tracer provider and the server interceptors that use it."""

    provider: TracerProvider  # owns the span processor and exporter
    interceptors: tuple[grpc.aio.ServerInterceptor, ...]  # for grpc.aio.server(interceptors=...)

    def shutdown(self) -> None:
        """Flush queued spans and stop the exporter (on server stop)."""
        self.provider.shutdown()


def traces_exporters(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The exporters the OTEL_* variables ask for; () when tracing is off.

    OTEL_TRACES_EXPORTER wins when set ("none" turns tracing off). Unset, an OTLP endpoint
    (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) alone turns OTLP on; with neither,
    tracing stays off rather than following the SDK's default of "otlp to localhost", so an unconfigured server
    pays nothing for it.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    named = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        names = tuple(dict.fromkeys(n.strip() for n in named.split(",") if n.strip()))
        unknown = [n for n in names if n not in (*EXPORTERS, "none")]
        if unknown:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter(s) {unknown}; use {EXPORTERS} or none")
        return tuple(n for n in names if n != "none")
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ("otlp",)
    return ()


def _exporter(name: str, environ: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc")
    if protocol != "grpc":
        # Only the gRPC OTLP exporter ships with the server; failing at start beats silently dropping spans.
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: lmrpc-server exports OTLP over grpc only")
    # Imported here: it pulls in its own generated protobuf modules, which an untraced server doesn't need.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, TLS, timeout: from the OTEL_EXPORTER_OTLP_* variables


def configure_tracing(environ: Mapping[str, str], exporter: SpanExporter | None = None) -> Tracing | None:
    """Build tracing as the OTEL_* variables in `environ` ask, or None when they don't ask for it.

    `exporter` replaces the exporter(s) the variables name (tests use an in-memory one); it is only used when
    the variables turn tracing on.
    """
    names = traces_exporters(environ)
    if not names:
        return None
    # Resource.create reads OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES; name the service only if they don't.
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER (default parent-based always-on)
    exporters = [exporter] if exporter is not None else [_exporter(n, environ) for n in names]
    for e in exporters:
        provider.add_span_processor(BatchSpanProcessor(e))
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return Tracing(provider, (aio_server_interceptor(tracer_provider=provider),))


def wall_time_ns(monotonic: float) -> int:
    """A time.monotonic() instant as the epoch nanoseconds span events take."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


def set_call_attributes(span: trace.Span, timelines: Iterable[OutputTimeline]) -> None:
    """Summarize a finished call's outputs on its server span (totals across outputs; distinct rids/reasons)."""
    timelines = list(timelines)
    if not span.is_recording() or not timelines:
        return
    usages = [t.usage for t in timelines if t.usage is not None]
    span.set_attributes({
        "lmrpc.rid": ",".join(dict.fromkeys(t.rid for t in timelines)),
        "lmrpc.num_outputs": len(timelines),
        "lmrpc.prompt_tokens": sum(u.prompt_tokens for u in usages),
        "lmrpc.completion_tokens": sum(u.completion_tokens for u in usages),
        "lmrpc.cached_tokens": sum(u.cached_tokens for u in usages),
        "lmrpc.finish_reason": ",".join(dict.fromkeys(t.finish_reason for t in timelines if t.finish_reason)),
    })


# ---- logs ------------------------------------------------------------------------------------------------------


def request_fields(timeline: OutputTimeline, status: grpc.StatusCode) -> dict[str, Any]:
    """The fields of one finished output's log record (seconds, rounded to microseconds; None if never reached)."""

    def seconds(value: float | None) -> float | None:
        return None if value is None else round(value, 6)

    usage = timeline.usage
    return {
        "rid": timeline.rid,
        "request_id": timeline.request_id,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
        "cached_tokens": usage.cached_tokens if usage else None,
        "queue_time": seconds(timeline.queue_time),
        "ttft": seconds(timeline.ttft),
        "e2e": seconds(timeline.e2e),
        "finish_reason": timeline.finish_reason,
        "grpc_status": status.name,
    }


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and a record's `fields` (request logs) merged in."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            # ISO 8601 in UTC with milliseconds: sortable and unambiguous across hosts.
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """The usual one-line text format, with a record's `fields` appended as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            line += "".join(f" {k}={v}" for k, v in fields.items())
        return line


def configure_logging(level: str, fmt: str) -> None:
    """Root logging to stderr in `fmt` ("text" or "json") at `level`."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


# ---- one call ----------------------------------------------------------------------------------------------------


class CallObserver:
    """Follows one Generate call: per-output timelines feed the metrics, the call's span and the request log.

    Built when the call arrives (inside the interceptor's span, if tracing is on). The service reports the
    outputs it submits (`queued`), every EngineOutput it receives (`output`), and the call's final status (`end`).
    """

    def __init__(self, metrics: Metrics | None, rid: str | None = None) -> None:
        self.arrival = time.monotonic()
        self.rid = rid  # logged for a call rejected before it had outputs
        self.span = trace.get_current_span()  # non-recording unless tracing is configured
        self.timelines: dict[str, OutputTimeline] = {}
        self._metrics = metrics

    def queued(self, requests: Iterable[EngineRequest]) -> None:
        for r in requests:
            self.timelines[r.request_id] = OutputTimeline(r.request_id, r.rid, self.arrival,
                                                          adapter=r.adapter.name if r.adapter is not None else None)
        if self.span.is_recording():
            self.span.add_event("queued", {"lmrpc.num_outputs": len(self.timelines)})

    def output(self, out: EngineOutput) -> None:
        timeline = self.timelines[out.request_id]
        timings = timeline.update(out, time.monotonic())
        if self._metrics is not None:
            self._metrics.observe_delta(timings)
        recording = self.span.is_recording()
        if recording and timings.queue_time is not None and timeline.scheduled is not None:
            self.span.add_event("prefill_start", {"lmrpc.request_id": out.request_id},
                                timestamp=wall_time_ns(timeline.scheduled))
        if recording and timings.ttft is not None:
            self.span.add_event("first_token", {"lmrpc.request_id": out.request_id})
        if out.finish is not None:
            self._finished(timeline)

    def _finished(self, timeline: OutputTimeline) -> None:
        if self._metrics is not None:
            self._metrics.observe_finished(timeline)
        if self.span.is_recording():
            attributes: dict[str, str | int] = {"lmrpc.request_id": timeline.request_id,
                                                "lmrpc.finish_reason": timeline.finish_reason or ""}
            if timeline.usage is not None:
                attributes["lmrpc.completion_tokens"] = timeline.usage.completion_tokens
            self.span.add_event("finished", attributes)

    def end(self, status: grpc.StatusCode) -> None:
        """The call is over: close outputs it left unfinished, set the span's attributes, log each output."""
        now = time.monotonic()
        for timeline in self.timelines.values():
            if timeline.finished is None:
                # Cancelled, deadline passed, or failed mid-stream: the engine aborts it, but its ABORT finish never
                # reaches this call, so it is counted here (without usage: the call never got one).
                timeline.finished, timeline.finish_reason = now, FinishReason.ABORT.name.lower()
                self._finished(timeline)
        set_call_attributes(self.span, self.timelines.values())
        if not self.timelines:  # rejected before it had outputs (invalid, over capacity, unavailable)
            fields = {"rid": self.rid, **dict.fromkeys(_OUTPUT_FIELDS), "grpc_status": status.name}
            _request_log.info("request finished", extra={"fields": fields})
        for timeline in self.timelines.values():
            _request_log.info("request finished", extra={"fields": request_fields(timeline, status)})
