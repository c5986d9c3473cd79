"""Per-request engine state shared by the scheduler, the KV-cache manager and the engine loop. No torch."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from lmrpc.server.engine.types import EngineRequest, Finish, HiddenStatesMode

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = enum.auto()  # queued: no pages held (new, or preempted and to be recomputed)
    RUNNING = enum.auto()  # holds pages; prefilling in chunks or decoding
    FINISHED = enum.auto()  # done; pages released


@dataclass(eq=False)
class Sequence:
    """One output being generated. Identity-compared (eq=False) so it can key dicts and sets."""

    request: EngineRequest  # what was asked
    token_ids: list[int] = field(default_factory=list)  # prompt + generated tokens
    arrival: int = field(default_factory=lambda: next(_arrival))  # FCFS order; kept across preemption
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the cache (cached or computed)
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at (first) admission
    num_admissions: int = 0  # times admitted into the running set (> 1 after preemption)
    page_table: list[int] = field(default_factory=list)  # KV pages, in order; page i holds tokens [i*P, (i+1)*P)
    wait_for: Sequence | None = None  # n > 1: don't admit before this sibling's prompt is in the prefix cache
    # Backpressure: its consumer has not taken enough of its outputs, so it is not scheduled (its pages kept, unless
    # another sequence needs them: a paused sequence is preempted first). Set by the engine loop.
    paused: bool = False
    finish: Finish | None = None  # set once finished
    engine_state: dict[str, Any] = field(default_factory=dict)  # per-sequence state owned by the engine loop
    # The encoder's rows of its media spans (span index -> [length, hidden] tensor), computed by the executor when a
    # chunk first needs them and dropped when the sequence finishes or is preempted (a recompute encodes again, to
    # the same bits). Opaque here: this module imports no torch.
    media_rows: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_ids)
        assert self.token_ids, "a sequence needs at least one prompt token"

    def cache_keys(self, start: int, end: int) -> list[int | bytes]:
        """The prefix cache's keys of positions [start, end): the token ids, except that prompt positions given as
        embeddings are keyed by their row's digest, and image/audio positions by their item's key and index
        (MediaSpan.position_keys): bytes never equal an int, so no token prompt can match them."""
        keys: list[int | bytes] = list(self.token_ids[start:end])
        embeds = self.request.prompt_embeds
        if embeds is not None and start < embeds.num_positions:
            cut = min(end, embeds.num_positions)
            keys[: cut - start] = embeds.position_keys[start:cut]
        media = self.request.prompt_media
        if media is not None:
            for _, span in media.overlapping(start, end):
                lo, hi = max(start, span.start), min(end, span.end)
                keys[lo - start : hi - start] = span.position_keys(lo, hi)
        return keys

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> int:
        """Lower is scheduled first among waiting sequences (ties in arrival order)."""
        return self.request.priority

    @property
    def adapter_uid(self) -> int | None:
        """The LoRA adapter it runs under (its load's uid), None for the base model."""
        adapter = self.request.adapter
        return None if adapter is None else adapter.uid

    @property
    def cache_root(self) -> int:
        """Where its prefix-cache chain starts: -1 for the base model, a root of its own per adapter load, so the
        same prompt under two adapters (or the base) never shares pages."""
        uid = self.adapter_uid
        return -1 if uid is None else -2 - uid

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next sample (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while more than the newest token is missing from the cache (prompt, or recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def max_cacheable_prompt_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache.

        All but the last (its logits are needed); none when all hidden states are asked for (every position's is
        returned); and for prompt logprobs from position k, the logits of positions k-1.. must be computed, so only
        k-1 tokens may be reused.
        """
        if self.request.hidden_states is HiddenStatesMode.ALL:
            return 0  # every prompt position's hidden state is returned, so every position is computed
        limit = self.num_tokens - 1
        if self.request.routed_experts_from is not None:
            limit = min(limit, self.request.routed_experts_from)  # routed positions must be computed
        lp = self.request.logprobs
        if lp is not None and lp.start_len >= 0:
            limit = min(limit, max(lp.start_len - 1, 0))
        return limit

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one sequence computed in this step: positions [start, start + num_tokens)."""

    seq: Sequence  # whose tokens
    start: int  # == seq.num_computed_tokens when scheduled
    num_tokens: int  # >= 1; the page table already covers start + num_tokens positions

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the newest token, so its last logits give the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class PageCopy:
    """Copy the first num_tokens slots of page src into page dst (all layers) before the step's forward."""

    src: int  # a cached page whose head matches the sequence's next tokens
    dst: int  # the sequence's own fresh page
    num_tokens: int  # 1 .. page_size - 1


@dataclass(frozen=True)
class ScheduledBatch:
    """What one engine step computes: decode chunks first, then prefill chunks, in FCFS order within each."""

    chunks: tuple[ScheduledChunk, ...] = ()  # at most one chunk per sequence
    preempted: tuple[Sequence, ...] = ()  # sequences that lost their pages this step (to be recomputed)
    copies: tuple[PageCopy, ...] = ()  # partial prefix-cache hits to copy before the forward

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks
