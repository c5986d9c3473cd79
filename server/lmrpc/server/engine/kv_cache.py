"""Paged KV-cache bookkeeping: a pool of fixed-size pages, per-sequence page tables, reference counts, and a
prefix cache. Pure Python (no torch): the executor owns the tensors, this owns which page is whose.

A page is referenced by live sequences (`_seq_refs`) and possibly by the prefix cache. It is free when neither
holds it; a page held only by the cache is evictable (LRU, leaves first, so every cached chain stays reachable).

The cache is a tree of pages chained by content. Full pages are shared in place. A finished sequence's last,
partly filled page is kept too (a partial leaf), and a new prompt that agrees with the first k tokens of any
cached child page gets those k slots copied into a fresh page of its own (`PageCopy`, done by the executor before
the step's forward), so reuse is token-granular: a repeated 1000-token prompt reuses 999 tokens, not 992.

A `CacheListener` (set on the engine thread) hears every page the cache takes in (`stored`), drops (`removed`) and
a flush that empties it (`cleared`), synchronously, as the bookkeeping changes: SMG's KV-event stream is built from
these (sglang/kv_events.py). `publish` ends an engine iteration for it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from lmrpc.server.engine.sequence import PageCopy, Sequence

# (parent page in the cache, or the chain's root; the page's keys: Sequence.cache_keys)
PageKey = tuple[int, tuple[int | bytes, ...]]

BASE_ROOT = -1  # Sequence.cache_root of the base model's chains (an adapter's roots are -2 - uid)

_node_ids = itertools.count(1)


@dataclass(frozen=True)
class CachedPage:
    """One page the prefix cache took in or let go, as a listener sees it."""

    node: int  # this cache entry's id: never reused, unlike its physical page
    parent: int | None  # the entry it is chained after (its `node`); None for a chain's first page
    root: int  # the chain's root: BASE_ROOT, or an adapter's (-2 - uid)
    page: int  # the physical page
    keys: tuple[int | bytes, ...]  # its positions' keys: token ids, or bytes for embedding/media positions
    full: bool  # a full page (False: a finished sequence's partial last page, only ever a leaf)


class CacheListener(Protocol):
    """Told, on the engine thread and in order, what the prefix cache holds. Must not block: it runs inside the
    engine's loop (a listener queues what it hears; `publish` marks the end of an engine iteration)."""

    def stored(self, page: CachedPage) -> None: ...

    def removed(self, page: CachedPage) -> None: ...

    def cleared(self) -> None: ...

    def publish(self) -> None: ...


@dataclass(eq=False)
class _Node:
    """One cached full page."""

    key: PageKey  # how it is found: chained from its parent page; a partial page has fewer than page_size tokens
    page: int  # the physical page holding its K/V
    parent: _Node | None  # the cached page before it (None for a prompt's first page)
    root: int  # the chain's root (Sequence.cache_root)
    children: int = 0  # cached pages chained after it; only leaves are evicted
    alive: bool = True  # False once dropped: a sequence's chain may still point at it and must not extend it
    uid: int = field(default_factory=lambda: next(_node_ids))

    @property
    def parent_page(self) -> int:
        return self.key[0]

    def view(self, page_size: int) -> CachedPage:
        keys = self.key[1]
        return CachedPage(self.uid, None if self.parent is None else self.parent.uid, self.root, self.page, keys,
                          len(keys) == page_size)


