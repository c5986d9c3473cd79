"""The rules of GenerateService's requests and of the sampling parameters every RPC shares: counts and sizes first
(from the request's own counts, before anything is read or built), then prompts, embeddings, extras and sampling.
Violations are collected and raised as a statuses.RequestError, which statuses.py maps to a gRPC status; the rules
of the OpenAI-shaped requests, which map onto these, live in openai/validation.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Union

import grpc
import numpy as np
import regex
from google.protobuf import json_format

from lmrpc.server.embeddings import prompt_embeddings
from lmrpc.server.engine.types import Constraint, HiddenStatesMode, PromptEmbeddings, SamplingParams
from lmrpc.server.lora.errors import AdapterError, AdapterErrorKind
from lmrpc.server.models.types import ModelInfo
from lmrpc.server.statuses import Collector, Violation, adapter_error, invalid
from lmrpc.server.userinput import clip
from lmrpc.v1 import generate_pb2, openai_pb2

if TYPE_CHECKING:
    from lmrpc.server.config import RequestLimits
    from lmrpc.server.lora.registry import LoadedAdapter, LoraRegistry

# The requests that may ask for hidden states and routed experts: the four fields are spelled alike in all three.
ExtrasRequest = Union[  # noqa: UP007 (runtime alias)
    generate_pb2.GenerateRequest, openai_pb2.CompleteRequest, openai_pb2.ChatCompleteRequest]
MAX_TOP_LOGPROBS = 20
OPENAI_DEFAULTS: dict[str, float] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
}


MAX_RID_CHARS = 256  # a request id is a name for logs, metrics and Abort, not a payload


def check_rids(c: Collector, field: str, rids: Sequence[str]) -> None:
    """Request ids: at most MAX_RID_CHARS printable characters each (they are echoed in logs and headers)."""
    for i, rid in enumerate(rids):
        if len(rid) > MAX_RID_CHARS or not rid.isprintable():
            c.check(False, f"{field}[{i}]" if len(rids) > 1 else field,
                    f"a request id is at most {MAX_RID_CHARS} printable characters, got {len(rid)} characters "
                    f"{'with control characters' if not rid.isprintable() else ''}".rstrip())
            return


def check_shape(req: generate_pb2.GenerateRequest) -> int:
    """Request shape; returns the number of prompts."""
    c = Collector()
    kinds = [k for k in ("text", "input_ids", "input_embeds") if len(getattr(req, k))]
    c.check(len(kinds) == 1, "text" if not kinds else kinds[1] if len(kinds) > 1 else kinds[0],
            f"give exactly one of text, input_ids or input_embeds, got {' and '.join(kinds)}" if kinds
            else "no prompt: set text, input_ids or input_embeds")
    c.raise_if_any()
    n = len(req.text) or len(req.input_ids) or len(req.input_embeds)
    for i, ids in enumerate(req.input_ids):
        c.check(len(ids.ids) > 0, f"input_ids[{i}]", "must not be empty")
    for i, text in enumerate(req.text):
        c.check(len(text) > 0, f"text[{i}]", "must not be empty")
    c.check(len(req.sampling_params) in (0, 1, n), "sampling_params",
            f"give 0, 1 or one per prompt ({n}), got {len(req.sampling_params)}")
    c.check(len(req.rid) in (0, n), "rid", f"give none or one per prompt ({n}), got {len(req.rid)}")
    c.check(len(req.lora_path) in (0, 1, n), "lora_path",
            f"give 0, 1 or one per prompt ({n}), got {len(req.lora_path)}")
    c.check(len(set(req.rid)) == len(req.rid), "rid", "request ids must be distinct")
    c.check(all(req.rid), "rid", "request ids must not be empty")
    check_rids(c, "rid", req.rid)
    ns = {sp.n if sp.HasField("n") else 1 for sp in req.sampling_params}
    c.check(len(ns) <= 1, "sampling_params.n", "all prompts of a request must use the same n")
    c.check(req.top_logprobs_num >= 0 and req.top_logprobs_num <= MAX_TOP_LOGPROBS, "top_logprobs_num",
            f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs_num}")
    c.raise_if_any()
    return n


class SizedSampling(Protocol):
    """The sampling lists whose sizes are bounded: GenerateService's SamplingParams and the OpenAI requests spell
    them alike."""

    @property
    def logit_bias(self) -> Mapping[int, float]: ...
    @property
    def stop(self) -> Sequence[str]: ...
    @property
    def stop_token_ids(self) -> Sequence[int]: ...
    @property
    def stop_regex(self) -> Sequence[str]: ...


def check_sizes(c: Collector, sampling: Sequence[tuple[str, SizedSampling]], limits: RequestLimits) -> None:
    """Each sampling params' lists within the server's limits, counted before any entry is read (a request of
    100,000 logit_bias keys is refused for its count, not checked key by key). `sampling`: (field prefix, params)."""
    for at, sp in sampling:
        lists = {"logit_bias": (len(sp.logit_bias), limits.max_logit_bias, "--max-logit-bias"),
                 "stop": (len(sp.stop), limits.max_stop, "--max-stop"),
                 "stop_token_ids": (len(sp.stop_token_ids), limits.max_stop, "--max-stop"),
                 "stop_regex": (len(sp.stop_regex), limits.max_stop, "--max-stop")}
        for name, (count, limit, flag) in lists.items():
            c.check(count <= limit, f"{at}{name}", f"has {count} entries; the server takes at most {limit} ({flag})")
        for name, texts in (("stop", sp.stop), ("stop_regex", sp.stop_regex)):
            if len(texts) <= limits.max_stop:  # (a longer list was refused for its count: not read)
                longest = max((len(t) for t in texts), default=0)
                c.check(longest <= limits.max_stop_chars, f"{at}{name}",
                        f"an entry has {longest} characters; the server takes at most {limits.max_stop_chars} "
                        "(--max-stop-chars)")


def check_outputs(outputs: int, limit: int, field: str) -> None:
    """A call whose outputs could never be admitted at once is a user error (not a retryable one); checked from the
    request's own counts before anything is built for it."""
    if outputs > limit:
        raise invalid(field, f"the call asks for {outputs} outputs; this server runs or queues at most {limit} at "
                             "once")


