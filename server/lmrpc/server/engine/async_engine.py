"""The asyncio face of the engine (AsyncEngine): starts the engine thread, which loads the model and runs the loop
(engine.py), posts requests to it and hands their outputs to the event loop, one queue per call; the backpressure
counters of each output; what the watchdog reads (heartbeat, death) and does (fail the calls in flight)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from lmrpc.server import memory
from lmrpc.server.config import EngineConfig
from lmrpc.server.engine.engine import Engine, EngineUnavailable
from lmrpc.server.engine.grammar import GrammarBackend
from lmrpc.server.engine.kv_cache import CacheListener
from lmrpc.server.engine.live import OutputFlow, _Abort, _Add, _Call, _Stop, _Wake
from lmrpc.server.engine.types import Constraint, EngineOutput, EngineRequest, EngineStats, Finish, FinishReason
from lmrpc.server.heap import trim_heap
from lmrpc.server.load import LoadTracker
from lmrpc.server.logit_processors import ProcessorRegistry
from lmrpc.server.media.types import MultimodalProcessor
from lmrpc.server.models.loader import LoadedModel, default_gguf, load_model
from lmrpc.server.models.types import ModelInfo, ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")


def _resolve(future: asyncio.Future[Any], result: object) -> None:  # event loop
    if not future.done():  # its caller may have been cancelled meanwhile
        future.set_result(result)


def _load(config: EngineConfig) -> tuple[LoadedModel, GrammarBackend]:
    """The model and its grammar tables, built on a thread of their own that ends with the load (blocking).

    Why a thread of its own: glibc's malloc gives each thread an arena, and a load's temporaries (a GGUF's blocks
    shuffled into the kernels' layout through megabytes per tensor) leave the loading thread's arena large and full
    of holes between blocks that stay alive (1.7B Q4_K_M: 353 MB, 288 of them free). Trimmed, the holes cost no
    memory, but steps run in that arena touch a different hole each time: the server's RSS rose 96 MB above ready
    over two rounds of 1/8/32 streams (peak 2,348 MiB). Run in an arena of their own, the steps reuse the same few
    megabytes (peak 2,307 MiB, the same load). The thread's OpenMP pool ends with it (libgomp frees a thread's pool
    when the thread exits), so the engine's kernels still have the cores to themselves.
    """

    def run() -> tuple[LoadedModel, GrammarBackend]:
        loaded = load_model(config.model)
        grammar = GrammarBackend(loaded.tokenizer, loaded.info.vocab_size, config.grammar)
        # The grammar tables' build leaves tens of MB of freed heap (a 49k-token vocabulary: ~50 MB): back to the OS
        # before the engine allocates its KV pool, so the process's peak is not pool + that heap.
        trim_heap()
        return loaded, grammar

    # Leaving the block joins the thread; result() raises here what the load raised there.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmrpc-load") as pool:
        return pool.submit(run).result()


class AsyncEngine:
    """The asyncio face of the engine: implements protocol.EngineClient; the loop runs on a daemon thread."""

    def __init__(self, engine: Engine, thread: threading.Thread) -> None:
        self._engine = engine
        self._thread = thread  # runs engine.run_forever
        self.model_info: ModelInfo = engine.info
        self.tokenizer: PreTrainedTokenizerBase = engine.tokenizer
        self.processors = engine.processors
        # A multimodal model's MultimodalProcessor (call its prepare in a worker thread: it runs the HF processor);
        # None for a text-only model
        self.media_processor: MultimodalProcessor | None = engine.media_processor
        self.grammar = engine.grammar
        self.lora = engine.lora  # the loaded LoRA adapters (lora/registry.py)
        self.scheduler_config = engine.scheduler.config  # the batching limits in force (token budgets sized)
        self._ids_by_rid: dict[str, set[str]] = {}  # event-loop side: live request ids per user rid
        self._serial = itertools.count()
        self._calls: set[asyncio.Queue[EngineOutput | EngineUnavailable]] = set()  # output queues of calls in flight
        self.failure: str | None = None  # why the engine cannot serve now (set by the watchdog); None: it can

    @classmethod
    def start(cls, config: EngineConfig) -> AsyncEngine:
        """Start the engine thread, which loads the model and then loops; return once it is loaded (blocking: call
        it off the event loop). A load failure is raised here.

        The model is loaded from the engine thread (on a thread that ends with the load: `_load`), not here, so that
        one thread does all of torch's work once serving: torch's CPU kernels run on an OpenMP pool owned by the
        thread that calls them, and a second pool left by another live thread contends for the same cores (measured
        on 2 cores: one pass over SmolLM2's layer matrices took about 1.3x longer on a second torch thread than on
        the only one).
        """
        built: queue.SimpleQueue[Engine | BaseException] = queue.SimpleQueue()

        def main() -> None:
            try:
                # A model whose weights alone exceed the container's memory limit would be OOM-killed while loading,
                # with nothing said: refuse it first (memory.py).
                path = Path(config.model.path) if config.model.path else default_gguf()
                if path.exists():
                    memory.check_model_fits(memory.model_files_bytes(path), memory.memory_budget())
                loaded, grammar = _load(config)
                engine = Engine(loaded, config, ProcessorRegistry.load(), grammar)
            except BaseException as exc:  # noqa: BLE001 (not swallowed: start() raises it in the caller)
                built.put(exc)
                return
            # Everything loaded so far (model, tokenizer, grammar tables) lives until exit: move it out of the cyclic
            # garbage collector's sight, which otherwise walks it in every full collection (measured here: about a
            # tenth of a decode step's time).
            gc.freeze()
            built.put(engine)
            engine.run_forever()

        thread = threading.Thread(target=main, name="lmrpc-engine", daemon=True)
        thread.start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return cls(result, thread)

    @property
    def engine(self) -> Engine:
        """The engine itself (tests read its page pool)."""
        return self._engine

    def check_constraint(self, constraint: Constraint) -> Constraint:
        """The constraint with the matcher its check built (the engine copies it for each output); raises
        GrammarError (kind and compiler's message) if it does not compile (blocking: call it off the event loop)."""
        return self.grammar.checked(constraint)

    def warmup(self) -> None:
        """Run one tiny generation so the first real request doesn't pay one-time costs (blocking). A model that
        loaded but cannot generate (its step fails) is a ModelLoadError here: the server never reports SERVING for
        it."""
        from lmrpc.server.engine.types import SamplingParams

        done = threading.Event()
        finishes: list[Finish] = []
        request = EngineRequest(
            request_id=f"warmup-{next(self._serial)}", rid="warmup", index=0,
            prompt_ids=tuple(self.tokenizer.encode("Hello")) or (0,),
            params=SamplingParams(max_new_tokens=2, temperature=0.0),
        )

        def sink(output: EngineOutput) -> None:
            if output.finish is not None:
                finishes.append(output.finish)
                done.set()

        self._engine.submit(_Add(request, sink))
        if not done.wait(timeout=300):
            raise TimeoutError("engine warm-up did not finish in 300 s")
        if finishes[0].reason is FinishReason.ERROR:  # the engine logged the failure with its stack
            raise ModelLoadError(f"the model loaded, but its warm-up generation failed: {finishes[0].message}")

    async def generate(self, requests: list[EngineRequest]) -> AsyncGenerator[EngineOutput, None]:
        """Outputs of `requests` as they come. Raises EngineUnavailable when the engine cannot serve (now, or later:
        the watchdog fails calls in flight)."""
        if self.failure is not None:
            raise EngineUnavailable(self.failure)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[EngineOutput | EngineUnavailable] = asyncio.Queue()
        flows = {r.request_id: OutputFlow() for r in requests}

        def sink(output: EngineOutput) -> None:  # engine thread
            if output.finish is None:
                flows[output.request_id].emitted += 1
            self._engine.outbox.put(loop, outputs.put_nowait, output)  # posted at the end of the engine's iteration

        remaining = {r.request_id for r in requests}
        for r in requests:
            self._ids_by_rid.setdefault(r.rid, set()).add(r.request_id)
        self._calls.add(outputs)
        try:
            now = time.monotonic()
            for r in requests:
                self._engine.submit(_Add(r, sink, flows[r.request_id], now))
            while remaining:
                output = await outputs.get()
                if isinstance(output, EngineUnavailable):
                    raise output
                if output.finish is not None:
                    remaining.discard(output.request_id)
                else:
                    self._took(flows[output.request_id])
                yield output
        finally:
            self._calls.discard(outputs)
            # Closed early (cancelled call, passed deadline, client gone): free the rest at once.
            for request_id in remaining:
                self._engine.submit(_Abort(request_id, "cancelled"))
            for r in requests:
                ids = self._ids_by_rid.get(r.rid)
                if ids is not None:
                    ids.discard(r.request_id)
                    if not ids:
                        del self._ids_by_rid[r.rid]

    def _took(self, flow: OutputFlow) -> None:
        """The consumer took one delta: a paused output whose backlog fell to half resumes (wake the loop for it)."""
        flow.taken += 1
        if flow.paused and flow.backlog == self._engine.max_buffered_outputs // 2:
            self._engine.submit(_Wake())

    # ---- the prefix cache (SMG's KV events, FlushCache) ----------------------------------------------------------

    async def _on_engine(self, fn: Callable[[Engine], T]) -> T:
        """fn(engine) run on the engine thread between steps; its result delivered with the iteration's outputs."""
        if self.failure is not None:
            raise EngineUnavailable(self.failure)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        engine = self._engine

        def call() -> None:  # engine thread
            engine.outbox.put(loop, lambda result: _resolve(done, result), fn(engine))

        engine.submit(_Call(call))
        return await done

    async def set_cache_listener(self, listener: CacheListener | None) -> None:
        """Tell `listener` what the prefix cache takes in and lets go, starting with what it holds now."""
        await self._on_engine(lambda engine: engine.kv.set_listener(listener))

    async def flush_cache(self) -> int:
        """Drop every cached page no request holds; returns how many were dropped."""
        return await self._on_engine(lambda engine: engine.kv.flush())

    # ---- supervision (the watchdog, on the event loop) ---------------------------------------------------------

    @property
    def heartbeat(self) -> float:
        """time.monotonic() when the engine loop last came round."""
        return self._engine.heartbeat

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def died(self) -> BaseException | None:
        """What ended the engine thread, if something did."""
        return self._engine.died

    @property
    def running_by_client(self) -> dict[str, int]:
        """Running outputs per client identity (refreshed each time the loop comes round)."""
        return self._engine.running_by_client

    @property
    def load_tracker(self) -> LoadTracker:
        return self._engine.load

    @property
    def has_work(self) -> bool:
        """Calls are waiting on the engine."""
        return bool(self._calls)

    def fail_calls(self, reason: str) -> int:
        """The engine cannot serve: end every call in flight (EngineUnavailable) and refuse new ones until
        `recovered`. Returns how many calls were failed. Their engine requests are aborted as the calls close, so a
        stuck engine that comes back frees their pages."""
        self.failure = reason
        calls = list(self._calls)
        for outputs in calls:
            outputs.put_nowait(EngineUnavailable(reason))
        return len(calls)

    def recovered(self) -> None:
        self.failure = None

    def abort(self, rids: list[str] | None) -> list[str]:
        targets = list(self._ids_by_rid) if rids is None else [rid for rid in rids if rid in self._ids_by_rid]
        for rid in targets:
            for request_id in self._ids_by_rid[rid]:
                self._engine.submit(_Abort(request_id, "aborted by request"))
        return targets

    def is_live(self, rid: str) -> bool:
        return rid in self._ids_by_rid

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def shutdown(self) -> None:
        self._engine.submit(_Stop())
        self._thread.join(timeout=30)
