"""The KV-cache bookkeeping and the scheduler, driven by a fake model: milliseconds, no torch."""

from __future__ import annotations

import random
from dataclasses import dataclass

from lmrpc.server.config import SchedulerConfig
from lmrpc.server.engine.kv_cache import KVCacheManager
from lmrpc.server.engine.scheduler import Scheduler
from lmrpc.server.engine.sequence import ScheduledBatch, SeqStatus, Sequence
from lmrpc.server.engine.types import EngineRequest, LogprobOptions, SamplingParams


def seq(prompt: list[int], max_new: int = 8, *, logprob_start: int | None = None) -> Sequence:
    lp = LogprobOptions(start_len=logprob_start) if logprob_start is not None else None
    req = EngineRequest("r", "r", 0, tuple(prompt), SamplingParams(max_new_tokens=max_new), logprobs=lp)
    return Sequence(req)


def make(num_pages: int = 64, page_size: int = 4, *, max_running: int = 8, budget: int = 32,
         chunk: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_running_requests=max_running, max_batched_tokens=budget,
                                     max_prefill_chunk=chunk), KVCacheManager(num_pages, page_size))


def fake_step(s: Scheduler) -> ScheduledBatch:
    """One engine step with a 'model' whose next token is a function of the sequence's last token."""
    batch = s.schedule()
    s.on_computed(batch)
    for c in batch.chunks:
        assert len(c.seq.page_table) * s.kv.page_size >= c.seq.num_computed_tokens
        if c.samples:
            c.seq.append_token((c.seq.token_ids[-1] * 7 + 3) % 1000)
            if c.seq.num_output_tokens >= c.seq.request.params.max_new_tokens:
                s.finish(c.seq)
    s.kv.check_invariants()
    return batch


def test_partial_page_hit_is_copied_and_its_source_released() -> None:
    kv = KVCacheManager(8, 4)
    a = seq(list(range(10)), max_new=1)
    kv.match_prefix(a)
    kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.commit(a)
    kv.free(a)  # pages [0..3], [4..7] full, [8, 9] kept as a partial leaf
    assert kv.num_cached_pages == 3
    b = seq([0, 1, 2, 3, 4, 5, 6, 7, 8, 77, 78])
    kv.match_prefix(b)
    assert b.num_computed_tokens == 9 and len(b.page_table) == 3
    (copy,) = kv.take_copies()
    assert copy.num_tokens == 1 and copy.dst == b.page_table[2] and copy.src != copy.dst
    assert kv.num_used_pages == 4  # b's three pages and the copy's source, held until the step is done
    kv.release_copies()
    assert kv.num_used_pages == 3
    kv.free(b)
    kv.check_invariants()
    assert kv.num_used_pages == 0 and kv.num_free_pages == 8


def test_partial_copy_dropped_with_its_admission_releases_the_source() -> None:
    kv = KVCacheManager(8, 4)
    a = seq(list(range(6)), max_new=1)
    kv.match_prefix(a)
    kv.allocate(a, 6)
    a.num_computed_tokens = 6
    kv.commit(a)
    kv.free(a)
    b = seq(list(range(8)))
    kv.match_prefix(b)
    assert b.num_computed_tokens == 6
    kv.free(b)  # e.g. admission found no budget: the copy never runs
    assert kv.take_copies() == ()
    kv.check_invariants()
    assert kv.num_used_pages == 0 and kv.num_free_pages == 8