def check_generate_sizes(req: generate_pb2.GenerateRequest, num_prompts: int, limits: RequestLimits,
                         capacity: int) -> None:
    """A GenerateRequest's counts, before tokenizing or building anything: outputs (prompts x n) within what the
    server runs or queues, the sampling lists and token_ids_logprob within --max-* limits."""
    n = max((sp.n for sp in req.sampling_params if sp.HasField("n")), default=1)
    prompts = next(k for k in ("text", "input_ids", "input_embeds") if len(getattr(req, k)))
    check_outputs(num_prompts * max(n, 1), capacity, "sampling_params.n" if n > 1 else prompts)
    c = Collector()
    check_sizes(c, [(f"sampling_params[{i}].", sp) for i, sp in enumerate(req.sampling_params)], limits)
    count = len(req.token_ids_logprob)
    c.check(count <= limits.max_logprob_token_ids, "token_ids_logprob",
            f"has {count} entries; the server takes at most {limits.max_logprob_token_ids} (--max-logprob-token-ids)")
    c.raise_if_any()


def check_media_shape(req: generate_pb2.GenerateRequest, num_prompts: int) -> None:
    """image_data and audio_data: none, one list for every prompt, or one per prompt; with text or input_ids."""
    c = Collector()
    for name in ("image_data", "audio_data"):
        lists = len(getattr(req, name))
        c.check(lists in (0, 1, num_prompts), name, f"give 0, 1 or one list per prompt ({num_prompts}), got {lists}")
        c.check(not (lists and req.input_embeds), name,
                "media items need text or input_ids prompts (their placeholders mark where the items go)")
    c.raise_if_any()


def check_prompt_ids(c: Collector, ids: list[int], field: str, info: ModelInfo) -> None:
    """A tokenized prompt: ids in the vocabulary, and room left in the context for at least one token."""
    c.check(len(ids) < info.max_context_length, field,
            f"prompt has {len(ids)} tokens; the context holds {info.max_context_length}")
    if len(ids) < info.max_context_length:  # (a longer prompt is refused for its length: its ids are not read)
        bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
        c.check(bad is None, field, f"token id {bad} outside [0, {info.vocab_size})")


