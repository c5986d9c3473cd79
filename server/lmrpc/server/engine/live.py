"""What the engine loop keeps per request, the commands other threads send it, and the backpressure counters shared
between the loop and a request's consumer. No torch at import time."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmrpc.server.engine.sequence import Sequence
from lmrpc.server.engine.types import EngineOutput, EngineRequest, PositionLogprobs

if TYPE_CHECKING:
    from lmrpc.server.engine.detokenizer import OutputProcessor
    from lmrpc.server.engine.grammar import GrammarMatcher
    from lmrpc.server.engine.sampler import SamplingState
    from lmrpc.server.logit_processors import LogitProcessor

Sink = Callable[[EngineOutput], None]  # thread-safe: delivers one output to the request's consumer


class OutputFlow:
    """Backpressure of one output: deltas handed to its consumer (engine thread) against deltas it took (event loop).

    Each counter is written by one thread only, so no lock is needed. The engine pauses the output when the backlog
    reaches the bound and resumes it at half; `paused` is the engine's word on that, read by the consumer to know
    whether taking a delta should wake the engine.
    """

    __slots__ = ("emitted", "paused", "taken")

    def __init__(self) -> None:
        self.emitted = 0  # deltas (not the final output) sent to the consumer
        self.taken = 0  # deltas the consumer has taken off its queue
        self.paused = False  # the engine stopped scheduling this output

    @property
    def backlog(self) -> int:
        return self.emitted - self.taken


@dataclass(eq=False)
class LiveRequest:
    """Everything the loop keeps for one sequence besides the scheduler's bookkeeping."""

    seq: Sequence  # scheduler-visible state (tokens, pages)
    sink: Sink  # where this request's outputs go
    sampling: SamplingState  # penalties' counts, seed
    output: OutputProcessor  # incremental text + stop rules
    grammar: GrammarMatcher | None  # structured-output state, if constrained
    processor: LogitProcessor | None  # custom logit processor bound to its params, if any
    flow: OutputFlow | None = None  # backpressure counters; None: nobody reads slowly (warm-up, tests)
    submitted_at: float | None = None  # time.monotonic() when the request was posted: the start of its queue time
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # gathered across prefill chunks
    prompt_logprobs_sent: bool = False  # sent with the first output (never again, e.g. after preemption)
    pending_tokens: list[int] = field(default_factory=list)  # sampled since the last emit
    pending_logprobs: list[PositionLogprobs] = field(default_factory=list)  # their logprobs
    pending_text: list[str] = field(default_factory=list)  # their text pieces
    pending_hidden: list[bytes] = field(default_factory=list)  # hidden-state rows not sent yet (float32 bytes)
    hidden_next: int = 0  # the first position whose hidden state was not gathered yet (recomputes skip the rest)
    pending_routed: list[bytes] = field(default_factory=list)  # routed-expert rows not sent yet (int32 bytes)
    pending_routed_start: int = 0  # position of the first pending routed-expert row
    routed_next: int = 0  # the first position whose routed experts were not gathered yet
    # time.monotonic() when a step first computed this sequence (its admission; kept across preemption): the end
    # of its queue time, which the service can't see from outside the engine thread
    scheduled_at: float | None = None

    @property
    def request(self) -> EngineRequest:
        return self.seq.request

    @property
    def lazy_grammar(self) -> bool:
        """Constrained, greedy, without logprobs or a custom processor: its token is the argmax of the unmasked
        logits whenever the grammar allows that argmax (masking only removes tokens), so its mask is filled only
        when the grammar rejects the unmasked choice (most steps need none)."""
        params = self.request.params
        return (self.grammar is not None and params.greedy and self.request.logprobs is None
                and self.processor is None)


@dataclass(frozen=True)
class _Add:
    request: EngineRequest  # what to run
    sink: Sink  # where its outputs go
    flow: OutputFlow | None = None  # its consumer's backpressure counters
    submitted_at: float | None = None  # time.monotonic() when posted


@dataclass(frozen=True)
class _Abort:
    request_id: str  # whose request
    reason: str  # message carried by the ABORT finish


@dataclass(frozen=True)
class _Wake:
    """A paused output's consumer caught up: schedule again (the loop may be blocked on its inbox)."""


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _Call:
    """Run `fn` on the engine thread between steps (the prefix cache's listener set, a cache flush): what the KV
    bookkeeping is only touched by that thread. `fn` must not block."""

    fn: Callable[[], None]


Command = _Add | _Abort | _Wake | _Stop | _Call


def apply_backpressure(lives: Iterable[LiveRequest], bound: int) -> None:
    """Pause outputs whose consumer holds `bound` deltas it has not taken; resume them at half (engine thread)."""
    for live in lives:
        flow = live.flow
        if flow is None:
            continue
        seq = live.seq
        if not seq.paused and flow.backlog >= bound:
            seq.paused = flow.paused = True
            # The consumer may have caught up between the read above and `paused` turning true, and then seen no
            # reason to wake us: read again now that it will.
            if flow.backlog <= bound // 2:
                seq.paused = flow.paused = False
        elif seq.paused and flow.backlog <= bound // 2:
            seq.paused = flow.paused = False
