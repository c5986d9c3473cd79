"""Prometheus metrics: per-output timings measured where the service streams outputs, engine load read at scrape.

Beside lmrpc's own `lmrpc:*` names, the engine gauges are also exported under vLLM's names and semantics
(`vllm:num_requests_waiting`, ...): the Gateway API Inference Extension's endpoint picker (and llm-d's) read
those from any pod they route to, so lmrpc pods are scored like vLLM ones without a custom metrics config.

A "request" here is one output (one `EngineRequest`: a call with b prompts and n samples makes b * n), because
finish reasons, usage and timings all belong to an output. Every metric lives in the `CollectorRegistry` owned
by a `Metrics` object, so a process (or a test) can hold several without them sharing state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from lmrpc.server.engine.types import EngineOutput, EngineStats, Usage
from lmrpc.server.transport import ListenError

PREFIX = "lmrpc:"
VLLM = "vllm:"  # the names routers built for vLLM read

# Seconds. Fine at the low end (a CPU decode step is tens of ms, a GPU one a few) and long at the top (minutes of
# queueing under overload, or long generations).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0, 640.0)


@dataclass(frozen=True)
class DeltaTimings:
    """What one EngineOutput revealed about its output's timings (seconds)."""

    queue_time: float | None = None  # arrival -> first scheduled; on the first output that says when that was
    ttft: float | None = None  # arrival -> first token; on the output carrying the first token
    inter_token: tuple[float, ...] = ()  # one per later token: the gap since the previous output, shared evenly


@dataclass
class OutputTimeline:
    """One output's life as the service sees it; times are time.monotonic() (the engine stamps on the same clock)."""

    request_id: str  # EngineRequest.request_id
    rid: str  # user-facing request id
    arrival: float  # the call reached the servicer
    scheduled: float | None = None  # the engine first computed it
    first_token: float | None = None  # the first output with a token reached the servicer
    last_token: float | None = None  # the latest output with a token reached the servicer
    finished: float | None = None  # the last output reached the servicer
    finish_reason: str | None = None  # FinishReason name, lower case ("eos", "length", ...)
    usage: Usage | None = None  # from the last output
    adapter: str | None = None  # the LoRA adapter it ran under; None: the base model

    def update(self, out: EngineOutput, now: float) -> DeltaTimings:
        """Fold in one output received at `now`; return the timings it completes."""
        queue_time = ttft = None
        inter_token: tuple[float, ...] = ()
        if self.scheduled is None and out.scheduled_at is not None:
            self.scheduled = out.scheduled_at
            queue_time = max(out.scheduled_at - self.arrival, 0.0)
        if out.token_ids:
            if self.first_token is None:
                self.first_token = now
                ttft = now - self.arrival
                later = len(out.token_ids) - 1
                gap = 0.0  # tokens arriving together with the first one came with no gap
            else:
                assert self.last_token is not None
                later = len(out.token_ids)
                gap = (now - self.last_token) / later
            inter_token = (gap,) * later
            self.last_token = now
        if out.finish is not None:
            self.finished = now
            self.finish_reason = out.finish.reason.name.lower()
            self.usage = out.usage
        return DeltaTimings(queue_time, ttft, inter_token)

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled is None else max(self.scheduled - self.arrival, 0.0)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


StatsSource = Callable[[], EngineStats]


@dataclass
class _PromptCounts:
    """Cumulative prompt and prefix-cache-hit tokens of finished outputs, for the hit-ratio gauge."""

    prompt: int = 0
    cached: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # updated on the event loop, read by scrapes


class _EngineCollector:
    """Gauges computed at scrape time: engine load (when an engine is attached) and the prefix-cache hit ratio."""

    def __init__(self, counts: _PromptCounts, clock: Callable[[], float] = time.time) -> None:
        self._counts = counts
        self._clock = clock  # wall clock: vllm:lora_requests_info's value is when it was last updated
        self.stats: StatsSource | None = None  # set once the model is loaded

    def describe(self) -> Iterable[Metric]:
        # Names only: registering must not call into an engine that may not exist yet.
        return [*self._families(), *_vllm_families()]

    def collect(self) -> Iterable[Metric]:
        stats = self.stats() if self.stats is not None else None
        with self._counts.lock:
            prompt, cached = self._counts.prompt, self._counts.cached
        running, waiting, paused, kv, prefix, loras = self._families()
        if stats is not None:
            running.add_metric([], stats.num_running)
            waiting.add_metric([], stats.num_waiting)
            paused.add_metric([], stats.num_paused)
            # Pages held by live sequences, not cached-only ones: the prefix cache keeps pages after a request
            # ends (they are evictable, so free for admission), and counting them would never return to 0.
            kv.add_metric([], stats.num_used_pages / stats.num_pages if stats.num_pages else 0.0)
            loras.add_metric([], stats.num_loaded_adapters)
        prefix.add_metric([], cached / prompt if prompt else 0.0)
        if stats is None:
            return [prefix]
        return [running, waiting, paused, kv, prefix, loras, *self._vllm(stats)]

    def _vllm(self, stats: EngineStats) -> list[GaugeMetricFamily]:
        """The engine gauges under vLLM's names, labels and units (vllm/v1/metrics/loggers.py)."""
        running, waiting, kv, lora, cache = _vllm_families()
        running.add_metric([], stats.num_running)
        waiting.add_metric([], stats.num_waiting)
        # A fraction (1 = full) despite the name, as vLLM reports it; the pages counted are the lmrpc gauge's: vLLM
        # also counts cached-only blocks as free (they are in its free queue, evictable).
        kv.add_metric([], stats.num_used_pages / stats.num_pages if stats.num_pages else 0.0)
        # vLLM sets a new label set to the current time at every step and keeps the old series; the endpoint picker
        # takes the series with the latest value. Built at scrape, ours has one series, stamped now.
        lora.add_metric([str(stats.max_adapters), ",".join(stats.waiting_adapters), ",".join(stats.running_adapters)],
                        self._clock())
        # An info gauge (always 1): routers read the page size (block_size) to count prompt blocks.
        cache.add_metric([str(stats.page_size), str(stats.num_pages)], 1.0)
        return [running, waiting, kv, lora, cache]

    @staticmethod
    def _families() -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(f"{PREFIX}num_requests_running", "Outputs holding KV pages (prefilling or decoding).")
        yield GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Outputs queued for admission (incl. preempted).")
        yield GaugeMetricFamily(f"{PREFIX}num_requests_paused",
                                "Outputs not scheduled because their client is not reading them (backpressure).")
        yield GaugeMetricFamily(f"{PREFIX}kv_cache_usage_ratio",
                                "Share of KV-cache pages held by live outputs (cached-only pages count as free).")
        yield GaugeMetricFamily(f"{PREFIX}prefix_cache_hit_ratio",
                                "Prompt tokens served from the prefix cache / prompt tokens, over finished outputs.")
        yield GaugeMetricFamily(f"{PREFIX}lora_adapters_loaded", "LoRA adapters held in memory.")


