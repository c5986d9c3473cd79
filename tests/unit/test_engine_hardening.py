"""The engine under careless clients and faults, on the tiny random-weight Llama: an output whose consumer does not
read stops being scheduled (pages kept) and resumes when it reads, while others run; a fault in one step fails
only that step's requests; calls in flight end when the engine is declared unavailable; load figures are kept."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_engine import make_engine, random_prompt, request, tokens, wait_idle

from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.engine import EngineUnavailable
from lmrpc.server.engine.sequence import ScheduledBatch
from lmrpc.server.engine.types import EngineOutput, FinishReason, SamplingParams

BOUND = 8  # max_buffered_outputs of the engine below
LONG = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[AsyncEngine]:
    eng = make_engine(tiny_llama_dir, max_buffered=BOUND)
    yield eng
    eng.shutdown()


async def _outputs_of(engine: AsyncEngine, rid: str) -> int:
    """Tokens the engine produced so far for a live request (read from its sequence)."""
    live = engine.engine._live.get(rid)
    return live.seq.num_output_tokens if live is not None else -1


async def test_an_unread_stream_is_paused_with_its_pages_and_others_run(engine: AsyncEngine) -> None:
    rng = random.Random(7)
    stalled = engine.generate([request(random_prompt(rng, 20), LONG, rid="stalled")])
    first = await anext(stalled)  # take one delta, then stop reading
    assert first.token_ids
    for _ in range(200):
        await asyncio.sleep(0.02)
        if engine.engine._live["stalled"].seq.paused:
            break
    live = engine.engine._live["stalled"]
    assert live.seq.paused and live.flow is not None and live.flow.backlog >= BOUND
    produced = live.seq.num_output_tokens
    assert produced <= BOUND + 3, "the engine must stop producing for a consumer that does not read"
    assert live.seq.page_table, "a paused output keeps its pages"
    assert engine.stats().num_paused == 1

    # Another request runs to completion meanwhile.
    other = [o async for o in engine.generate([request(random_prompt(rng, 10), SHORT, rid="other")])]
    assert len(tokens(other)) == 12 and other[-1].finish is not None
    assert await _outputs_of(engine, "stalled") == produced  # still not a token more

    # Reading resumes it; it runs to its end.
    rest = [o async for o in stalled]
    assert rest[-1].finish is not None and rest[-1].finish.reason is FinishReason.LENGTH
    assert len(first.token_ids) + len(tokens(rest)) == 400
    await wait_idle(engine)


async def test_a_closed_unread_stream_frees_its_pages(engine: AsyncEngine) -> None:
    rng = random.Random(8)
    stalled = engine.generate([request(random_prompt(rng, 30), LONG, rid="gone")])
    await anext(stalled)
    for _ in range(200):
        await asyncio.sleep(0.02)
        if engine.stats().num_paused:
            break
    assert engine.stats().num_used_pages > 0
    await stalled.aclose()  # what the service does when --stalled-stream-timeout passes
    await wait_idle(engine)


async def test_a_fault_spares_requests_outside_the_step(engine: AsyncEngine) -> None:
    # A request waiting for admission is not in the failing step: it must survive it.
    rng = random.Random(10)
    failed: list[set[str]] = []

    def hook(batch: ScheduledBatch) -> None:
        ids = {c.seq.request_id for c in batch.chunks}
        if "boom" in ids and not failed:
            failed.append(ids)
            raise RuntimeError("injected")

    engine.engine.step_hook = hook
    try:
        reqs = [request(random_prompt(rng, 600), SHORT, rid="boom"),  # 600 tokens: the 256-token budget is full
                request(random_prompt(rng, 300), SHORT, rid="later")]
        outs: dict[str, list[EngineOutput]] = {"boom": [], "later": []}
        async for o in engine.generate(reqs):
            outs[o.request_id].append(o)
    finally:
        engine.engine.step_hook = None
    assert failed == [{"boom"}], f"the failing step held {failed}"
    assert outs["boom"][-1].finish is not None and outs["boom"][-1].finish.reason is FinishReason.ERROR
    later = outs["later"][-1].finish
    assert later is not None and later.reason is FinishReason.LENGTH and len(tokens(outs["later"])) == 12
    await wait_idle(engine)


async def test_failed_calls_end_unavailable_and_new_ones_are_refused(engine: AsyncEngine) -> None:
    rng = random.Random(11)
    call = engine.generate([request(random_prompt(rng, 10), LONG, rid="inflight")])
    await anext(call)
    assert engine.has_work
    assert engine.fail_calls("engine stuck (test)") == 1
    with pytest.raises(EngineUnavailable, match="stuck"):
        async for _ in call:
            pass
    with pytest.raises(EngineUnavailable):
        await anext(engine.generate([request(random_prompt(rng, 10), SHORT)]))
    engine.recovered()
    assert len(tokens([o async for o in engine.generate([request(random_prompt(rng, 10), SHORT)])])) == 12
    await wait_idle(engine)


async def test_load_figures_and_running_by_client(engine: AsyncEngine) -> None:
    rng = random.Random(12)
    reqs = [replace(request(random_prompt(rng, 40), SHORT, rid=f"l{i}"), client="alice") for i in range(4)]
    seen: list[int] = []
    async for o in engine.generate(reqs):
        if o.token_ids:
            seen.append(engine.engine.running_by_client.get("alice", 0))
    assert max(seen) == 4
    generated, prompt, queue_p50 = engine.engine.load.snapshot()
    assert generated > 0 and prompt >= 160 / 60 and queue_p50 >= 0
    await wait_idle(engine)
    await asyncio.sleep(0.5)  # refreshed each time the loop comes round (at least every IDLE_TICK)
    assert engine.engine.running_by_client == {}
