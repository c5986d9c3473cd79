"""The engine thread's outbox: outputs bound for an asyncio event loop, posted to it together.

`loop.call_soon_threadsafe` writes to the loop's wake-up socket on every call. One call per output meant a system
call and a wake-up of the event loop per token of every stream: at 32 streams the loop woke 32 times a step, each
time taking a core from the model's two compute threads in the middle of the forward (served decode steps take
longer than the engine's own; these wake-ups were part of it). Collected here during an engine iteration and flushed
at its end, a step's outputs cost one wake-up per loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Delivery = tuple[Callable[[Any], None], Any]  # (a callback to run on the loop, its one argument)


def _deliver(items: list[Delivery]) -> None:  # event loop
    for callback, item in items:
        callback(item)


class Outbox:
    """Engine-thread side only: `put` during an iteration, `flush` at its end."""

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}  # in put order, per loop

    def put(self, loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None], item: Any) -> None:
        """Run callback(item) on loop at the next flush; calls on one loop run in put order."""
        self._pending.setdefault(loop, []).append((callback, item))

    def flush(self) -> None:
        """Post everything put since the last flush: one call_soon_threadsafe per loop."""
        pending, self._pending = self._pending, {}
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                if not loop.is_closed():
                    raise
                # Its calls are gone with it: nobody is left to read these outputs.
                logger.debug("dropped %d outputs for a closed event loop", len(items))