def check_embeddings(req: generate_pb2.GenerateRequest, info: ModelInfo) -> list[PromptEmbeddings]:
    """input_embeds: each prompt >= 1 position, every position the model's hidden size, finite values, room in the
    context for one token; a model that takes embeddings; no prompt logprobs (an embeddings prompt has no tokens)."""
    c = Collector()
    c.check(info.accepts_embeddings, "input_embeds",
            f"this model ({info.architecture}) runs on the transformers fallback, which takes token prompts only")
    c.check(not (req.return_logprob and req.HasField("logprob_start_len") and req.logprob_start_len >= 0),
            "logprob_start_len", "prompt logprobs need prompt tokens; an input_embeds prompt has none (use -1)")
    c.raise_if_any()
    out: list[PromptEmbeddings] = []
    width = info.hidden_size
    for i, prompt in enumerate(req.input_embeds):
        field = f"input_embeds[{i}]"
        positions = prompt.positions
        c.check(len(positions) > 0, f"{field}.positions", "must not be empty: give at least one position")
        c.check(len(positions) < info.max_context_length, f"{field}.positions",
                f"prompt has {len(positions)} positions; the context holds {info.max_context_length}")
        bad = next((j for j, p in enumerate(positions) if len(p.values) != width), None)
        if bad is not None:
            c.check(False, f"{field}.positions[{bad}].values",
                    f"has {len(positions[bad].values)} values; the model's hidden size is {width}")
        if not positions or bad is not None or len(positions) >= info.max_context_length:
            continue
        rows = np.array([p.values for p in positions], dtype=np.float32)  # [positions, hidden]
        finite = np.isfinite(rows).all(axis=1)  # [positions]
        if not finite.all():
            j = int(np.argmin(finite))
            c.check(False, f"{field}.positions[{j}].values", "values must be finite (no NaN or infinity)")
            continue
        out.append(prompt_embeddings(rows))
    c.raise_if_any()
    return out


def hidden_states_mode(req: ExtrasRequest, info: ModelInfo) -> HiddenStatesMode | None:
    """return_hidden_states and hidden_states_mode -> the mode (None: no hidden states)."""
    c = Collector()
    mode = req.hidden_states_mode
    c.check(req.return_hidden_states or mode == generate_pb2.HIDDEN_STATES_MODE_UNSPECIFIED, "hidden_states_mode",
            "applies only with return_hidden_states")
    c.check(not req.return_hidden_states or info.accepts_embeddings, "return_hidden_states",
            f"this model ({info.architecture}) runs on the transformers fallback, which gives logits only")
    c.raise_if_any()
    if not req.return_hidden_states:
        return None
    return HiddenStatesMode.LAST if mode == generate_pb2.HIDDEN_STATES_MODE_LAST else HiddenStatesMode.ALL


def routed_experts_from(req: ExtrasRequest, info: ModelInfo, enabled: bool) -> int | None:
    """return_routed_experts and routed_experts_start_len -> the first position to return (None: not asked).
    A dense model is INVALID_ARGUMENT; a server without --enable-return-routed-experts, FAILED_PRECONDITION."""
    c = Collector()
    c.check(req.return_routed_experts or not req.HasField("routed_experts_start_len"), "routed_experts_start_len",
            "applies only with return_routed_experts")
    c.check(not req.return_routed_experts or info.experts is not None, "return_routed_experts",
            f"this model ({info.architecture}) has no experts: routed experts exist only for mixture-of-experts "
            "models")
    c.raise_if_any()
    if not req.return_routed_experts:
        return None
    c.check(enabled, "--enable-return-routed-experts",
            "this server was started without --enable-return-routed-experts, so it does not return routed experts")
    c.raise_if_any(grpc.StatusCode.FAILED_PRECONDITION)
    return req.routed_experts_start_len if req.HasField("routed_experts_start_len") else 0


