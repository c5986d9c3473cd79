"""Images in the engine (EngineRequest.prompt_media), on the tiny LLaVA: the same image again is a prefix-cache hit
over its positions (cached_tokens covers them, the encoder does not run again); a different image after the same text
matches only the text before it and never shares a page holding image positions, alone or in one batch; mixed text
and image requests together give bitwise their solo outputs, also in chunks of 8 tokens and after preemption and
recompute (the encoder run again, to the same bits); n = 3 samples share the image's pages; an in-process caller's
rows of the wrong width end in an error."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from multimodal_run import PAGE, Result, image, request, run, start

from lmrpc.kernels import native
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.sequence import ScheduledBatch, Sequence
from lmrpc.server.engine.types import EngineOutput, EngineRequest, FinishReason
from lmrpc.server.media.types import Media, MultimodalProcessor, MultimodalPrompt
from lmrpc.server.models.types import MediaSpan, PromptMedia

pytestmark = pytest.mark.skipif(not native.available(), reason="bitwise equality rests on the native kernels")

NEW = 16
IMAGE_ID = 49152  # "<image>", the first id added to SmolLM2's vocabulary


def text(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def with_image(processor: MultimodalProcessor, before: list[int], item: Media, after: list[int]) -> MultimodalPrompt:
    return processor.prepare([*before, IMAGE_ID, *after], [item])


def span_of(prompt: MultimodalPrompt) -> MediaSpan:
    media = prompt.engine_media
    assert isinstance(media, PromptMedia)
    return media.spans[0]


class Probe:
    """Records, per request, the KV pages holding its image positions at every step, and counts encoder runs."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.pages: dict[str, set[int]] = {}
        self.encodes = 0
        self.preempted: list[str] = []
        executor = engine.engine.executor
        forward, encode = executor.forward, executor.model.encode_media  # type: ignore[attr-defined]
        scheduler = engine.engine.scheduler
        preempt = scheduler._preempt

        def recording_forward(batch: ScheduledBatch) -> Any:
            for c in batch.chunks:
                media = c.seq.request.prompt_media
                for span in media.spans if media is not None else ():
                    covered = range(span.start, min(span.end, c.start + c.num_tokens))
                    self.pages.setdefault(c.seq.request_id, set()).update(
                        c.seq.page_table[p // PAGE] for p in covered)
            return forward(batch)

        def counting_encode(span: MediaSpan) -> Any:
            self.encodes += 1
            return encode(span)

        def recording_preempt(seq: Sequence) -> None:
            self.preempted.append(seq.request_id)
            preempt(seq)

        executor.forward = recording_forward  # type: ignore[method-assign]
        executor.model.encode_media = counting_encode  # type: ignore[attr-defined]
        scheduler._preempt = recording_preempt  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def engine(tiny_llava_dir: Path) -> Iterator[AsyncEngine]:
    engine = start(tiny_llava_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def processor(engine: AsyncEngine) -> MultimodalProcessor:
    assert engine.media_processor is not None
    return engine.media_processor


def one(engine: AsyncEngine, req: EngineRequest) -> Result:
    return asyncio.run(run(engine, [req]))[req.request_id]


def test_same_image_hits_the_cache_and_another_image_shares_no_image_page(tiny_llava_dir: Path,
                                                                        processor: MultimodalProcessor) -> None:
    before, after = text(1, 20), text(2, 10)  # the image fills positions 20..35: pages 1 and 2
    a = with_image(processor, before, image(1), after)
    b = with_image(processor, before, image(2), after)
    assert a.token_ids == b.token_ids and span_of(a).key != span_of(b).key
    engine = start(tiny_llava_dir)
    probe = Probe(engine)
    try:
        first = one(engine, request(a, NEW, "a1"))
        assert first.cached_tokens == 0 and probe.encodes == 1
        other = one(engine, request(b, NEW, "b"))
        assert other.cached_tokens == span_of(b).start  # the text before the image, not one image position
        assert probe.encodes == 2
        assert not probe.pages["a1"] & probe.pages["b"]
        assert other.tokens != first.tokens  # the image matters (else this test could pass on the text alone)
        again = one(engine, request(a, NEW, "a2"))
        assert again.cached_tokens == len(a.token_ids) - 1  # the image positions too: only the last is computed
        assert probe.encodes == 2  # nothing of the image computed, so no encoder run
        assert (again.tokens, again.logprobs) == (first.tokens, first.logprobs)
    finally:
        engine.shutdown()
    engine = start(tiny_llava_dir)  # cold: both images in one batch
    probe = Probe(engine)
    try:
        together = asyncio.run(run(engine, [request(a, NEW, "a"), request(b, NEW, "b")]))
        assert not probe.pages["a"] & probe.pages["b"]
        assert (together["a"].tokens, together["a"].logprobs) == (first.tokens, first.logprobs)
        assert (together["b"].tokens, together["b"].logprobs) == (other.tokens, other.logprobs)
    finally:
        engine.shutdown()


def mixed(processor: MultimodalProcessor) -> list[EngineRequest]:
    """Six requests: three with images (two of the same image after different text), three text only."""
    return [
        request(with_image(processor, text(10, 5), image(1), text(11, 30)), NEW, "img-1"),
        request(text(12, 41), NEW, "text-1"),
        request(with_image(processor, text(13, 17), image(2), text(14, 9)), NEW, "img-2"),
        request(text(15, 23), NEW, "text-2"),
        request(with_image(processor, text(16, 33), image(1), text(17, 3)), NEW, "img-3"),
        request(text(18, 7), NEW, "text-3"),
    ]


@pytest.fixture(scope="module")
def solo(tiny_llava_dir: Path, processor: MultimodalProcessor) -> dict[str, Result]:
    """Each of `mixed` alone, on an engine without a prefix cache (nothing shared between them)."""
    engine = start(tiny_llava_dir, prefix_cache=False)
    try:
        return {r.request_id: one(engine, r) for r in mixed(processor)}
    finally:
        engine.shutdown()


def strip(results: dict[str, Result]) -> dict[str, tuple[Any, Any]]:
    return {k: (r.tokens, r.logprobs) for k, r in results.items()}


def test_mixed_batch_equals_solo(tiny_llava_dir: Path, processor: MultimodalProcessor,
                                 solo: dict[str, Result]) -> None:
    engine = start(tiny_llava_dir)
    try:
        assert strip(asyncio.run(run(engine, mixed(processor)))) == strip(solo)
    finally:
        engine.shutdown()


def test_chunked_prefill_and_preemption_equal_solo(tiny_llava_dir: Path, processor: MultimodalProcessor,
                                                   solo: dict[str, Result]) -> None:
    """Chunks of 8 tokens cut every image (16 positions) in two or three; a pool of 10 pages for six requests that
    need 3 to 4 each preempts some, whose images are encoded again when they are recomputed."""
    engine = start(tiny_llava_dir, kv_tokens=10 * PAGE, max_batched=8)
    probe = Probe(engine)
    try:
        assert strip(asyncio.run(run(engine, mixed(processor)))) == strip(solo)
        assert any(rid.startswith("img") for rid in probe.preempted), probe.preempted
        assert probe.encodes > 3  # a preempted image request encoded its image again
    finally:
        engine.shutdown()


def test_samples_sharing_a_prefill_reuse_the_image_pages(engine: AsyncEngine, processor: MultimodalProcessor,
                                                         solo: dict[str, Result]) -> None:
    """n = 3 greedy samples of an image prompt (1..2 naming sample 0 in share_prefill_with): each equals the prompt
    alone, and samples 1..2 get the image positions from the prefix cache."""
    [target] = [r for r in mixed(processor) if r.request_id == "img-1"]
    samples = [dataclasses.replace(target, request_id=f"n/{i}", rid="n", index=i,
                                   share_prefill_with=None if i == 0 else "n/0") for i in range(3)]
    results = asyncio.run(run(engine, samples))
    expected = (solo["img-1"].tokens, solo["img-1"].logprobs)
    assert all((r.tokens, r.logprobs) == expected for r in results.values())
    media = target.prompt_media
    assert media is not None
    # Samples 1..2 wait for sample 0's full prompt pages: the image's positions are among them.
    assert all(results[f"n/{i}"].cached_tokens >= media.spans[0].end for i in (1, 2))


def test_rows_of_another_width_end_the_request_with_an_error(engine: AsyncEngine) -> None:
    """An in-process caller's span with rows the model cannot take ends in FINISH_REASON_ERROR, not a broken step."""
    span = MediaSpan(1, 2, b"k" * 16, "image_data[0].items[0]", rows=bytes(2 * 63 * 4))
    req = dataclasses.replace(request(text(20, 5), 4), prompt_media=PromptMedia((span,)))
    outs = asyncio.run(collect(engine, req))
    assert outs[-1].finish is not None and outs[-1].finish.reason is FinishReason.ERROR
    assert not any(o.token_ids for o in outs)


async def collect(engine: AsyncEngine, req: EngineRequest) -> list[EngineOutput]:
    return [o async for o in engine.generate([req])]
