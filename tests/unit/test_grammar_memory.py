"""What the grammar backend keeps stays bounded, and a request's matcher travels with the request: the compiled
grammars and the matchers kept for repeated constraints are bounded by count and by their grammars' characters; the
engine copies the matcher the service's check built even once the backend dropped its own; an idle engine gives
the heap a burst freed back to the OS (heap.py); the model loads on a thread that ends with the load, its malloc
arena's holes left out of the steps' way."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_engine import make_engine
from transformers import PreTrainedTokenizerBase

from lmrpc.server.engine import grammar as grammar_module
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.grammar import GrammarBackend, GrammarError, _Bounded
from lmrpc.server.engine.types import Constraint, EngineRequest, SamplingParams
from lmrpc.server.heap import HeapTrimmer, _malloc_trim

VOCAB = 49152


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer: PreTrainedTokenizerBase) -> GrammarBackend:
    return GrammarBackend(smollm2_tokenizer, VOCAB)


def words(prefix: str, count: int) -> Constraint:
    """A regex alternation of `count` distinct words (its grammar grows with it)."""
    return Constraint("regex", "|".join(f"{prefix}{i}" for i in range(count)))


def test_bounded_map_drops_least_recent_past_entries_or_size() -> None:
    kept = _Bounded[str](max_entries=3, max_size=100)
    for name, size in (("a", 10), ("b", 10), ("c", 10)):
        kept.put(("regex", name, None), name, size)
    assert kept.get(("regex", "a", None)) == "a"  # now the most recent
    kept.put(("regex", "d", None), "d", 10)  # four entries: b (least recent) goes
    assert kept.get(("regex", "b", None)) is None and len(kept) == 3
    kept.put(("regex", "e", None), "e", 75)  # size 105: c goes (then 95)
    assert kept.get(("regex", "c", None)) is None
    assert [kept.get(("regex", k, None)) for k in "ade"] == ["a", "d", "e"]
    kept.put(("regex", "f", None), "f", 101)  # larger than the whole bound: never kept, nothing dropped for it
    assert kept.get(("regex", "f", None)) is None and len(kept) == 3
    kept.put(("regex", "e", None), "e2", 5)  # replacing an entry replaces its size
    assert kept.get(("regex", "e", None)) == "e2" and kept._size == 25


def test_kept_matchers_are_bounded_by_their_grammars_characters(smollm2_tokenizer: PreTrainedTokenizerBase,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_module, "_PROTOTYPE_CHARS", 20_000)
    backend = GrammarBackend(smollm2_tokenizer, VOCAB)
    for i in range(12):
        assert backend.check(words(f"w{i}x", 300)) is None  # each grammar a few thousand characters
    kept = backend._prototypes
    assert 0 < len(kept) < 12 and kept._size <= 20_000
    assert len(backend._compiled) == 12  # grammars are small next to their own bound: all kept


def test_a_request_carries_its_matcher_past_the_backends_cache(backend: GrammarBackend,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    constraint = Constraint("json_schema", '{"type": "object", "properties": {"name": {"type": "string"}}}')
    checked = backend.checked(constraint)
    assert checked.checked is not None and checked == constraint  # the matcher is not part of its identity
    for i in range(grammar_module._PROTOTYPES + 1):  # the backend's own copy is dropped
        backend.check(Constraint("regex", f"drop{i}"))
    assert backend._prototypes.get(("json_schema", constraint.text, None)) is None

    def no_compile(*_: object) -> None:
        raise AssertionError("compiled on the engine's path")

    monkeypatch.setattr(backend, "_build", no_compile)
    monkeypatch.setattr(backend, "_matcher", no_compile)
    matcher = backend.new_matcher(checked)  # a copy: no compile
    first = backend._tokenizer.tokenize_str('{"name": "x"}')[0]
    assert matcher.allows(first) and not matcher.is_finished
    matcher.advance(first)
    fresh = backend.new_matcher(checked)  # the checked matcher itself never advanced
    assert fresh.allows(first)
    with pytest.raises(AssertionError, match="engine's path"):  # unchecked, the same constraint is compiled again
        backend.new_matcher(constraint)


def test_a_repeated_constraint_is_checked_without_compiling(backend: GrammarBackend,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(GrammarError):  # a refused constraint is never kept
        backend.checked(Constraint("regex", "[[[a"))
    assert backend._prototypes.get(("regex", "[[[a", None)) is None
    constraint = words("again", 50)
    first = backend.checked(constraint).checked
    monkeypatch.setattr(backend, "_build", lambda *_: (_ for _ in ()).throw(AssertionError("compiled again")))
    assert backend.checked(constraint).checked is first


def test_the_heap_is_trimmed_once_per_idle_period() -> None:
    calls: list[int] = []

    def trim() -> int:
        calls.append(1)
        return 1

    heap = HeapTrimmer(trim=trim)
    heap.idle()
    assert calls == []  # nothing worked yet
    heap.busy()
    heap.busy()
    heap.idle()
    heap.idle()
    assert calls == [1] and heap.trims == 1
    heap.busy()
    heap.idle()
    assert heap.trims == 2
    off = HeapTrimmer(trim=trim, enabled=False)
    off.busy()
    off.idle()
    assert off.trims == 0 and len(calls) == 2
    real = _malloc_trim()  # glibc here: the real one runs
    assert real is not None and real() in (0, 1)


def test_the_start_trims_the_grammar_tables_heap_before_the_kv_pool(tiny_llama_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Building the grammar tables leaves tens of MB of freed heap (a 49k-token vocabulary); trimmed after the pool
    # is allocated, the process's peak would be pool + that heap.
    from lmrpc.server.engine import async_engine

    events: list[str] = []
    real_backend, real_engine = async_engine.GrammarBackend, async_engine.Engine

    def backend(*args: Any, **kwargs: Any) -> GrammarBackend:
        events.append("grammar")
        return real_backend(*args, **kwargs)

    def engine_of(*args: Any, **kwargs: Any) -> Any:
        events.append("engine")  # allocates the KV pool
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(async_engine, "GrammarBackend", backend)
    monkeypatch.setattr(async_engine, "Engine", engine_of)
    monkeypatch.setattr(async_engine, "trim_heap", lambda: events.append("trim"))
    make_engine(tiny_llama_dir).shutdown()
    assert events == ["grammar", "trim", "engine"]


def test_the_model_loads_on_a_thread_that_ended_before_the_engine_runs(tiny_llama_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # glibc gives each thread its own malloc arena: the load's freed holes stay in the loading thread's arena, and
    # the steps allocate in the engine thread's (async_engine._load)
    from lmrpc.server.engine import async_engine

    loaders: list[threading.Thread] = []
    real_load = async_engine.load_model

    def load(*args: Any, **kwargs: Any) -> Any:
        loaders.append(threading.current_thread())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(async_engine, "load_model", load)
    engine = make_engine(tiny_llama_dir)
    try:
        (loader,) = loaders
        assert loader is not engine._thread and loader is not threading.main_thread()
        assert not loader.is_alive()
    finally:
        engine.shutdown()


def test_a_failed_load_is_raised_by_start(tmp_path: Path) -> None:
    # the loading thread's error crosses two threads to the caller
    from lmrpc.server.config import EngineConfig, ModelConfig

    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    before = set(threading.enumerate())
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors weights"):
        AsyncEngine.start(EngineConfig(model=ModelConfig(path=str(tmp_path))))
    for thread in set(threading.enumerate()) - before:  # neither the engine's thread nor the loader's is left
        thread.join(timeout=10)
        assert not thread.is_alive(), thread.name


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[AsyncEngine]:
    eng = make_engine(tiny_llama_dir)
    yield eng
    eng.shutdown()


async def test_an_idle_engine_trims_after_work_and_not_between_steps(engine: AsyncEngine) -> None:
    heap = engine.engine.heap
    before = heap.trims
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    request = EngineRequest(request_id="trim", rid="trim", index=0, prompt_ids=tuple(range(100, 140)), params=params)
    async for _ in engine.generate([request]):
        pass
    # Sixteen steps ran: at most one trim can have come from this request's idle tick
    for _ in range(100):
        if heap.trims > before:
            break
        await asyncio.sleep(0.05)
    assert heap.trims == before + 1
