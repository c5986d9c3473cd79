"""How loaded this replica is, for routers and load balancers: the `GetLoad` RPC and the same figures as a gRPC ORCA
load report (`endpoint-load-metrics-bin` trailing metadata, an `xds.data.orca.v3.OrcaLoadReport`) on every call.

`LoadTracker` is fed by the engine thread (tokens computed per step, the queue time of each output when it is
first scheduled) and read from the event loop; it keeps one minute of history.

grpcio (checked on 1.85) has the C-core filter that writes ORCA reports, but no Python API to feed it (C++'s
`CallMetricRecorder`/`ServerMetricRecorder` have no Python counterpart), so the report is serialized here and set as
the trailing metadata the filter would have written; a client's weighted_round_robin policy reads it the same way.
The message is built from its published field numbers in a descriptor pool of our own: the PyPI package carrying
the xds protos (xds-protos) also ships copies of the google.rpc and opentelemetry protos that overwrite the ones
the server uses.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import Message

from lmrpc.server.engine.types import EngineStats

WINDOW = 60.0  # seconds of history behind every figure
MAX_QUEUE_SAMPLES = 4096  # queue times kept (the newest), so a burst cannot grow the tracker without bound
ORCA_TRAILER = "endpoint-load-metrics-bin"  # the trailing metadata key gRPC's ORCA readers look for


class LoadTracker:
    """Tokens per second and queue times over the last minute. Thread-safe (engine thread writes, loop reads)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._generated: deque[list[float]] = deque()  # [second, tokens] buckets, oldest first
        self._prompt: deque[list[float]] = deque()  # the same, for prompt tokens computed (prefill)
        self._queue_times: deque[tuple[float, float]] = deque(maxlen=MAX_QUEUE_SAMPLES)  # (when, seconds)

    def add_tokens(self, generated: int, prompt: int, now: float | None = None) -> None:
        """One step computed `prompt` prompt tokens and sampled `generated` tokens."""
        now = self._clock() if now is None else now
        second = float(int(now))
        with self._lock:
            for buckets, count in ((self._generated, generated), (self._prompt, prompt)):
                if not count:
                    continue
                if buckets and buckets[-1][0] == second:
                    buckets[-1][1] += count
                else:
                    buckets.append([second, float(count)])
                self._trim(buckets, now)

    def add_queue_time(self, seconds: float, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        with self._lock:
            self._queue_times.append((now, max(seconds, 0.0)))

    @staticmethod
    def _trim(buckets: deque[list[float]], now: float) -> None:
        while buckets and buckets[0][0] <= now - WINDOW:
            buckets.popleft()

    def _rate(self, buckets: deque[list[float]], now: float) -> float:
        self._trim(buckets, now)
        span = min(WINDOW, max(now - self._started, 1.0))  # a server up for 10 s has 10 s of history, not 60
        return sum(count for _, count in buckets) / span

    def snapshot(self, now: float | None = None) -> tuple[float, float, float]:
        """(generated tokens/s, prompt tokens/s, median queue time in s) over the last minute; 0 without data."""
        now = self._clock() if now is None else now
        with self._lock:
            generated = self._rate(self._generated, now)
            prompt = self._rate(self._prompt, now)
            recent = [seconds for when, seconds in self._queue_times if when > now - WINDOW]
        return generated, prompt, statistics.median(recent) if recent else 0.0


@dataclass(frozen=True)
class Load:
    """One reading of the replica's load (GetLoad's answer, and the ORCA report's figures)."""

    running: int  # outputs holding KV pages (prefilling or decoding)
    waiting: int  # outputs queued for admission, preempted ones included
    paused: int  # outputs not scheduled because their client is not reading (backpressure)
    kv_usage: float  # share of KV pages held by live outputs, [0, 1]
    num_pages: int  # KV pages in the pool
    used_pages: int  # pages held by live outputs
    generation_tokens_per_second: float  # sampled tokens over the last minute
    prompt_tokens_per_second: float  # prompt tokens computed over the last minute (prefix-cache hits excluded)
    queue_time_p50: float  # seconds, median of outputs first scheduled in the last minute
    resident_bytes: int  # the process's RSS
    memory_limit_bytes: int  # the binding cgroup limit, else the host's RAM size at start; 0 when unknown
    max_running: int  # --max-running-requests, to turn counts into utilisation


def read_load(stats: EngineStats, tracker: LoadTracker, resident: int, memory_limit: int, max_running: int) -> Load:
    generated, prompt, queue_p50 = tracker.snapshot()
    return Load(
        running=stats.num_running, waiting=stats.num_waiting, paused=stats.num_paused,
        kv_usage=stats.num_used_pages / stats.num_pages if stats.num_pages else 0.0,
        num_pages=stats.num_pages, used_pages=stats.num_used_pages,
        generation_tokens_per_second=generated, prompt_tokens_per_second=prompt, queue_time_p50=queue_p50,
        resident_bytes=resident, memory_limit_bytes=memory_limit, max_running=max_running,
    )


# xds.data.orca.v3.OrcaLoadReport's fields that are reported (number, name, kind): "map" is map<string, double>.
_ORCA_FIELDS = ((2, "mem_utilization", "double"), (5, "utilization", "map"), (8, "named_metrics", "map"),
                (9, "application_utilization", "double"))


@functools.cache
def _orca_class() -> type[Message]:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    d = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="lmrpc/orca_load_report.proto", package="xds.data.orca.v3",
                                              syntax="proto3")
    report = file.message_type.add(name="OrcaLoadReport")
    for number, name, kind in _ORCA_FIELDS:
        if kind == "double":
            report.field.add(name=name, number=number, type=d.TYPE_DOUBLE, label=d.LABEL_OPTIONAL)
            continue
        entry = "".join(part.capitalize() for part in name.split("_")) + "Entry"
        nested = report.nested_type.add(name=entry)
        nested.options.map_entry = True
        nested.field.add(name="key", number=1, type=d.TYPE_STRING, label=d.LABEL_OPTIONAL)
        nested.field.add(name="value", number=2, type=d.TYPE_DOUBLE, label=d.LABEL_OPTIONAL)
        report.field.add(name=name, number=number, type=d.TYPE_MESSAGE, label=d.LABEL_REPEATED,
                         type_name=f".xds.data.orca.v3.OrcaLoadReport.{entry}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("xds.data.orca.v3.OrcaLoadReport"))


def orca_report(load: Load) -> bytes:
    """The load as a serialized `xds.data.orca.v3.OrcaLoadReport`.

    application_utilization (what weighted_round_robin prefers over CPU) is the larger of KV usage and the share of
    running slots taken, plus the queue behind them: above 1 means a backlog, as the field allows.
    """
    slots = load.max_running or 1
    utilization = max(load.kv_usage, load.running / slots) + load.waiting / slots
    report = _orca_class()(
        application_utilization=utilization,
        mem_utilization=min(1.0, load.resident_bytes / load.memory_limit_bytes) if load.memory_limit_bytes else 0.0,
        utilization={"kv_cache": load.kv_usage},
        named_metrics={
            "running_outputs": float(load.running),
            "waiting_outputs": float(load.waiting),
            "generation_tokens_per_second": load.generation_tokens_per_second,
            "queue_time_p50_seconds": load.queue_time_p50,
        },
    )
    return bytes(report.SerializeToString())