def _vllm_families() -> tuple[GaugeMetricFamily, ...]:
    return (
        GaugeMetricFamily(f"{VLLM}num_requests_running", "Number of requests in model execution batches."),
        GaugeMetricFamily(f"{VLLM}num_requests_waiting", "Number of requests waiting to be processed."),
        GaugeMetricFamily(f"{VLLM}kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
        GaugeMetricFamily(f"{VLLM}lora_requests_info", "Running stats on lora requests.",
                          labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"]),
        GaugeMetricFamily(f"{VLLM}cache_config_info", "Information of the LLMEngine CacheConfig",
                          labels=["block_size", "num_gpu_blocks"]),
    )


class Metrics:
    """Every lmrpc metric, in a registry of its own."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Call arrival to an output's first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram(f"{PREFIX}inter_token_latency_seconds", "Gap between an output's tokens.",
                                     buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Call arrival to an output's last delta.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{PREFIX}request_queue_time_seconds",
                                    "Call arrival to the engine first scheduling an output.",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens_total", "Prompt tokens of finished outputs.",
                                     registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens_total", "Tokens generated by finished outputs.",
                                         registry=r)
        self.requests = Counter(f"{PREFIX}requests_total", "Finished outputs by finish reason.", ["finish_reason"],
                                registry=r)
        self.lora_requests = Counter(f"{PREFIX}lora_requests_total", "Finished outputs run under a LoRA adapter.",
                                     ["adapter"], registry=r)
        self.lora_generation_tokens = Counter(f"{PREFIX}lora_generation_tokens_total",
                                              "Tokens generated under a LoRA adapter by finished outputs.", ["adapter"],
                                              registry=r)
        self._counts = _PromptCounts()
        self._engine = _EngineCollector(self._counts, clock)  # clock: the wall clock (a test's own)
        r.register(self._engine)
        # process_resident_memory_bytes (and CPU seconds, open fds, ...) under their standard names, so memory growth
        # is visible next to the load.
        ProcessCollector(registry=r)

    def attach(self, stats: StatsSource) -> None:
        """Read engine load from `stats` at every scrape (called once the engine is up)."""
        self._engine.stats = stats

    def observe_delta(self, timings: DeltaTimings) -> None:
        if timings.queue_time is not None:
            self.queue_time.observe(timings.queue_time)
        if timings.ttft is not None:
            self.ttft.observe(timings.ttft)
        for gap in timings.inter_token:
            self.inter_token.observe(gap)

    def observe_finished(self, timeline: OutputTimeline) -> None:
        e2e = timeline.e2e
        if e2e is not None:
            self.e2e.observe(e2e)
        self.requests.labels(finish_reason=timeline.finish_reason or "unknown").inc()
        usage = timeline.usage
        if timeline.adapter is not None:
            self.lora_requests.labels(adapter=timeline.adapter).inc()
            if usage is not None:
                self.lora_generation_tokens.labels(adapter=timeline.adapter).inc(usage.completion_tokens)
        if usage is not None:
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.generation_tokens.inc(usage.completion_tokens)
            with self._counts.lock:
                self._counts.prompt += usage.prompt_tokens
                self._counts.cached += usage.cached_tokens


@dataclass
class MetricsServer:
    """The HTTP endpoint serving a registry (prometheus_client's threaded WSGI server)."""

    httpd: WSGIServer  # the listening server
    thread: threading.Thread  # its serve_forever thread

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
        try:
            httpd, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:  # EADDRINUSE, EADDRNOTAVAIL: the flags' fault, said as such
            raise ListenError(f"--metrics-port {port}: cannot listen on {host}:{port} ({e.strerror})") from e
        return cls(httpd, thread)

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
