"""SubscribeKvEvents: a subscriber's stream of `KvEventBatch`es from the KvEventLog (kv_events.py), with the
engine's load pushed on it (`EngineLoad`: the GetLoads figures), so SMG need not poll GetLoads.

The cursor (smg-grpc-proto's common.proto): start_sequence_number 0 is "the current state": a snapshot (one
`KvSnapshotChunk` batch per up to SNAPSHOT_BLOCKS blocks, AllBlocksCleared first, numbered to end at the state's
sequence) when anything was published, then live batches. A cursor n > 0 replays the batches after n still buffered;
one that no longer reaches them is OUT_OF_RANGE (SMG clears the worker and asks for the current state) and one past
the last batch is DATA_LOSS (an earlier process's cursor: the publisher restarted). A subscriber that falls so far
behind that its next batch was dropped ends OUT_OF_RANGE the same way: the engine never waits for it, and what it
missed is never buffered without bound.

Load records ride on every batch; between batches a `load_only` one (numbered as the last batch sent, or 0 before
the first when the subscriber asked for `load_records_before_first_batch`) goes out when the routing figures change
and at least every HEARTBEAT seconds, so an idle worker stays heard from.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import grpc
from smg_grpc_proto.generated import common_pb2

from lmrpc.server.load import Load
from lmrpc.server.sglang.kv_events import (
    Block,
    Cleared,
    CursorAhead,
    EventBatch,
    KvEvent,
    KvEventLog,
    Removed,
    Subscription,
)

HEARTBEAT = 1.0  # seconds between load records while nothing changes (SMG's --worker-stale-secs is 15 by default)
LOAD_POLL = 0.25  # seconds between reads of the load while no batch comes
SNAPSHOT_BLOCKS = 2048  # blocks per snapshot chunk: one message stays well under gRPC's 4 MiB default


@dataclass(frozen=True)
class LoadReading:
    load: Load
    waiting_uncached_tokens: int


class StreamEnded(Exception):
    """The subscription cannot go on: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _block(block: Block, page_size: int) -> common_pb2.KvBlock:
    return common_pb2.KvBlock(block_hash=block.block_hash, token_ids=block.token_ids, block_size=page_size)


def _stored(blocks: list[Block], page_size: int) -> common_pb2.KvBlocksStored:
    stored = common_pb2.KvBlocksStored(blocks=[_block(b, page_size) for b in blocks],
                                       tier=common_pb2.KV_CACHE_TIER_DEVICE,
                                       locality=common_pb2.KV_CACHE_LOCALITY_LOCAL)
    if blocks[0].parent_hash is not None:
        stored.parent_block_hash = blocks[0].parent_hash
    return stored


def proto_events(events: tuple[KvEvent, ...] | list[KvEvent], page_size: int,
                 first_id: int) -> list[common_pb2.KvCacheEvent]:
    """One proto event per stored block (each names its own parent), removed and cleared as they are."""
    out: list[common_pb2.KvCacheEvent] = []
    for event_id, event in enumerate(events, first_id):
        if isinstance(event, Removed):
            out.append(common_pb2.KvCacheEvent(event_id=event_id, removed=common_pb2.KvBlocksRemoved(
                block_hashes=[event.block_hash], tier=common_pb2.KV_CACHE_TIER_DEVICE)))
        elif isinstance(event, Cleared):
            out.append(common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared()))
        else:
            out.append(common_pb2.KvCacheEvent(event_id=event_id, stored=_stored([event.block], page_size)))
    return out


def engine_load(reading: LoadReading, sample: int, load_only: bool) -> common_pb2.EngineLoad:
    load = reading.load
    return common_pb2.EngineLoad(
        running_requests=load.running, waiting_requests=load.waiting,
        waiting_uncached_tokens=reading.waiting_uncached_tokens, token_usage=load.kv_usage,
        active_token_usage=load.kv_usage, gen_throughput=load.generation_tokens_per_second,
        max_running_requests=load.max_running, age_ms=0, sample=sample, load_only=load_only,
    )


def _routing_core(reading: LoadReading) -> tuple[int, int, float, int]:
    load = reading.load
    return load.running, load.waiting, load.kv_usage, reading.waiting_uncached_tokens