def check_routed_start(c: Collector, req: ExtrasRequest, prompt_len: int) -> None:
    """routed_experts_start_len within a prompt of `prompt_len` tokens (checked per prompt)."""
    if req.return_routed_experts and req.HasField("routed_experts_start_len"):
        k = req.routed_experts_start_len
        c.check(0 <= k <= prompt_len, "routed_experts_start_len",
                f"must be in [0, {prompt_len}] (prompt length), got {k}")


def check_prompt(ids: list[int], index: int, info: ModelInfo, req: generate_pb2.GenerateRequest) -> None:
    c = Collector()
    if not req.input_embeds:  # embeddings prompts were checked by check_embeddings; their ids are placeholders
        check_prompt_ids(c, ids, f"input_ids[{index}]" if req.input_ids else f"text[{index}]", info)
    if req.HasField("logprob_start_len"):
        k = req.logprob_start_len
        c.check(-1 <= k <= len(ids), "logprob_start_len", f"must be in [-1, {len(ids)}] (prompt length), got {k}")
    check_routed_start(c, req, len(ids))
    for t in req.token_ids_logprob:
        c.check(0 <= t < info.vocab_size, "token_ids_logprob", f"token id {t} outside [0, {info.vocab_size})")
    c.raise_if_any()


def resolve_sampling(
    pb: generate_pb2.SamplingParams, field: str | Callable[[str], str], info: ModelInfo, use_model_defaults: bool,
    prompt_len: int, processor: str, processors_enabled: bool,
) -> SamplingParams:
    """Validate one SamplingParams and resolve its defaults (request > model generation_config > constants).

    `field` names the violations: a prefix ("sampling_params[0]" -> "sampling_params[0].top_p"), or a function
    from a SamplingParams field name to the request's field (an RPC whose request spells the parameters its own
    way, e.g. "max_new_tokens" -> "max_tokens").
    """
    at = field if callable(field) else lambda name: f"{field}.{name}"
    c = Collector()
    defaults = dict(OPENAI_DEFAULTS)
    if use_model_defaults:
        defaults.update(info.generation_defaults)

    def get(name: str) -> float:
        return float(getattr(pb, name)) if pb.HasField(name) else float(defaults.get(name, 0.0))  # type: ignore[arg-type]

    temperature, top_p, min_p = get("temperature"), get("top_p"), get("min_p")
    top_k = int(get("top_k"))
    rep = get("repetition_penalty")
    freq = pb.frequency_penalty if pb.HasField("frequency_penalty") else 0.0
    pres = pb.presence_penalty if pb.HasField("presence_penalty") else 0.0
    max_new = pb.max_new_tokens if pb.HasField("max_new_tokens") else 128
    min_new = pb.min_new_tokens if pb.HasField("min_new_tokens") else 0
    n = pb.n if pb.HasField("n") else 1
    c.check(temperature >= 0, at("temperature"), f"must be >= 0, got {temperature}")
    c.check(0 < top_p <= 1, at("top_p"), f"must be in (0, 1], got {top_p}")
    c.check(top_k == -1 or top_k >= 1, at("top_k"), f"must be -1 or >= 1, got {top_k}")
    c.check(0 <= min_p <= 1, at("min_p"), f"must be in [0, 1], got {min_p}")
    c.check(-2 <= freq <= 2, at("frequency_penalty"), f"must be in [-2, 2], got {freq}")
    c.check(-2 <= pres <= 2, at("presence_penalty"), f"must be in [-2, 2], got {pres}")
    # 0 would divide positive logits by zero (inf, then NaN probabilities): the range is open at 0.
    c.check(0 < rep <= 2, at("repetition_penalty"), f"must be in (0, 2], got {rep}")
    c.check(max_new >= 0, at("max_new_tokens"), f"must be >= 0, got {max_new}")
    c.check(0 <= min_new <= max(max_new, 0), at("min_new_tokens"),
            f"must be in [0, {max_new}] (the maximum number of tokens to generate), got {min_new}")
    c.check(n >= 1, at("n"), f"must be >= 1, got {n}")
    for key, value in pb.logit_bias.items():
        c.check(0 <= key < info.vocab_size, at("logit_bias"), f"key {key} outside [0, {info.vocab_size})")
        c.check(-100 <= value <= 100, at("logit_bias"), f"value {value} for {key} outside [-100, 100]")
    for t in pb.stop_token_ids:
        c.check(0 <= t < info.vocab_size, at("stop_token_ids"), f"token id {t} outside [0, {info.vocab_size})")
    for s in pb.stop:
        c.check(bool(s), at("stop"), "stop strings must not be empty")
    # Compiled here, once per request, with the module the detokenizer matches with; outside regex's own cache of
    # 500 patterns, which users' patterns would fill (bursts of 1,024 distinct ones kept 40-80 MiB after a trim).
    patterns = []
    for pattern in pb.stop_regex:
        try:
            patterns.append(regex.compile(pattern, cache_pattern=False))
        except regex.error as exc:
            c.violations.append(Violation(at("stop_regex"), f"invalid pattern {clip(pattern)!r}: {exc}"))
    c.check(not processor or processors_enabled, "custom_logit_processor",
            "custom logit processors are disabled (server flag --enable-custom-logit-processor)")
    kind = pb.WhichOneof("constraint")
    json_whitespace = pb.json_whitespace_flexible if pb.HasField("json_whitespace_flexible") else None
    c.check(json_whitespace is None or kind in ("json_schema", "structural_tag"), at("json_whitespace_flexible"),
            f"applies only with json_schema or structural_tag, got {kind or 'no constraint'}")
    c.raise_if_any()
    params: Mapping[str, object] = (
        whole_numbers_as_ints(json_format.MessageToDict(pb.custom_params)) if pb.HasField("custom_params") else {}
    )
    return SamplingParams(
        max_new_tokens=min(max_new, max(0, info.max_context_length - prompt_len)),
        min_new_tokens=min_new, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep,
        stop=tuple(pb.stop), stop_token_ids=tuple(pb.stop_token_ids), stop_regex=tuple(pb.stop_regex),
        stop_patterns=tuple(patterns), ignore_eos=pb.ignore_eos,
        skip_special_tokens=pb.skip_special_tokens if pb.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=pb.spaces_between_special_tokens if pb.HasField(
            "spaces_between_special_tokens") else True,
        no_stop_trim=pb.no_stop_trim, logit_bias=dict(pb.logit_bias),
        seed=pb.sampling_seed if pb.HasField("sampling_seed") else None, n=n,
        constraint=Constraint(kind, getattr(pb, kind), json_whitespace) if kind else None,
        logit_processor=processor or None, processor_params=dict(params),
    )


