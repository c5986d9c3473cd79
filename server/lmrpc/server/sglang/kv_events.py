"""The prefix cache's changes as SMG's KV events: a `CacheListener` on the engine thread (kv_cache.py) that turns each
full page the cache takes in into a stored block, each page it drops into a removed one and an emptying flush into
`cleared`, sealed into one numbered batch per engine iteration, kept in a bounded buffer that any number of
subscribers (SubscribeKvEvents streams, on the event loop) read at their own pace.

What a block is, as SMG's event-driven index reads it (smg-grpc-proto's common.proto, and the `kv_events` module of
SMG's own servicers): `token_ids` one full page (`block_size` = the page size), `block_hash` a 64-bit identity that
a later `removed` names, `parent_block_hash` the page before it in the prompt. The gateway hashes the token ids
itself to match a request's pages; the block hash only ties events together. Here it is the chained blake2b of the
parent's hash and the page's tokens, so equal prompts give equal hashes (each cache entry is a distinct chain).

Published are the base model's pages of token ids only: a page keyed by embedding rows or media (bytes keys) names no
token the gateway could match, an adapter's chain holds other K/V than the base model's for the same tokens, and a
partial page is no block. A page whose parent was not published is not either (its chain is unknown to SMG).

The engine never waits on a subscriber: `publish` appends to a deque of at most `max_batches` batches and wakes the
waiting subscribers' loops; a subscriber whose cursor falls out of it is told so (`read_after` returns None) and
resyncs from a `snapshot` of the published blocks, taken under the same lock, at a known sequence number.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import threading
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from lmrpc.server.engine.kv_cache import BASE_ROOT, CachedPage

MAX_BATCHES = 4096  # batches kept for replay and for slow subscribers; older ones are dropped


@dataclass(frozen=True)
class Block:
    block_hash: int  # signed 64-bit, as the proto's int64
    parent_hash: int | None  # the block before it in the prompt; None for a prompt's first page
    token_ids: tuple[int, ...]  # one page


@dataclass(frozen=True)
class Stored:
    block: Block


@dataclass(frozen=True)
class Removed:
    block_hash: int


@dataclass(frozen=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


@dataclass(frozen=True)
class EventBatch:
    sequence: int  # 1, 2, ...: consecutive
    timestamp: float  # time.time() when sealed
    events: tuple[KvEvent, ...]


@dataclass(frozen=True)
class Snapshot:
    sequence: int  # the last batch whose changes the blocks include (0: none yet)
    blocks: tuple[Block, ...]  # every published block, parents before children


class CursorAhead(Exception):
    """A cursor past the last sequence: it was handed out by an earlier process (the publisher restarted)."""


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"root" if parent is None else parent.to_bytes(8, "little", signed=True))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


@dataclass(eq=False)
class Subscription:
    """One subscriber's wake-up: set (on its loop) when a batch is sealed after it last read."""

    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    notified: bool = False  # a wake-up is posted and not yet consumed (under the log's lock)


class KvEventLog:
    """Engine-thread side: the CacheListener methods. Any other thread: `subscribe`, `read_after`, `snapshot`."""

    def __init__(self, page_size: int, max_batches: int = MAX_BATCHES) -> None:
        self.page_size = page_size
        # engine thread only
        self._hashes: dict[int, int] = {}  # CachedPage.node -> block hash, for published pages
        self._pending: list[KvEvent] = []  # heard during the current engine iteration
        # under _lock
        self._lock = threading.Lock()
        self._sequence = 0
        self._batches: deque[EventBatch] = deque(maxlen=max_batches)
        self._live: OrderedDict[int, Block] = OrderedDict()  # published blocks as of _sequence, in store order
        self._subscriptions: set[Subscription] = set()

    # ---- CacheListener (engine thread) --------------------------------------------------------------------------

    def stored(self, page: CachedPage) -> None:
        if not page.full or page.root != BASE_ROOT:
            return
        keys = page.keys
        if not all(isinstance(k, int) for k in keys):
            return
        parent = None if page.parent is None else self._hashes.get(page.parent)
        if page.parent is not None and parent is None:
            return
        tokens = tuple(k for k in keys if isinstance(k, int))
        h = block_hash(parent, tokens)
        self._hashes[page.node] = h
        self._pending.append(Stored(Block(h, parent, tokens)))

    def removed(self, page: CachedPage) -> None:
        h = self._hashes.pop(page.node, None)
        if h is not None:
            self._pending.append(Removed(h))

    def cleared(self) -> None:
        self._hashes.clear()
        self._pending.append(Cleared())

    def publish(self) -> None:
        """Seal what was heard since the last call into one batch and wake the subscribers (never waits on them)."""
        if not self._pending:
            return
        events, self._pending = tuple(self._pending), []
        with self._lock:
            self._sequence += 1
            self._batches.append(EventBatch(self._sequence, time.time(), events))
            for event in events:
                if isinstance(event, Stored):
                    self._live[event.block.block_hash] = event.block
                elif isinstance(event, Removed):
                    self._live.pop(event.block_hash, None)
                else:
                    self._live.clear()
            woken = [s for s in self._subscriptions if not s.notified]
            for subscription in woken:
                subscription.notified = True
        for subscription in woken:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody is left to read
                subscription.loop.call_soon_threadsafe(subscription.ready.set)

    # ---- subscribers (event loop) -------------------------------------------------------------------------------

    @property
    def sequence(self) -> int:
        with self._lock:
            return self._sequence

    def subscribe(self) -> Subscription:
        subscription = Subscription(asyncio.get_running_loop())
        with self._lock:
            self._subscriptions.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscriptions.discard(subscription)

    def read_after(self, subscription: Subscription, cursor: int) -> list[EventBatch] | None:
        """The batches after `cursor`, oldest first ([] if none yet); None if some of them were dropped already.
        Raises CursorAhead for a cursor past the last batch. Re-arms the subscription's wake-up first, so a batch
        sealed after this read wakes it."""
        subscription.ready.clear()
        with self._lock:
            subscription.notified = False
            if cursor > self._sequence:
                raise CursorAhead(f"sequence {cursor} was never published here (the last is {self._sequence}): "
                                  "the publisher restarted")
            if cursor == self._sequence:
                return []
            if not self._batches or self._batches[0].sequence > cursor + 1:
                return None
            start = cursor + 1 - self._batches[0].sequence
            return list(itertools.islice(self._batches, start, None))

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self._sequence, tuple(self._live.values()))