def run_all(s: Scheduler, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not s.has_work:
            return
        fake_step(s)
    raise AssertionError("did not finish")


def expected_output(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (last * 7 + 3) % 1000
        out.append(last)
    return out


def test_token_budget_chunks_long_prompt_while_decodes_advance() -> None:
    s = make(num_pages=1024, budget=64, chunk=64)
    short = seq([1, 2, 3], max_new=40)
    s.add(short)
    fake_step(s)  # short prefilled, first token sampled
    long = seq(list(range(2000)), max_new=2)
    s.add(long)
    for _ in range(10):
        batch = fake_step(s)
        sizes = {c.seq: c.num_tokens for c in batch.chunks}
        assert sizes[short] == 1  # the decode advances every step
        assert sizes[long] == 63  # the rest of the budget goes to the long prompt's chunk
        assert batch.num_tokens <= 64


def test_admission_limit_and_fcfs() -> None:
    s = make(max_running=2)
    seqs = [seq([i, i + 1, i + 2], max_new=3) for i in range(5)]
    for q in seqs:
        s.add(q)
    batch = fake_step(s)
    assert [c.seq for c in batch.chunks] == seqs[:2]
    assert s.num_running == 2 and s.num_waiting == 3
    run_all(s)
    assert all(q.status is SeqStatus.FINISHED for q in seqs)
    assert s.kv.num_used_pages == 0


def test_prefix_cache_figures_100_1000_1000() -> None:
    s = make(num_pages=2048, page_size=16, budget=4096, chunk=4096)
    prompt = list(range(1000))
    cached = []
    for p in (prompt[:100], prompt, prompt):
        q = seq(p, max_new=1)
        s.add(q)
        run_all(s)
        cached.append(q.num_cached_tokens)
    assert cached[0] == 0
    assert cached[1] == 100  # 96 in place, 4 copied from the first prompt's partial last page
    assert cached[2] == 999  # all but the last token, whose logits must be computed


def test_prompt_logprobs_limit_reuse() -> None:
    s = make(num_pages=256, page_size=4)
    s.add(seq(list(range(40)), max_new=1))
    run_all(s)
    q = seq(list(range(40)), max_new=1, logprob_start=10)
    s.add(q)
    run_all(s)
    assert q.num_cached_tokens == 9  # logits from position 9 on are needed: 2 full pages and 1 token copied


def test_wait_for_sibling_shares_prefill() -> None:
    s = make(num_pages=256, page_size=4, budget=256, chunk=256)
    first = seq(list(range(30)), max_new=4)
    second = seq(list(range(30)), max_new=4)
    second.wait_for = first
    s.add(first)
    s.add(second)
    batch = fake_step(s)
    assert [c.seq for c in batch.chunks] == [first]
    run_all(s)
    assert second.num_cached_tokens == 28


def test_tiny_pool_preempts_and_everything_completes_correctly() -> None:
    s = make(num_pages=12, page_size=4, budget=64, chunk=16, max_running=8)  # 48 token slots
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(3, 12))] for _ in range(10)]
    seqs = [seq(p, max_new=20) for p in prompts]
    for q in seqs:
        s.add(q)
    preempted = 0
    for _ in range(5000):
        if not s.has_work:
            break
        preempted += len(fake_step(s).preempted)
    assert not s.has_work
    assert preempted > 0
    for q, p in zip(seqs, prompts, strict=True):
        assert q.output_ids == expected_output(p, 20)
    assert s.kv.num_used_pages == 0 and s.kv.num_free_pages == s.kv.num_pages


def test_random_aborts_return_every_page() -> None:
    rng = random.Random(1)
    s = make(num_pages=40, page_size=4, budget=48, chunk=16, max_running=6)
    live: list[Sequence] = []
    shared = [rng.randrange(1000) for _ in range(12)]
    for _ in range(300):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        q = seq(prompt, max_new=rng.randrange(1, 30))
        s.add(q)
        live.append(q)
        for _ in range(rng.randrange(0, 3)):
            fake_step(s)
        if rng.random() < 0.4:
            victim = rng.choice(live)
            if victim.status is not SeqStatus.FINISHED:
                s.finish(victim)  # abort in whatever state it is
        live = [q for q in live if q.status is not SeqStatus.FINISHED]
    run_all(s)
    s.kv.check_invariants()
    assert s.kv.num_used_pages == 0
    assert s.kv.num_free_pages == s.kv.num_pages


def test_shared_pages_are_refcounted() -> None:
    kv = KVCacheManager(16, 4)
    a, b = seq(list(range(9))), seq(list(range(9)))
    kv.match_prefix(a)
    kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.commit(a)
    kv.match_prefix(b)
    assert b.page_table == a.page_table[:2] and b.num_computed_tokens == 8
    assert kv.num_used_pages == 3
    kv.free(a)
    assert kv.num_used_pages == 2  # b still holds the two shared pages
    kv.free(b)
    assert kv.num_used_pages == 0 and kv.num_cached_pages == 3 and kv.num_free_pages == 16  # + a's partial tail
    kv.check_invariants()


# ---- priority and backpressure ---------------------------------------------------------------------------------


def prio_seq(prompt: list[int], priority: int, max_new: int = 4) -> Sequence:
    req = EngineRequest(f"p{priority}-{prompt[0]}", "r", 0, tuple(prompt), SamplingParams(max_new_tokens=max_new),
                        priority=priority)
    return Sequence(req)


def test_waiting_queue_is_by_priority_then_arrival() -> None:
    s = make(max_running=1, budget=64)
    a, b, c, d = prio_seq([1, 2], 5), prio_seq([3, 4], 0), prio_seq([5, 6], 5), prio_seq([7, 8], -3)
    for x in (a, b, c, d):
        s.add(x)
    assert s.waiting == [d, b, a, c]  # lower first; a and c tie on 5: a arrived first
    order = []
    while s.has_work:
        for chunk in fake_step(s).chunks:
            if chunk.seq not in order:
                order.append(chunk.seq)
    assert order == [d, b, a, c]


