"""The engine watchdog: an asyncio task that notices an engine thread that died or stopped coming round its loop,
and says so where it matters: health (readiness) NOT_SERVING for the services, calls in flight ended UNAVAILABLE,
new calls refused, and the log says why. Liveness (health's "" service) is a separate answer: it fails when the
thread is dead, or stuck for three times the timeout (a step that never returns: restarting is the cure); a stuck
engine that comes back is served again.

The engine's loop stamps a heartbeat each time round (at least every IDLE_TICK when idle), so a stale heartbeat
means a step that has not returned. Staleness is counted in the watchdog's own ticks, not in wall-clock time, so a
whole process paused by the OS (SIGSTOP, a suspended VM) is not taken for a stuck engine when it resumes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

logger = logging.getLogger(__name__)

TICK = 1.0  # seconds between checks
LIVENESS_FACTOR = 3  # stuck this many times the timeout: liveness fails too


class EngineState(enum.Enum):
    SERVING = "serving"
    STUCK = "stuck"
    DEAD = "dead"


class Supervised(Protocol):
    """What the watchdog reads and does on the engine (AsyncEngine)."""

    @property
    def heartbeat(self) -> float: ...

    @property
    def thread_alive(self) -> bool: ...

    @property
    def died(self) -> BaseException | None: ...

    def fail_calls(self, reason: str) -> int: ...

    def recovered(self) -> None: ...


# Sets readiness (the services) and liveness ("") as the state asks: (services_serving, liveness_serving).
SetHealth = Callable[[bool, bool], Awaitable[None]]


class Watchdog:
    def __init__(self, engine: Supervised, set_health: SetHealth, stall_timeout: float, tick: float = TICK) -> None:
        self._engine = engine
        self._set_health = set_health
        self._stall_ticks = max(1, round(stall_timeout / tick))  # ticks without a heartbeat before "stuck"
        self._timeout = stall_timeout
        self._tick = tick
        self._last_heartbeat = engine.heartbeat
        self._stale = 0  # consecutive ticks that saw the same heartbeat
        self.state = EngineState.SERVING
        self._live = True  # what liveness reports now

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._tick)
            await self.check()

    async def check(self) -> None:
        heartbeat = self._engine.heartbeat
        if heartbeat != self._last_heartbeat:
            self._last_heartbeat, self._stale = heartbeat, 0
        else:
            self._stale += 1
        if not self._engine.thread_alive:
            state = EngineState.DEAD
        elif self._stale >= self._stall_ticks:
            state = EngineState.STUCK
        else:
            state = EngineState.SERVING
        live = state is EngineState.SERVING or (
            state is EngineState.STUCK and self._stale < LIVENESS_FACTOR * self._stall_ticks)
        if state is not self.state:
            await self._enter(state)
        if live != self._live:
            self._live = live
            if not live:
                logger.critical("engine stuck for %.0f s: liveness now fails (the process should be restarted)",
                                self._stale * self._tick)
            await self._set_health(self.state is EngineState.SERVING, live)

    async def _enter(self, state: EngineState) -> None:
        previous, self.state = self.state, state
        if state is EngineState.SERVING:
            self._engine.recovered()
            logger.warning("engine is making progress again after being %s: serving", previous.value)
            await self._set_health(True, self._live)
            return
        if state is EngineState.DEAD:
            died = self._engine.died
            reason = f"the engine thread died ({died!r})" if died is not None else "the engine thread ended"
        else:
            reason = (f"the engine has made no progress for {self._stale * self._tick:.0f} s with work pending "
                      "(--engine-stall-timeout)")
        failed = self._engine.fail_calls(f"engine unavailable: {reason}")
        logger.critical("%s: health NOT_SERVING, %d call(s) in flight ended UNAVAILABLE", reason, failed)
        self._live = state is not EngineState.DEAD and self._live
        await self._set_health(False, self._live)