@dataclass
class _Chain:
    """How far a sequence's pages were offered to the prefix cache."""

    num_committed: int = 0  # leading pages of the page table already considered
    parent: _Node | None = None  # the cache node of the last considered page


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True) -> None:
        assert num_pages >= 1 and page_size >= 1
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self._free: deque[int] = deque(range(num_pages))
        self._seq_refs = [0] * num_pages  # live sequences holding each page
        self._nodes: dict[PageKey, _Node] = {}
        self._node_of_page: dict[int, _Node] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # cached pages, least recently used first
        self._num_used = 0  # pages with _seq_refs > 0
        self._num_cached_only = 0  # cached pages with _seq_refs == 0
        self._chains: dict[Sequence, _Chain] = {}
        # parent page (or a root: -1 the base model, -2 - uid a LoRA adapter, Sequence.cache_root) -> cached pages
        # chained after it
        self._kids: dict[int, set[_Node]] = {}
        self._pending_copies: dict[Sequence, PageCopy] = {}  # matched partial pages, not yet handed to a step
        self._copying: list[PageCopy] = []  # handed to the current step; their sources stay referenced until done
        self._listener: CacheListener | None = None

    # ---- counters ----------------------------------------------------------------------------------------------

    @property
    def num_used_pages(self) -> int:
        return self._num_used

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached_only

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + self._num_cached_only

    # ---- references ---------------------------------------------------------------------------------------------

    def _incref(self, page: int) -> None:
        if self._seq_refs[page] == 0:
            self._num_used += 1
            if page in self._node_of_page:
                self._num_cached_only -= 1
        self._seq_refs[page] += 1

    def _decref(self, page: int) -> None:
        assert self._seq_refs[page] > 0, f"page {page} released more often than taken"
        self._seq_refs[page] -= 1
        if self._seq_refs[page] == 0:
            self._num_used -= 1
            if page in self._node_of_page:
                self._num_cached_only += 1
            else:
                self._free.append(page)

    def _take_page(self) -> int:
        if not self._free:
            self._evict_one()
        page = self._free.popleft()
        self._incref(page)
        return page

    def _evict_one(self) -> None:
        for page, node in self._lru.items():
            if node.children == 0 and self._seq_refs[page] == 0:
                self._drop(node)
                return
        raise AssertionError("no free or evictable page: callers must check can_allocate first")

    def _drop(self, node: _Node, notify: bool = True) -> None:
        node.alive = False
        del self._nodes[node.key]
        del self._node_of_page[node.page]
        del self._lru[node.page]
        self._kids[node.parent_page].discard(node)
        if node.parent is not None:
            node.parent.children -= 1
        self._num_cached_only -= 1
        self._free.append(node.page)
        if notify and self._listener is not None:
            self._listener.removed(node.view(self.page_size))

    def _insert(self, key: PageKey, page: int, parent: _Node | None, root: int) -> _Node:
        node = _Node(key, page, parent, root)
        if parent is not None:
            parent.children += 1
        self._nodes[key] = node
        self._node_of_page[page] = node
        self._kids.setdefault(key[0], set()).add(node)
        if self._seq_refs[page] == 0:
            self._num_cached_only += 1
        self._lru[page] = node
        if self._listener is not None:
            self._listener.stored(node.view(self.page_size))
        return node

    # ---- listener and flush -------------------------------------------------------------------------------------

    def set_listener(self, listener: CacheListener | None) -> None:
        """Tell `listener` from now on; it first hears every page cached now, parents before children."""
        self._listener = listener
        if listener is not None:
            for node in self._nodes.values():  # insertion order: a parent is always inserted before its children
                listener.stored(node.view(self.page_size))

    def publish(self) -> None:
        """The end of an engine iteration: the listener may hand on what it heard during it."""
        if self._listener is not None:
            self._listener.publish()

    def flush(self) -> int:
        """Drop every cached page no sequence holds (leaves first, until none is left that may go). The listener
        hears `cleared` when the cache ends empty, else each dropped page. Returns how many were dropped."""
        dropped: list[_Node] = []
        while True:
            leaves = [n for n in self._lru.values() if n.children == 0 and self._seq_refs[n.page] == 0]
            if not leaves:
                break
            for node in leaves:
                self._drop(node, notify=False)
            dropped.extend(leaves)
        if self._listener is not None and dropped:
            if not self._nodes:
                self._listener.cleared()
            else:
                for node in dropped:
                    self._listener.removed(node.view(self.page_size))
        return len(dropped)

    def cached_pages(self) -> list[CachedPage]:
        """What the prefix cache holds now, parents before children (tests compare listeners with it)."""
        return [node.view(self.page_size) for node in self._nodes.values()]

    # ---- sequences ----------------------------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> None:
        """Reuse cached pages for the longest page-aligned prefix of `seq` that may be cached."""
        assert not seq.page_table and seq.num_computed_tokens == 0
        chain = _Chain()
        if self.enable_prefix_cache:
            size = self.page_size
            for i in range(seq.max_cacheable_prompt_tokens // size):
                key = (_parent(chain, seq), tuple(seq.cache_keys(i * size, (i + 1) * size)))
                node = self._nodes.get(key)
                if node is None:
                    break
                self._incref(node.page)
                self._lru.move_to_end(node.page)
                seq.page_table.append(node.page)
                chain = _Chain(len(seq.page_table), node)
        seq.num_computed_tokens = len(seq.page_table) * self.page_size
        self._chains[seq] = chain
        if self.enable_prefix_cache:
            self._match_partial(seq, chain)

    def _match_partial(self, seq: Sequence, chain: _Chain) -> None:
        """Copy the longest agreeing head of a cached child page into a fresh page (see the module doc)."""
        start = seq.num_computed_tokens
        wanted = seq.cache_keys(start, seq.max_cacheable_prompt_tokens)
        if not wanted:
            return
        best, best_len = None, 0
        for node in self._kids.get(_parent(chain, seq), ()):
            n = _common_prefix(node.key[1], wanted)
            if n > best_len:
                best, best_len = node, n
        if best is None:
            return
        self._incref(best.page)  # the source must outlive the copy: no eviction may take it meanwhile
        if self.num_free_pages == 0:
            self._decref(best.page)
            return
        self._lru.move_to_end(best.page)
        dst = self._take_page()
        seq.page_table.append(dst)
        seq.num_computed_tokens += best_len
        self._pending_copies[seq] = PageCopy(best.page, dst, best_len)

    def take_copies(self) -> tuple[PageCopy, ...]:
        """The page copies the next step must run before its forward; call release_copies after it."""
        copies = tuple(self._pending_copies.values())
        self._pending_copies.clear()
        self._copying.extend(copies)
        return copies

    def release_copies(self) -> None:
        """The copies handed out are done (or abandoned with their step): let go of their sources."""
        for copy in self._copying:
            self._decref(copy.src)
        self._copying.clear()

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.page_size) - len(seq.page_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.pages_needed(seq, num_new_tokens) <= self.num_free_pages

    def max_allocatable_tokens(self, seq: Sequence) -> int:
        """How many more tokens `seq` could hold with the pages free now."""
        slack = len(seq.page_table) * self.page_size - seq.num_computed_tokens
        return slack + self.num_free_pages * self.page_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.pages_needed(seq, num_new_tokens)
        assert needed <= self.num_free_pages, "allocate without can_allocate"
        seq.page_table.extend(self._take_page() for _ in range(needed))

    def commit(self, seq: Sequence) -> None:
        """Offer the sequence's newly full pages to the prefix cache."""
        if not self.enable_prefix_cache:
            return
        chain = self._chains.setdefault(seq, _Chain())
        size = self.page_size
        full = min(seq.num_computed_tokens // size, len(seq.page_table))
        while chain.num_committed < full:
            if chain.parent is not None and not chain.parent.alive:
                # The chain ran through a page another sequence cached (ours stayed private) and that page was
                # evicted since: its physical page may hold other content now, so nothing may chain off it.
                break
            i = chain.num_committed
            key = (_parent(chain, seq), tuple(seq.cache_keys(i * size, (i + 1) * size)))
            node = self._nodes.get(key)
            if node is None:
                page = seq.page_table[i]
                if page in self._node_of_page:  # shared page already cached under another chain: stop here
                    break
                node = self._insert(key, page, chain.parent, seq.cache_root)
            # else: an identical page computed by another sequence is cached; ours stays private, and later
            # pages chain off the cached one so they stay reachable.
            self._lru[node.page] = node
            self._lru.move_to_end(node.page)
            chain.num_committed += 1
            chain.parent = node

    def free(self, seq: Sequence) -> None:
        copy = self._pending_copies.pop(seq, None)
        if copy is not None:  # admitted and dropped in the same schedule: the copy never runs
            self._decref(copy.src)
        self._keep_partial_tail(seq)
        for page in seq.page_table:
            self._decref(page)
        seq.page_table = []
        self._chains.pop(seq, None)

    def _keep_partial_tail(self, seq: Sequence) -> None:
        """Cache the computed head of the sequence's last, partly filled page as a partial leaf."""
        chain = self._chains.get(seq)
        size = self.page_size
        index, filled = divmod(seq.num_computed_tokens, size)
        if (not self.enable_prefix_cache or chain is None or filled == 0 or index >= len(seq.page_table)
                or chain.num_committed != index or seq in self._pending_copies
                or (chain.parent is not None and not chain.parent.alive)):
            return
        page = seq.page_table[index]
        key = (_parent(chain, seq), tuple(seq.cache_keys(index * size, index * size + filled)))
        if page in self._node_of_page or key in self._nodes or self._seq_refs[page] != 1:
            return  # already cached, an identical tail is, or another sequence still writes this page
        self._insert(key, page, chain.parent, seq.cache_root)

    def check_invariants(self) -> None:
        """Every page is exactly one of: free, cached only, used (tests call this)."""
        used = sum(1 for r in self._seq_refs if r > 0)
        cached_only = sum(1 for p in self._node_of_page if self._seq_refs[p] == 0)
        assert used == self._num_used and cached_only == self._num_cached_only
        assert len(set(self._free)) == len(self._free)
        assert len(self._free) + used + cached_only == self.num_pages


def _parent(chain: _Chain, seq: Sequence) -> int:
    """The key's first half for the next page of the chain: its cached parent page, or the sequence's root."""
    return chain.parent.page if chain.parent else seq.cache_root


def _common_prefix(a: tuple[int | bytes, ...], b: list[int | bytes]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # b may be longer or shorter than the page
        if x != y:
            break
        n += 1
    return n