def test_a_preempted_sequence_keeps_its_place_by_priority() -> None:
    s = make(num_pages=4, page_size=4, max_running=4, budget=64)
    low, high = prio_seq(list(range(1, 7)), 9, max_new=9), prio_seq(list(range(10, 16)), 1, max_new=9)
    s.add(low)
    fake_step(s)
    s.add(high)
    preempted = []
    for _ in range(60):
        if not s.has_work:
            break
        preempted.extend(fake_step(s).preempted)
    assert preempted and preempted[0] is low  # the lower priority gives its pages up, whoever came first
    assert high.finished and low.finished


def test_a_paused_sequence_is_not_scheduled_and_keeps_its_pages() -> None:
    s = make(budget=64)
    a, b = seq([1, 2, 3], max_new=50), seq([4, 5, 6], max_new=50)
    s.add(a)
    s.add(b)
    fake_step(s)
    a.paused = True
    pages = list(a.page_table)
    for _ in range(5):
        batch = fake_step(s)
        assert [c.seq for c in batch.chunks] == [b]
    assert a.page_table == pages and a.num_output_tokens == 1
    b.paused = True
    assert not s.has_runnable_work and s.has_work and s.num_paused == 2
    assert fake_step(s).empty  # nothing to do: nobody is preempted for it
    a.paused = False
    assert [c.seq for c in fake_step(s).chunks] == [a]


def test_a_paused_sequence_gives_its_pages_to_a_live_one_first() -> None:
    s = make(num_pages=4, page_size=4, max_running=4, budget=64)
    stalled, live = seq(list(range(1, 8)), max_new=8), seq(list(range(20, 27)), max_new=8)
    s.add(stalled)
    fake_step(s)
    stalled.paused = True  # holds 2 of the 4 pages
    s.add(live)
    preempted = []
    for _ in range(40):
        batch = fake_step(s)
        preempted.extend(batch.preempted)
        if live.finished:
            break
    assert live.finished, "a stalled client's pages must not starve a live request"
    assert preempted and all(p is stalled for p in preempted)
    assert stalled.status is SeqStatus.WAITING and stalled.page_table == []
    stalled.paused = False
    while s.has_work:
        fake_step(s)
    assert stalled.finished and s.kv.num_used_pages == 0


@dataclass(frozen=True)
class FakeAdapter:
    """What the scheduler reads of a LoRA adapter (protocol.AdapterRef)."""

    name: str
    uid: int


def adapter_seq(prompt: list[int], adapter: FakeAdapter | None, max_new: int = 3) -> Sequence:
    req = EngineRequest("r", "r", 0, tuple(prompt), SamplingParams(max_new_tokens=max_new), adapter=adapter)
    return Sequence(req)


def test_a_steady_stream_for_a_running_adapter_does_not_starve_another() -> None:
    """--max-loras-per-batch 1: while adapter A's requests keep coming (a new one every step, each stream keeping two
    running), a request for adapter B waits only for the A requests that came before it, then runs; the base
    model's requests are admitted all along."""
    a, b = FakeAdapter("a", 1), FakeAdapter("b", 2)
    s = Scheduler(SchedulerConfig(max_running_requests=8, max_batched_tokens=64, max_prefill_chunk=64),
                  KVCacheManager(256, 4), max_adapters=1)
    before = [adapter_seq([1, 2, 3], a), adapter_seq([4, 5, 6], a)]
    for q in before:
        s.add(q)
    fake_step(s)
    late_b = adapter_seq([7, 8, 9], b)
    s.add(late_b)
    after: list[Sequence] = []
    base: list[Sequence] = []
    for step in range(40):
        if late_b.status is SeqStatus.FINISHED:
            break
        after.append(adapter_seq([10 + step, 11, 12], a))  # the stream goes on
        s.add(after[-1])
        base.append(adapter_seq([50 + step, 51], None))
        s.add(base[-1])
        batch = fake_step(s)
        assert len({c.seq.adapter_uid for c in batch.chunks if c.seq.adapter_uid is not None}) <= 1
    assert late_b.status is SeqStatus.FINISHED and late_b.num_output_tokens == 3
    assert all(q.status is SeqStatus.FINISHED for q in before)
    assert all(q.num_computed_tokens == 0 for q in after)  # none of the later A requests overtook B
    assert sum(q.status is SeqStatus.FINISHED for q in base) >= len(base) - 2  # base requests never waited on B
    run_all(s)
    assert all(q.status is SeqStatus.FINISHED for q in after)
