"""The engine's outbox: a step's outputs reach the event loop in put order, with one wake-up of the loop per flush."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from lmrpc.server.engine import outbox
from lmrpc.server.engine.outbox import Outbox


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def settle(loop: asyncio.AbstractEventLoop) -> None:
    """Return once the loop has run what was posted to it before this call."""
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=10)


def test_one_wake_up_per_flush_and_put_order(loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    posts: list[Any] = []  # the outbox's posts to the loop (settle's own are not counted)
    post = loop.call_soon_threadsafe

    def counted(callback: Any, *args: Any) -> Any:
        if callback is outbox._deliver:
            posts.append(args)
        return post(callback, *args)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
    first: list[int] = []
    second: list[int] = []
    box = Outbox()
    for i in range(5):
        box.put(loop, first.append, i)
        box.put(loop, second.append, 10 + i)
    settle(loop)
    assert first == second == [] and posts == []  # nothing leaves before the flush
    box.flush()
    settle(loop)
    assert first == [0, 1, 2, 3, 4] and second == [10, 11, 12, 13, 14]
    assert len(posts) == 1
    box.flush()  # nothing pending: no wake-up
    assert len(posts) == 1


def test_each_loop_gets_its_own_outputs(loop: asyncio.AbstractEventLoop) -> None:
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()
    try:
        got: dict[str, list[str]] = {"a": [], "b": []}
        seen_on: dict[str, set[int | None]] = {"a": set(), "b": set()}

        def on(name: str) -> Any:
            def deliver(item: str) -> None:
                got[name].append(item)
                seen_on[name].add(threading.get_ident())
            return deliver

        box = Outbox()
        box.put(loop, on("a"), "a0")
        box.put(other, on("b"), "b0")
        box.put(loop, on("a"), "a1")
        box.flush()
        settle(loop)
        settle(other)
        assert got == {"a": ["a0", "a1"], "b": ["b0"]}
        assert seen_on["a"].isdisjoint(seen_on["b"])  # each ran on its own loop's thread
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join(timeout=10)
        other.close()


def test_a_closed_loop_drops_its_outputs_and_spares_the_others(loop: asyncio.AbstractEventLoop) -> None:
    closed = asyncio.new_event_loop()
    closed.close()
    got: list[int] = []
    box = Outbox()
    box.put(closed, got.append, 1)
    box.put(loop, got.append, 2)
    box.flush()  # no error: nobody is left to read the closed loop's outputs
    settle(loop)
    assert got == [2]
