"""A scripted stand-in for AsyncEngine with the real SmolLM2 tokenizer, and the real OpenAIService over it on an
in-process grpc.aio server (its own event loop on a thread, so sync clients and the CLI can call it).

Each output's tokens come from a script: by default the text SCRIPT[request.index % len(SCRIPT)] then EOS; a
script may name a per-output logprob. Text, stop rules and finish come from the engine's real OutputProcessor, so
the servicer sees what the engine would send. No model, no torch work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import grpc
from transformers import PreTrainedTokenizerBase

from lmrpc.server.config import EngineConfig, LoraConfig, SchedulerConfig, ServerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.detokenizer import OutputProcessor
from lmrpc.server.engine.grammar_limits import GrammarError
from lmrpc.server.engine.types import (
    Constraint,
    EngineOutput,
    EngineRequest,
    EngineStats,
    Finish,
    FinishReason,
    PositionLogprobs,
    TokenLogprob,
    Usage,
)
from lmrpc.server.frontend import Frontend
from lmrpc.server.load import LoadTracker
from lmrpc.server.lora.registry import LoraRegistry
from lmrpc.server.models.types import ModelInfo
from lmrpc.server.openai.service import OpenAIService
from lmrpc.v1 import openai_pb2_grpc

EOS = 2
FAIL = "FAIL"  # a script text that ends the output with ERROR
HANG = "HANG"  # a script text whose output sends one token, then waits until the call is cancelled
INFO = ModelInfo(path="/models/scripted", served_model_name="scripted", architecture="LlamaForCausalLM",
                 vocab_size=49152, max_context_length=2048, eos_token_ids=(EOS,), generation_defaults={},
                 dtype="float32", device="cpu")


@dataclass(frozen=True)
class Scripted:
    """What one output generates."""

    text: str  # its tokens are this text's, then EOS
    logprob: float = -0.5  # every token's logprob


Script = Callable[[EngineRequest], Scripted]


class _TokenBytes:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer

    def token_bytes(self, token_id: int) -> bytes:
        return str(self._tokenizer.decode([token_id])).encode()


@dataclass
class ScriptedEngine:
    """What OpenAIService calls on AsyncEngine."""

    tokenizer: PreTrainedTokenizerBase
    script: Script
    model_info: ModelInfo = INFO
    requests: list[EngineRequest] = field(default_factory=list)  # every request submitted, in order
    live: set[str] = field(default_factory=set)  # request ids generating now
    grammar: _TokenBytes = field(init=False)
    failure: str | None = None  # AsyncEngine.failure: set, calls are refused UNAVAILABLE
    media_processor: Any = None  # AsyncEngine.media_processor: a text-only model
    running_by_client: dict[str, int] = field(default_factory=dict)  # nobody counted: no per-client cap reached
    load_tracker: LoadTracker = field(default_factory=LoadTracker)  # what ORCA reports read
    # no adapters can load (no model): lora_path is NOT_FOUND, GetModelInfo lists none
    lora: LoraRegistry = field(default_factory=lambda: LoraRegistry(LoraConfig(), None))

    def __post_init__(self) -> None:
        self.grammar = _TokenBytes(self.tokenizer)

    def check_constraint(self, constraint: Constraint) -> Constraint:
        if "objekt" in constraint.text:
            raise GrammarError("json_schema", "objekt")
        return constraint

    def is_live(self, rid: str) -> bool:
        return any(request_id.startswith(rid + "/") for request_id in self.live)

    def abort(self, rids: list[str] | None) -> list[str]:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(len(self.live), 0, 10, 10, 0, 0)

    def _outputs(self, request: EngineRequest) -> list[EngineOutput]:
        scripted = self.script(request)
        if scripted.text == FAIL:
            return [EngineOutput(request.request_id, finish=Finish(FinishReason.ERROR, message="boom"),
                                 usage=Usage(len(request.prompt_ids), 0, 0))]
        tokens = [*self.tokenizer.encode(scripted.text, add_special_tokens=False), EOS]
        processor = OutputProcessor(self.tokenizer, request.prompt_ids, request.params, INFO.eos_token_ids)
        options = request.logprobs
        outputs = []
        for i, token in enumerate(tokens):
            step = processor.process(token)
            logprobs: tuple[PositionLogprobs, ...] = ()
            if options is not None:
                alternatives = [token, 1000, 1001][:options.top_k]
                top = tuple(TokenLogprob(t, scripted.logprob - k) for k, t in enumerate(alternatives))
                logprobs = (PositionLogprobs(TokenLogprob(token, scripted.logprob), top),)
            prompt: tuple[PositionLogprobs, ...] = ()
            if i == 0 and options is not None and options.start_len == 0:
                ids = request.prompt_ids
                scored = [PositionLogprobs(TokenLogprob(t, -1.0), (TokenLogprob(t, -1.0),) * min(options.top_k, 1))
                          for t in ids[1:]]
                prompt = (PositionLogprobs(TokenLogprob(ids[0], None)), *scored)
            finish = step.finish
            outputs.append(EngineOutput(
                request.request_id, token_ids=(token,), text=step.text, output_logprobs=logprobs,
                input_logprobs=prompt, finish=finish,
                usage=Usage(len(request.prompt_ids), i + 1, 3) if finish is not None else None))
            if finish is not None:
                break
        return outputs

    async def generate(self, requests: list[EngineRequest]) -> AsyncIterator[EngineOutput]:
        self.requests += requests
        self.live |= {r.request_id for r in requests}
        try:
            pending = [self._outputs(r) for r in requests]
            hang = {r.request_id for r in requests if self.script(r).text == HANG}
            while any(pending):  # round-robin, one output per request per step, like the engine
                for outputs in pending:
                    if outputs:
                        out = outputs.pop(0)
                        if out.request_id in hang:
                            yield replace(out, finish=None, usage=None)
                            await asyncio.Event().wait()  # until the call is cancelled
                        if out.finish is not None:
                            self.live.discard(out.request_id)
                        yield out
                await asyncio.sleep(0)
        finally:
            self.live -= {r.request_id for r in requests}


@contextmanager
def serving_openai(engine: ScriptedEngine, chat_template: str | None = None) -> Iterator[str]:
    """The real OpenAIService over `engine` on 127.0.0.1:<free port>; yields the target."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        frontend = Frontend(cast(AsyncEngine, engine), EngineConfig(scheduler=SchedulerConfig(max_running_requests=8),
                                                                    sampling_defaults="openai"),
                            ServerConfig(host="127.0.0.1", port=0, max_queued_requests=8))
        openai_pb2_grpc.add_OpenAIServiceServicer_to_server(OpenAIService(frontend, chat_template), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    started: Future[tuple[grpc.aio.Server, int]] = asyncio.run_coroutine_threadsafe(start(), loop)
    server, port = started.result(timeout=30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=None), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
