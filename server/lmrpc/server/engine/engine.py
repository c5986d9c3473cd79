"""The engine: one loop that owns the model, run on its own thread (its asyncio front, AsyncEngine, is in
async_engine.py).

Life of a request inside: `AsyncEngine.generate` posts `EngineRequest`s to the engine thread's inbox; the loop
admits them into the scheduler; each `step()` schedules a batch, runs the model, samples, updates each sequence
(detokenize, stop rules, grammar) and emits `EngineOutput` deltas, which the outbox posts back to the event loop
together at the end of the loop's iteration (outbox.py). Aborts and cancels travel through the same inbox and are
applied before the next step, so a cancelled request's pages are free before the model runs again.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from lmrpc.server.config import EngineConfig
from lmrpc.server.engine import hidden_states, media_rows, outputs, routed_experts
from lmrpc.server.engine.detokenizer import OutputProcessor
from lmrpc.server.engine.executor import ForwardOutput, HiddenRows, ModelExecutor, PromptLogits
from lmrpc.server.engine.grammar import GrammarBackend, GrammarMatcher, MaskFiller
from lmrpc.server.engine.kv_cache import KVCacheManager
from lmrpc.server.engine.live import (
    Command,
    LiveRequest,
    OutputFlow,
    Sink,
    _Abort,
    _Add,
    _Call,
    _Stop,
    apply_backpressure,
)
from lmrpc.server.engine.outbox import Outbox
from lmrpc.server.engine.sampler import Sampler, SampleResultRow, SamplingState, prompt_logprobs
from lmrpc.server.engine.scheduler import Scheduler
from lmrpc.server.engine.sequence import ScheduledBatch, Sequence
from lmrpc.server.engine.step_budget import macs_per_token, step_token_budget
from lmrpc.server.engine.step_sampling import StepSampler
from lmrpc.server.engine.types import (
    Constraint,
    EngineRequest,
    EngineStats,
    Finish,
    FinishReason,
    PositionLogprobs,
    TokenLogprob,
)
from lmrpc.server.heap import HeapTrimmer
from lmrpc.server.load import LoadTracker
from lmrpc.server.logit_processors import ProcessorRegistry
from lmrpc.server.lora.registry import LoraRegistry
from lmrpc.server.models.loader import LoadedModel
from lmrpc.server.models.types import ModelInfo

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# The loop wakes this often when idle, so its heartbeat stays fresh: a stale heartbeat means a step that has not
# returned (the watchdog's signal), never an idle engine.
IDLE_TICK = 0.25


class EngineUnavailable(Exception):
    """The engine cannot serve (its thread died or is stuck): calls end UNAVAILABLE with this message."""


class Engine:
    """The single-threaded loop over one model. Not thread-safe: only `submit` may be called from other threads."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        processors: ProcessorRegistry,
        grammar: GrammarBackend,
    ) -> None:
        self.info: ModelInfo = loaded.info
        self.tokenizer = loaded.tokenizer
        self.media_processor = loaded.processor  # places images/audio in prompts (multimodal models); else None
        self.executor = ModelExecutor(loaded, config)
        kv = KVCacheManager(self.executor.num_pages, self.executor.page_size, config.cache.enable_prefix_cache)
        budget = step_token_budget(macs_per_token(self.executor.model), gpu=self.executor.device.type == "cuda")
        self.scheduler = Scheduler(config.scheduler.with_budget(budget), kv, config.lora.max_loras_per_batch)
        # LoRA adapters: --lora-modules loaded here, on the engine thread, before serving; pinned (never evicted)
        self.lora = LoraRegistry(config.lora, self.executor.model)
        for name, path in config.lora.lora_modules:
            self.lora.load(name, path, confined=False, pinned=True)
        self.processors = processors
        self.grammar = grammar
        self._eos = frozenset(self.info.eos_token_ids)
        self._live: dict[str, LiveRequest] = {}
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # Outputs for the event loop, posted once per loop iteration (async_engine's sinks put them here)
        self.outbox = Outbox()
        self.masks = MaskFiller(grammar)  # grammar bitmasks, filled while the model runs
        self.sampling = StepSampler(Sampler(self.info.vocab_size, self.info.eos_token_ids, self.executor.device),
                                    self.masks, self.executor.device)
        self.max_buffered_outputs = config.max_buffered_outputs  # backpressure bound per output
        self.load = LoadTracker()  # tokens/s and queue times for GetLoad and ORCA reports
        self.heap = HeapTrimmer()  # what a burst freed goes back to the OS once the loop idles
        # Read by the watchdog from the event loop: when the loop last came round (time.monotonic()), and what killed
        # the thread, if something did.
        self.heartbeat = time.monotonic()
        self.died: BaseException | None = None
        # Live outputs per client among the running ones (admission's per-client cap reads it); replaced, never
        # mutated, so another thread reads a consistent dict.
        self.running_by_client: dict[str, int] = {}
        # Test hook (no flag sets it): called with each step's batch before the forward, so a test can make a step
        # fail or hang.
        self.step_hook: Callable[[ScheduledBatch], None] | None = None
        self._step_lives: list[LiveRequest] | None = None  # the requests of the step being run

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    # ---- commands (any thread) -------------------------------------------------------------------------------

    def submit(self, command: Command) -> None:
        self._inbox.put(command)

    # ---- the loop (engine thread) ----------------------------------------------------------------------------

    def run_forever(self) -> None:
        try:
            while True:
                self.heartbeat = time.monotonic()
                self.running_by_client = _count_clients(self.scheduler.running)
                apply_backpressure(self._live.values(), self.max_buffered_outputs)
                if not self._drain_inbox(block=not self.scheduler.has_runnable_work):
                    return
                if self.scheduler.has_runnable_work:
                    self._guarded_step()
                    self.heap.busy()
                self.kv.publish()  # the prefix cache's changes of this iteration, to its listener (KV events)
                self.outbox.flush()
        except BaseException as exc:
            # Not swallowed: the thread ends. The watchdog sees it and fails the calls in flight.
            self.died = exc
            logger.critical("the engine thread died: %r", exc, exc_info=exc)
            raise
        finally:
            self.outbox.flush()  # what _abort_all said on stop
            self.masks.shutdown()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; when idle, wait a tick for the first one. False once told to stop."""
        command: Command | None = None
        if block:
            try:
                command = self._inbox.get(timeout=IDLE_TICK)
            except queue.Empty:
                self.heap.idle()
                return True
            self.heap.busy()
        while True:
            if command is None:
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    return True
            if isinstance(command, _Stop):
                self._abort_all("server shutting down")
                return False
            if isinstance(command, _Add):
                self.add(command.request, command.sink, command.flow, command.submitted_at)
            elif isinstance(command, _Abort):
                self.abort(command.request_id, command.reason)
            elif isinstance(command, _Call):
                command.fn()
            command = None  # a _Wake only ends the wait

    def _guarded_step(self) -> None:
        # An unexpected failure inside a step must not kill the thread that serves every request: fail the requests
        # of that step (they see ERROR with the message; their state is half-updated), log it with the stack, and
        # keep serving the others. A failure before the step had a batch leaves the scheduler suspect: fail all.
        self._step_lives = None
        try:
            self.step()
        except Exception as exc:  # logged with its stack and reported to every affected request
            lives = self._step_lives if self._step_lives is not None else list(self._live.values())
            logger.exception("engine step failed; failing the %d requests of that step", len(lives))
            for live in lives:
                if self._live.get(live.request.request_id) is live:
                    self._finish(live, Finish(FinishReason.ERROR, message=f"engine step failed: {exc!r}"))
        finally:
            self._step_lives = None

    def step(self) -> None:
        """One iteration: schedule, forward (grammar masks fill meanwhile), sample, update, emit."""
        batch = self.scheduler.schedule()
        if batch.empty:
            return
        self._step_lives = [self._live[c.seq.request_id] for c in batch.chunks]
        if self.step_hook is not None:
            self.step_hook(batch)
        self._stamp_scheduled(batch)
        sampling = self._sampling_lives(batch)
        pending = self.masks.start([None if live.lazy_grammar else live.grammar for live in sampling])
        try:
            forward = self.executor.forward(batch)
        finally:
            masks = pending.wait()  # [rows, words] or None; waited for even if the forward failed
        self.scheduler.on_computed(batch)
        self._record_prompt_logprobs(forward.prompt_logits)
        self._record_hidden(forward.hidden)
        for rows in forward.routed:
            routed_live = self._live.get(rows.seq.request_id)
            if routed_live is not None:
                routed_experts.record(routed_live, rows)
        results = self._sample(sampling, forward, masks)
        for live, result in zip(sampling, results, strict=True):
            self._update(live, result)
        self._emit(sampling)
        # Everything but decodes (one token past the prompt) is prompt work: prefill chunks, recomputes.
        prompt_tokens = sum(c.num_tokens for c in batch.chunks if c.num_tokens > 1 or c.start < c.seq.num_prompt_tokens)
        self.load.add_tokens(sum(1 for r in results if r is not None), prompt_tokens)

    def _stamp_scheduled(self, batch: ScheduledBatch) -> None:
        now = time.monotonic()
        for chunk in batch.chunks:
            live = self._live[chunk.seq.request_id]
            if live.scheduled_at is None:
                live.scheduled_at = now
                if live.submitted_at is not None:
                    self.load.add_queue_time(now - live.submitted_at, now)

    # ---- admission and abort ---------------------------------------------------------------------------------

    def add(self, request: EngineRequest, sink: Sink, flow: OutputFlow | None = None,
            submitted_at: float | None = None) -> None:
        assert request.request_id not in self._live, f"duplicate request id {request.request_id}"
        params = request.params
        seq = Sequence(request)
        needed = len(request.prompt_ids) + params.max_new_tokens
        if not self.scheduler.can_ever_fit(needed):
            capacity = self.kv.num_pages * self.kv.page_size
            message = f"request needs {needed} tokens of KV cache but the pool holds {capacity}"
            sink(outputs.final(request, Finish(FinishReason.ERROR, message=message, request_fault=True), seq))
            return
        embeds = request.prompt_embeds
        if embeds is not None and (not self.info.accepts_embeddings or embeds.hidden != self.info.hidden_size):
            # The servicer refuses these (validation.check_embeddings); an in-process caller gets a clear error.
            message = f"this model takes embeddings of width {self.info.hidden_size} only from a native model"
            sink(outputs.final(request, Finish(FinishReason.ERROR, message=message), seq))
            return
        refused = media_rows.refusal(request, self.executor.model, self.info)
        if refused is not None:  # the service only builds prompt_media with the model's own processor
            sink(outputs.final(request, Finish(FinishReason.ERROR, message=refused), seq))
            return
        live = LiveRequest(
            seq=seq,
            sink=sink,
            sampling=SamplingState(params, request.logprobs, self.info.vocab_size, self.executor.device),
            # An embeddings prompt has no token text to set the first output token's leading-space context.
            output=OutputProcessor(self.tokenizer, () if embeds is not None else request.prompt_ids, params,
                                   self.info.eos_token_ids),
            grammar=self._new_matcher(params.constraint),
            processor=(
                self.processors.create(params.logit_processor, dict(params.processor_params))
                if params.logit_processor else None
            ),
            flow=flow,
            submitted_at=submitted_at,
        )
        wants_prompt_logprobs = request.logprobs is not None and request.logprobs.start_len >= 0
        if params.max_new_tokens == 0 and not wants_prompt_logprobs:
            # Nothing to compute: empty output, finish LENGTH, never touches the model.
            sink(outputs.final(request, Finish(FinishReason.LENGTH), seq))
            return
        if request.share_prefill_with is not None:
            sibling = self._live.get(request.share_prefill_with)
            seq.wait_for = sibling.seq if sibling is not None else None
        self._live[request.request_id] = live
        self.scheduler.add(seq)

    def _new_matcher(self, constraint: Constraint | None) -> GrammarMatcher | None:
        # The service checked the constraint (its matcher rides on it: this copies it), so this cannot fail on user
        # input; an unchecked one (in-process callers) is checked here, on the grammar's matcher thread.
        return None if constraint is None else self.grammar.new_matcher(constraint)

    def abort(self, request_id: str, reason: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            self._finish(live, Finish(FinishReason.ABORT, message=reason))

    def _abort_all(self, reason: str) -> None:
        for request_id in list(self._live):
            self.abort(request_id, reason)

    # ---- step parts ------------------------------------------------------------------------------------------

    def _record_hidden(self, chunks: Iterable[HiddenRows]) -> None:
        for chunk in chunks:
            live = self._live.get(chunk.seq.request_id)
            if live is not None:
                hidden_states.record(live, chunk)

    def _record_prompt_logprobs(self, chunks: Iterable[PromptLogits]) -> None:
        for chunk in chunks:
            live = self._live.get(chunk.seq.request_id)
            if live is None or live.prompt_logprobs_sent or live.request.logprobs is None:
                continue
            options = live.request.logprobs
            if not live.prompt_logprobs and options.start_len == 0:
                # Position 0 has no logprob: nothing predicts the first prompt token.
                first = live.seq.token_ids[0]
                text = outputs.token_text(self.tokenizer, live, first)
                live.prompt_logprobs.append(PositionLogprobs(TokenLogprob(first, None, text)))
            start = chunk.first_position + 1
            targets = live.seq.token_ids[start : start + chunk.logits.shape[0]]
            entries = prompt_logprobs(chunk.logits, targets, options)
            live.prompt_logprobs.extend(outputs.with_text(self.tokenizer, live, entry) for entry in entries)

    def _sampling_lives(self, batch: ScheduledBatch) -> list[LiveRequest]:
        """The live requests whose chunk produced next-token logits, in ForwardOutput.logits row order."""
        return [self._live[c.seq.request_id] for c in batch.chunks if c.samples]

    def _sample(self, lives: list[LiveRequest], forward: ForwardOutput,
                masks: torch.Tensor | None) -> list[SampleResultRow | None]:
        """Each generating row's next token, None for prompt scoring (step_sampling.py)."""
        return self.sampling.sample(lives, forward.logits, masks)

    def _update(self, live: LiveRequest, result: SampleResultRow | None) -> None:
        """Append the sampled token, advance grammar and text, and decide whether the sequence ends."""
        if result is None:  # prompt scoring only (max_new_tokens == 0)
            self._finish(live, Finish(FinishReason.LENGTH))
            return
        token = result.token_id
        live.seq.append_token(token)
        live.sampling.observe(token)
        live.pending_tokens.append(token)
        if result.logprobs is not None:
            live.pending_logprobs.append(outputs.with_text(self.tokenizer, live, result.logprobs))
        grammar_done = False
        if live.grammar is not None:
            live.grammar.advance(token)
            if live.grammar.error is not None:
                self._finish(live, Finish(FinishReason.ERROR, message=f"grammar: {live.grammar.error}",
                                          request_fault=True))
                return
            grammar_done = live.grammar.is_finished
        step = live.output.process(token, grammar_finished=grammar_done)
        if step.text:
            live.pending_text.append(step.text)
        if step.finish is not None:
            self._finish(live, step.finish)

    def _emit(self, lives: Iterable[LiveRequest]) -> None:
        for live in lives:
            if live.seq.finished or not (live.pending_tokens or live.pending_text):
                continue
            live.sink(outputs.take(live, finish=None))

    def _finish(self, live: LiveRequest, finish: Finish) -> None:
        """End a sequence: release its pages now, and send its last output."""
        self.scheduler.finish(live.seq)
        live.seq.finish = finish
        del self._live[live.request.request_id]
        live.sink(outputs.take(live, finish))

    def stats(self) -> EngineStats:
        kv = self.kv
        # Copies: scrapes and load reports call this off the engine thread, which may change the lists meanwhile.
        running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_pages=kv.num_pages,
            num_free_pages=kv.num_free_pages,
            num_used_pages=kv.num_used_pages,
            num_cached_pages=kv.num_cached_pages,
            num_paused=self.scheduler.num_paused,
            num_loaded_adapters=len(self.lora.names()),
            page_size=kv.page_size,
            max_adapters=self.scheduler.max_adapters if self.lora.enabled else 0,
            running_adapters=adapter_names(running),
            waiting_adapters=adapter_names(waiting),
        )


def adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The LoRA adapters these sequences run under, sorted, each once (base-model ones name none)."""
    return tuple(sorted({s.request.adapter.name for s in seqs if s.request.adapter is not None}))


def _count_clients(running: Iterable[Sequence]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in running:
        client = seq.request.client
        counts[client] = counts.get(client, 0) + 1
    return counts
