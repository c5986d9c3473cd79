"""Continuous batching: which tokens of which sequences the next step computes. Pure Python (no torch).

Each step: every running decode gets one token; then prefills (running ones first, then waiting ones by priority,
lower first, ties in arrival order) get chunks under the token budget, so a long prompt never stalls decodes.
Admission is bounded by max_running_requests and free pages. When a decode can't get a page, a running sequence is
preempted: a paused one first (see below), else the lowest-priority, newest one; its pages are released and it is
recomputed later from its tokens (prompt + output so far).

A paused sequence (backpressure: its client is not reading its outputs) is neither decoded nor admitted; it keeps
its pages until it resumes, unless another sequence needs them.
"""

from __future__ import annotations

from dataclasses import replace

from lmrpc.server.config import SchedulerConfig
from lmrpc.server.engine.kv_cache import KVCacheManager
from lmrpc.server.engine.sequence import ScheduledBatch, ScheduledChunk, SeqStatus, Sequence
from lmrpc.server.engine.step_budget import MAX_STEP_TOKENS


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_adapters: int = 8) -> None:
        # The engine sizes unset token budgets to its model first (step_budget.py); alone, the largest is used.
        self.config = config.with_budget(MAX_STEP_TOKENS)
        assert self.config.max_batched_tokens is not None and self.config.max_prefill_chunk is not None
        self.step_tokens: int = self.config.max_batched_tokens  # tokens computed per step
        self.chunk_tokens: int = self.config.max_prefill_chunk  # longest prefill chunk of one sequence per step
        self.kv = kv
        self.max_adapters = max_adapters  # distinct LoRA adapters among running sequences (--max-loras-per-batch)
        self.running: list[Sequence] = []  # holds pages; kept in arrival order
        self.waiting: list[Sequence] = []  # no pages; kept in (priority, arrival) order

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def has_runnable_work(self) -> bool:
        """Some sequence could be scheduled (paused ones wait for their client, not for a step)."""
        return any(not s.paused for s in self.running) or any(not s.paused for s in self.waiting)

    @property
    def num_paused(self) -> int:
        return sum(1 for s in self.running if s.paused) + sum(1 for s in self.waiting if s.paused)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return num_tokens <= self.kv.num_pages * self.kv.page_size

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        key = (seq.priority, seq.arrival)
        at = next((i for i, s in enumerate(self.waiting) if (s.priority, s.arrival) > key), len(self.waiting))
        self.waiting.insert(at, seq)

    @staticmethod
    def _victim(candidates: list[Sequence]) -> Sequence:
        """Whom to preempt: a paused sequence first (it is not using its pages), then the lowest priority (the highest
        number), then the newest."""
        return max(candidates, key=lambda s: (s.paused, s.priority, s.arrival))

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.media_rows.clear()
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.media_rows.clear()  # encoder rows: recomputed with the prompt (same bits) rather than held while waiting
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)

    def schedule(self) -> ScheduledBatch:
        self.kv.release_copies()  # normally done by on_computed; here too in case the last step failed
        batch = self._schedule()
        return replace(batch, copies=self.kv.take_copies())

    def _schedule(self) -> ScheduledBatch:
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        budget = self.step_tokens
        budget = self._schedule_decodes(chunks, preempted, budget)
        budget = self._schedule_running_prefills(chunks, budget)
        self._admit_waiting(chunks, budget)
        victim = self._deadlock_victim() if not chunks else None
        if victim is not None:
            self._preempt(victim)
            preempted.append(victim)
            return ScheduledBatch((), tuple(preempted)) if not self.running else self._retry(preempted)
        return ScheduledBatch(tuple(chunks), tuple(preempted))

    def _deadlock_victim(self) -> Sequence | None:
        """Nothing could be scheduled: whom to preempt so that something can, or None when waiting is right."""
        paused = [s for s in self.running if s.paused]
        active = [s for s in self.running if not s.paused]
        if paused and (active or any(not s.paused for s in self.waiting)):
            return self._victim(paused)  # a stalled client's pages are needed by a live one
        if len(active) > 1:
            return self._victim(active)  # partially prefilled sequences hold every page and none can advance
        return None

    def _retry(self, preempted: list[Sequence]) -> ScheduledBatch:
        batch = self._schedule()
        return ScheduledBatch(batch.chunks, (*preempted, *batch.preempted))

    def _schedule_decodes(self, chunks: list[ScheduledChunk], preempted: list[Sequence], budget: int) -> int:
        scheduled: set[Sequence] = set()
        for seq in list(self.running):
            if budget <= 0 or seq.status is not SeqStatus.RUNNING or seq.num_uncomputed_tokens != 1 or seq.paused:
                continue
            while not self.kv.can_allocate(seq, 1):
                victim = self._victim([s for s in self.running if s not in scheduled])
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self.kv.allocate(seq, 1)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
            scheduled.add(seq)
            budget -= 1
        return budget

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        wanted = min(seq.num_uncomputed_tokens, budget, self.chunk_tokens)
        return max(0, min(wanted, self.kv.max_allocatable_tokens(seq)))

    def _schedule_running_prefills(self, chunks: list[ScheduledChunk], budget: int) -> int:
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.in_prefill or seq.paused:
                continue
            n = self._chunk_size(seq, budget)
            if n == 0:
                continue
            self.kv.allocate(seq, n)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return budget

    def _blocked_on_sibling(self, seq: Sequence) -> bool:
        sibling = seq.wait_for
        if sibling is None or sibling.status is SeqStatus.FINISHED:
            return False
        return sibling.num_computed_tokens < sibling.num_prompt_tokens - 1

    def _admit_waiting(self, chunks: list[ScheduledChunk], budget: int) -> None:
        adapters = {s.adapter_uid for s in self.running if s.adapter_uid is not None}
        # Once a sequence waits for an adapter slot, no later one under an adapter is admitted (base-model ones
        # still are): else a steady stream of requests for the running adapters would keep the slots taken and
        # starve it. The running adapters' sequences end, a slot frees, and it goes in, in (priority, arrival) order.
        slot_awaited = False
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                return
            if self._blocked_on_sibling(seq) or seq.paused:
                continue  # n > 1: wait for sample 0's prompt pages instead of computing them again
            uid = seq.adapter_uid
            if uid is not None and slot_awaited:
                continue
            if uid is not None and uid not in adapters and len(adapters) >= self.max_adapters:
                slot_awaited = True  # a step runs at most max_adapters adapters: this one waits for a running one
                continue
            self.kv.match_prefix(seq)
            n = self._chunk_size(seq, budget)
            if n == 0:
                self.kv.free(seq)  # give back the matched prefix; FCFS: nobody overtakes this sequence
                seq.num_computed_tokens = 0
                return
            if seq.num_admissions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.num_admissions += 1
            self.kv.allocate(seq, n)
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.running.sort(key=lambda s: s.arrival)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
            if uid is not None:
                adapters.add(uid)

    def on_computed(self, batch: ScheduledBatch) -> None:
        self.kv.release_copies()
        for chunk in batch.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.kv.commit(chunk.seq)
