"""The prefix cache's listener and SMG's KV events built from it (no model): a listener's mirror of the cache equals
the cache after every step of a random workload with eviction (stored parents always alive, nothing leaked, a flush
ends in `cleared` with every page free); the event log publishes full base-model pages only, chained by hash, with
consecutive sequence numbers, and its snapshot equals the cache's full pages; a subscriber that never reads does not
hold the engine back nor grow the buffer; SubscribeKvEvents' cursor rules (snapshot at 0, replay, OUT_OF_RANGE for a
dropped cursor, DATA_LOSS for one from the future) and its load records."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from lmrpc.server.config import SchedulerConfig
from lmrpc.server.engine.kv_cache import CachedPage, KVCacheManager
from lmrpc.server.engine.scheduler import Scheduler
from lmrpc.server.engine.sequence import SeqStatus, Sequence
from lmrpc.server.engine.types import EngineRequest, SamplingParams
from lmrpc.server.load import Load
from lmrpc.server.sglang.kv_events import Block, Cleared, KvEventLog, Removed, Stored, Subscription, block_hash
from lmrpc.server.sglang.kv_stream import KvEventStream, LoadReading, StreamEnded

PAGE = 4


class Mirror:
    """A listener that keeps what it was told."""

    def __init__(self) -> None:
        self.pages: dict[int, CachedPage] = {}
        self.clears = 0
        self.publishes = 0

    def stored(self, page: CachedPage) -> None:
        assert page.node not in self.pages
        assert page.parent is None or page.parent in self.pages, "stored under a page no longer cached"
        self.pages[page.node] = page

    def removed(self, page: CachedPage) -> None:
        assert not any(p.parent == page.node for p in self.pages.values()), "removed before its children"
        del self.pages[page.node]

    def cleared(self) -> None:
        self.pages.clear()
        self.clears += 1

    def publish(self) -> None:
        self.publishes += 1


def seq(prompt: list[int], max_new: int = 4, rid: str = "r") -> Sequence:
    return Sequence(EngineRequest(rid, rid, 0, tuple(prompt), SamplingParams(max_new_tokens=max_new)))


def step(s: Scheduler) -> None:
    batch = s.schedule()
    s.on_computed(batch)
    for c in batch.chunks:
        if c.samples:
            c.seq.append_token((c.seq.token_ids[-1] * 7 + 3) % 1000)
            if c.seq.num_output_tokens >= c.seq.request.params.max_new_tokens:
                s.finish(c.seq)
    s.kv.publish()
    s.kv.check_invariants()


def random_workload(s: Scheduler, rng: random.Random, after_step: Callable[[], None] | None = None) -> None:
    shared = [rng.randrange(1000) for _ in range(13)]
    live: list[Sequence] = []
    for i in range(250):
        prompt = (shared if rng.random() < 0.6 else []) + [rng.randrange(1000) for _ in range(rng.randrange(1, 18))]
        q = seq(prompt, rng.randrange(1, 12), f"r{i}")
        s.add(q)
        live.append(q)
        for _ in range(rng.randrange(0, 3)):
            step(s)
            if after_step is not None:
                after_step()
        if rng.random() < 0.3:
            victim = rng.choice(live)
            if victim.status is not SeqStatus.FINISHED:
                s.finish(victim)
        live = [q for q in live if q.status is not SeqStatus.FINISHED]
    while s.has_work:
        step(s)


def make(num_pages: int = 40) -> Scheduler:
    return Scheduler(SchedulerConfig(max_running_requests=6, max_batched_tokens=48, max_prefill_chunk=16),
                     KVCacheManager(num_pages, PAGE))


def test_a_listener_mirrors_the_cache_through_eviction_and_a_flush_leaves_no_page_behind() -> None:
    s = make()
    mirror = Mirror()
    s.kv.set_listener(mirror)

    def same() -> None:
        assert mirror.pages == {p.node: p for p in s.kv.cached_pages()}

    random_workload(s, random.Random(3), same)
    same()
    assert s.kv.num_used_pages == 0 and mirror.pages  # pages stay cached after their sequences end
    assert s.kv.flush() > 0
    assert mirror.clears == 1 and not mirror.pages and not s.kv.cached_pages()
    s.kv.check_invariants()
    assert s.kv.num_free_pages == s.kv.num_pages and s.kv.num_cached_pages == 0


def test_a_listener_set_late_hears_what_is_cached_first() -> None:
    s = make()
    random_workload(s, random.Random(4))
    mirror = Mirror()
    s.kv.set_listener(mirror)  # parents before children, or Mirror.stored fails
    assert mirror.pages == {p.node: p for p in s.kv.cached_pages()}


def test_flush_keeps_pages_a_running_sequence_holds() -> None:
    kv = KVCacheManager(8, PAGE)
    mirror = Mirror()
    kv.set_listener(mirror)
    a, b = seq(list(range(9))), seq([50, 51, 52, 53, 54])
    for q in (a, b):
        kv.match_prefix(q)
        kv.allocate(q, q.num_tokens)
        q.num_computed_tokens = q.num_tokens
        kv.commit(q)
    kv.free(b)  # b's full page and its partial tail are cached only; a still holds its two full pages
    assert kv.flush() == 2
    assert mirror.clears == 0 and {p.keys for p in mirror.pages.values()} == {(0, 1, 2, 3), (4, 5, 6, 7)}
    kv.free(a)
    kv.flush()
    assert mirror.clears == 1 and kv.num_free_pages == 8
    kv.check_invariants()


def test_a_chain_through_an_evicted_page_is_not_extended() -> None:
    """x computed its first page while y cached an identical one; y's pages are then evicted: x's next page must not
    be cached under the evicted page (its physical page may hold other tokens by then)."""
    kv = KVCacheManager(8, PAGE)
    mirror = Mirror()
    kv.set_listener(mirror)
    x, y = seq([0, 1, 2, 3, 100, 101, 102, 103, 9]), seq(list(range(8)))
    kv.match_prefix(x)
    kv.allocate(x, 4)
    kv.match_prefix(y)
    kv.allocate(y, 8)
    y.num_computed_tokens = 8
    kv.commit(y)  # y's [0..3] and [4..7] cached
    x.num_computed_tokens = 4
    kv.commit(x)  # identical to y's first page: x's copy stays private, its chain runs through y's
    kv.free(y)
    z = seq(list(range(500, 528)))
    kv.match_prefix(z)
    kv.allocate(z, 28)  # takes the free pages and evicts both of y's
    assert not mirror.pages
    kv.free(z)
    kv.allocate(x, 4)
    x.num_computed_tokens = 8
    kv.commit(x)  # Mirror.stored fails if this chains off the evicted page
    assert all(p.keys != (100, 101, 102, 103) for p in kv.cached_pages())
    kv.free(x)
    kv.check_invariants()


# ---- the event log -------------------------------------------------------------------------------------------------


def test_the_log_publishes_full_token_pages_chained_by_hash() -> None:
    s = make()
    log = KvEventLog(PAGE)
    s.kv.set_listener(log)
    random_workload(s, random.Random(5))
    snapshot = log.snapshot()
    full = [p for p in s.kv.cached_pages() if p.full]
    assert sorted(b.token_ids for b in snapshot.blocks) == sorted(p.keys for p in full)
    hashes = {b.block_hash: b for b in snapshot.blocks}
    assert len(hashes) == len(snapshot.blocks)
    for b in snapshot.blocks:  # parents before children, each hash the chain's
        assert b.parent_hash is None or list(hashes).index(b.parent_hash) < list(hashes).index(b.block_hash)
        assert b.block_hash == block_hash(b.parent_hash, b.token_ids) and len(b.token_ids) == PAGE
    sub = asyncio_free_subscription(log)
    batches = log.read_after(sub, 0)
    assert batches is not None and [b.sequence for b in batches] == list(range(1, snapshot.sequence + 1))
    replayed: dict[int, Block] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, Stored):
                assert event.block.parent_hash is None or event.block.parent_hash in replayed
                replayed[event.block.block_hash] = event.block
            elif isinstance(event, Removed):
                del replayed[event.block_hash]
            else:
                replayed.clear()
    assert replayed == hashes
    s.kv.flush()
    s.kv.publish()
    last = log.read_after(sub, snapshot.sequence)
    assert last is not None and [b.events for b in last] == [(Cleared(),)] and not log.snapshot().blocks


def asyncio_free_subscription(log: KvEventLog) -> Subscription:
    """A subscription for synchronous reads (read_after only uses its flag and event)."""
    loop = asyncio.new_event_loop()
    loop.close()
    return Subscription(loop)


def test_pages_of_an_adapter_or_of_embeddings_are_not_published() -> None:
    log = KvEventLog(PAGE)
    log.stored(CachedPage(1, None, -2, 0, (1, 2, 3, 4), True))  # an adapter's chain
    log.stored(CachedPage(2, None, -1, 1, (b"row", 2, 3, 4), True))  # embedding rows
    log.stored(CachedPage(3, 2, -1, 2, (5, 6, 7, 8), True))  # under an unpublished page
    log.stored(CachedPage(4, None, -1, 3, (1, 2), False))  # a partial tail
    log.publish()
    assert log.sequence == 0 and not log.snapshot().blocks


async def test_a_subscriber_that_never_reads_holds_nothing_back() -> None:
    s = make(num_pages=24)
    log = KvEventLog(PAGE, max_batches=8)
    s.kv.set_listener(log)
    stream = KvEventStream(log, common_pb2.SubscribeKvEventsRequest(start_sequence_number=0), idle_load)
    iterator = stream.__aiter__()
    await asyncio.sleep(0)
    random_workload(s, random.Random(6))  # every publish returns: the engine never waits on the subscriber
    assert log.sequence > 8 and len(log._batches) == 8
    first = await anext(iterator)  # a subscriber from 0 starts from the current state: a snapshot
    assert first.snapshot.count >= 1 and first.events[0].HasField("cleared")
    assert first.sequence_number == log.sequence - first.snapshot.count + 1
    await iterator.aclose()


def idle_load() -> LoadReading:
    return LoadReading(Load(running=0, waiting=0, paused=0, kv_usage=0.0, num_pages=24, used_pages=0,
                            generation_tokens_per_second=0.0, prompt_tokens_per_second=0.0, queue_time_p50=0.0,
                            resident_bytes=0, memory_limit_bytes=0, max_running=6), 0)


def feed(log: KvEventLog, n: int) -> None:
    for i in range(n):
        log.stored(CachedPage(1000 + i, None, -1, i, (i, i, i, i), True))
        log.publish()


async def test_a_cursor_replays_what_is_buffered_and_later_batches_follow_live() -> None:
    log = KvEventLog(PAGE)
    feed(log, 5)
    iterator = KvEventStream(log, common_pb2.SubscribeKvEventsRequest(start_sequence_number=2),
                             idle_load).__aiter__()
    got = [await anext(iterator) for _ in range(3)]
    assert [b.sequence_number for b in got] == [3, 4, 5]
    assert [list(b.events[0].stored.blocks[0].token_ids) for b in got] == [[2] * 4, [3] * 4, [4] * 4]
    assert all(b.load.running_requests == 0 and not b.load.load_only for b in got)
    samples = [b.load.sample for b in got]
    assert samples == sorted(samples)
    pending = asyncio.ensure_future(anext(iterator))
    await asyncio.sleep(0.05)
    feed(log, 1)  # from another thread in the server; the wake-up is posted to this loop either way
    live = await asyncio.wait_for(pending, 10)
    assert live.sequence_number == 6
    await iterator.aclose()


async def test_a_dropped_cursor_is_out_of_range_and_a_future_one_is_data_loss() -> None:
    log = KvEventLog(PAGE, max_batches=4)
    feed(log, 10)
    for start, code in ((3, grpc.StatusCode.OUT_OF_RANGE), (11, grpc.StatusCode.DATA_LOSS)):
        iterator = KvEventStream(log, common_pb2.SubscribeKvEventsRequest(start_sequence_number=start),
                                 idle_load).__aiter__()
        with pytest.raises(StreamEnded) as ended:
            await anext(iterator)
        assert ended.value.code == code
    iterator = KvEventStream(log, common_pb2.SubscribeKvEventsRequest(start_sequence_number=6),
                             idle_load).__aiter__()
    assert (await anext(iterator)).sequence_number == 7  # still buffered
    await iterator.aclose()


async def test_load_records_come_before_the_first_batch_when_asked() -> None:
    log = KvEventLog(PAGE)
    request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=0, load_records_before_first_batch=True)
    iterator = KvEventStream(log, request, idle_load).__aiter__()
    first = await asyncio.wait_for(anext(iterator), 10)
    assert first.sequence_number == 0 and first.load.load_only and not first.events
    assert first.load.max_running_requests == 6 and first.load.max_total_num_tokens == 24 * PAGE
    await iterator.aclose()