async def resolve_adapter(registry: LoraRegistry, ref: str, field: str) -> LoadedAdapter | None:
    """The LoRA adapter `ref` names ("": None, the base model), loaded from under --lora-root if need be (in a
    worker thread: it reads files); an unusable one is a RequestError on `field`. While --max-loaded-loras adapters
    are loaded and none may be evicted, a request needing another waits (on the event loop, no thread held) until a
    call ends or an adapter is unloaded; its deadline or a cancel ends the wait. When every one is pinned
    (--lora-modules) nothing would free: RESOURCE_EXHAUSTED at once."""
    if not ref:
        return None
    while True:
        try:
            return await asyncio.to_thread(registry.resolve, ref)
        except AdapterError as exc:
            if exc.kind is not AdapterErrorKind.EXHAUSTED or not registry.room_may_free():
                raise adapter_error(exc, field) from exc  # (every slot pinned by --lora-modules: none will free)
        await registry.wait_for_room()


def lora_ref(refs: Sequence[str], index: int) -> str:
    """The adapter of prompt `index` given a request's lora_path (none, one for all, or one per prompt): "" for
    the base model."""
    if not refs:
        return ""
    return refs[0] if len(refs) == 1 else refs[index]


def whole_numbers_as_ints(value: Any) -> Any:
    """google.protobuf.Struct carries every number as a double; processors expect token ids as ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [whole_numbers_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: whole_numbers_as_ints(v) for k, v in value.items()}
    return value