class KvEventStream:
    """One subscriber's stream (an async iterator of KvEventBatch). `read_load` is called on the event loop."""

    def __init__(self, log: KvEventLog, request: common_pb2.SubscribeKvEventsRequest,
                 read_load: Callable[[], LoadReading]) -> None:
        self._log = log
        self._start = request.start_sequence_number
        self._loads_first = request.load_records_before_first_batch
        self._read_load = read_load
        self._page_size = log.page_size
        self._sample = 0
        self._event_id = 1
        self._sent_sequence = 0  # the last sequence number sent (0: none yet)
        self._sent_core: tuple[int, int, float, int] | None = None
        self._sent_at = 0.0

    def _load(self, load_only: bool) -> common_pb2.EngineLoad:
        reading = self._read_load()
        self._sample += 1
        self._sent_core = _routing_core(reading)
        self._sent_at = time.monotonic()
        # The gateway's telemetry figures (tokens, pool size) go with the heartbeat cadence only (common.proto)
        record = engine_load(reading, self._sample, load_only)
        if load_only:
            record.num_used_tokens = reading.load.used_pages * self._page_size
            record.max_total_num_tokens = reading.load.num_pages * self._page_size
        return record

    def _batch(self, batch: EventBatch) -> common_pb2.KvEventBatch:
        events = proto_events(batch.events, self._page_size, self._event_id)
        self._event_id += len(events)
        self._sent_sequence = batch.sequence
        return common_pb2.KvEventBatch(sequence_number=batch.sequence, timestamp=batch.timestamp, events=events,
                                       dp_rank=0, load=self._load(load_only=False))

    def _snapshot(self) -> list[common_pb2.KvEventBatch]:
        snapshot = self._log.snapshot()
        if snapshot.sequence == 0:
            return []
        blocks = list(snapshot.blocks)
        chunks = [blocks[i:i + SNAPSHOT_BLOCKS] for i in range(0, len(blocks), SNAPSHOT_BLOCKS)] or [[]]
        if len(chunks) > snapshot.sequence:  # the chunks' numbers must end at the state's and stay above 0
            chunks = [blocks]
        now = time.time()
        out = []
        for index, chunk in enumerate(chunks):
            events = proto_events([Cleared()] if index == 0 else [], self._page_size, self._event_id)
            for block in chunk:
                # Synthesized events carry event_id 0 (common.proto's KvSnapshotChunk)
                events.append(common_pb2.KvCacheEvent(event_id=0, stored=_stored([block], self._page_size)))
            sequence = snapshot.sequence - len(chunks) + 1 + index
            out.append(common_pb2.KvEventBatch(
                sequence_number=sequence, timestamp=now, events=events, dp_rank=0,
                snapshot=common_pb2.KvSnapshotChunk(index=index, count=len(chunks), blocks=len(blocks),
                                                    unknown_before=0),
                load=self._load(load_only=False)))
        self._sent_sequence = snapshot.sequence
        return out

    def _read(self, subscription: Subscription, cursor: int) -> list[EventBatch]:
        try:
            batches = self._log.read_after(subscription, cursor)
        except CursorAhead as exc:
            raise StreamEnded(grpc.StatusCode.DATA_LOSS, str(exc)) from exc
        if batches is None:
            raise StreamEnded(grpc.StatusCode.OUT_OF_RANGE,
                              f"KV events after sequence {cursor} are no longer buffered: subscribe from 0 for the "
                              "current state")
        return batches

    def _load_due(self) -> bool:
        if self._sent_sequence == 0 and not self._loads_first:
            return False  # an older subscriber takes its first record with the first batch
        if time.monotonic() - self._sent_at >= HEARTBEAT:
            return True
        return _routing_core(self._read_load()) != self._sent_core

    async def __aiter__(self) -> AsyncGenerator[common_pb2.KvEventBatch, None]:
        log = self._log
        subscription = log.subscribe()
        try:
            cursor = self._start
            if cursor == 0:
                for message in self._snapshot():
                    yield message
                cursor = self._sent_sequence
            while True:
                batches = self._read(subscription, cursor)
                for batch in batches:
                    yield self._batch(batch)
                    cursor = batch.sequence
                if batches:
                    continue
                if self._load_due():
                    yield common_pb2.KvEventBatch(sequence_number=self._sent_sequence, timestamp=time.time(),
                                                  dp_rank=0, load=self._load(load_only=True))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(subscription.ready.wait(), LOAD_POLL)
        finally:
            log.unsubscribe(subscription)
