"""The rules of CompleteRequest and ChatCompleteRequest: every field checked at the edge, violations named by the
OpenAI field, the result a typed options object. The sampling parameters themselves go through the same rules as
GenerateService's (lmrpc.server.validation.resolve_sampling), under the OpenAI names."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

import grpc
from google.protobuf import json_format, struct_pb2

from lmrpc.server import validation
from lmrpc.server.engine.types import ConstraintKind, HiddenStatesMode
from lmrpc.server.media.ingest import WireItem
from lmrpc.server.media.types import Modality
from lmrpc.server.models.types import ModelInfo
from lmrpc.server.statuses import Collector, RequestError, Violation
from lmrpc.v1 import generate_pb2, openai_pb2

OpenAIRequest = Union[openai_pb2.CompleteRequest, openai_pb2.ChatCompleteRequest]  # noqa: UP007 (runtime alias)
ToolMode = Literal["none", "auto", "required", "function"]

COMPLETE_MAX_TOKENS = 16  # OpenAI's default for completions; chat's default is what the context leaves
ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "image_url", "input_audio")
AUDIO_FORMATS = ("wav", "mp3", "flac")  # input_audio.format
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# SamplingParams fields whose OpenAI names differ (the rest are spelled alike).
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}


@dataclass(frozen=True)
class OutputOptions:
    """How a call's answer is sent."""

    stream: bool  # chunks as they come, or one message
    include_usage: bool  # streamed: a last chunk without choices carries the usage
    continuous_usage: bool  # streamed: every chunk carries the usage so far
    return_token_ids: bool  # choices carry their token ids and their prompt's
    cached_details: bool  # usage says where cached tokens were kept


@dataclass(frozen=True)
class ModelOutputs:
    """What a call returns besides tokens: final-layer hidden states and routed experts (None: not asked)."""

    hidden_states: HiddenStatesMode | None  # which hidden states
    routed_experts_from: int | None  # the first prompt position whose routed experts are returned


@dataclass(frozen=True)
class ConstraintRequest:
    """A structured-output constraint as asked for, before it is compiled."""

    field: str  # the request field it came from (named in a compile error)
    kind: ConstraintKind  # the grammar language of `text`
    text: str  # the schema / pattern / grammar / structural tag


@dataclass(frozen=True)
class CompletionOptions:
    """A CompleteRequest's checked options (its prompts are tokenized by the service)."""

    n: int  # choices returned per prompt
    best_of: int  # candidates generated per prompt (>= n); the n best are returned
    echo: bool  # choices start with their prompt
    logprobs: int | None  # alternatives per token; None: no logprobs
    suffix: str  # fill-in-the-middle suffix ("" none)
    constraint: ConstraintRequest | None  # structured output
    output: OutputOptions


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call."""

    name: str  # distinct among the request's tools
    description: str  # what it does, for the model
    parameters: Mapping[str, Any]  # the JSON schema of its arguments (an object schema)


@dataclass(frozen=True)
class ChatOptions:
    """A ChatCompleteRequest's checked options (its messages are rendered by the service)."""

    n: int  # choices returned
    logprobs: int | None  # alternatives per token; None: no logprobs
    tools: tuple[ToolSpec, ...]  # the functions on offer (empty with tool_choice "none")
    tool_mode: ToolMode  # none | auto | required | function
    tool_name: str | None  # the function to call, in mode "function"
    parallel_tool_calls: bool  # more than one call allowed
    add_generation_prompt: bool  # end the prompt with the opening of an assistant message
    continue_final_message: bool  # continue the last (assistant) message instead
    template_kwargs: Mapping[str, Any]  # extra chat-template variables
    constraint: ConstraintRequest | None  # structured output of the content (not with tool calls)
    output: OutputOptions


def struct_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    """A Struct as a dict, whole numbers as ints (a schema's maxLength: 40, not 40.0)."""
    value = validation.whole_numbers_as_ints(json_format.MessageToDict(struct))
    assert isinstance(value, dict)
    return value


# ---- shared by both RPCs ---------------------------------------------------------------------------------------


def model_outputs(req: OpenAIRequest, info: ModelInfo, routed_enabled: bool) -> ModelOutputs:
    """return_hidden_states / return_routed_experts with their mode and start, by GenerateService's rules (and its
    errors: a dense model INVALID_ARGUMENT, a server without --enable-return-routed-experts FAILED_PRECONDITION).
    routed_experts_start_len's range is checked per prompt by check_prompt."""
    return ModelOutputs(validation.hidden_states_mode(req, info),
                        validation.routed_experts_from(req, info, routed_enabled))


def check_model(model: str, served: str, lora_path: str) -> tuple[str, str]:
    """`model` names the served model (empty: it), or "base:adapter" one of its LoRA adapters; other names are
    NOT_FOUND. Returns (the adapter to run under, "" for none; the request field naming it), from model or
    lora_path, which must agree when both name one."""
    adapter, field = "", "model"
    if model and model != served:
        base, colon, adapter = model.partition(":")
        if not colon or base != served or not adapter:
            raise RequestError(grpc.StatusCode.NOT_FOUND, [Violation(
                "model", f"model {model!r} is not served here; the served model is {served!r} (or {served!r}:adapter "
                         "for a LoRA adapter)")])
    if lora_path:
        if adapter and adapter != lora_path:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, [Violation(
                "lora_path", f"names adapter {lora_path!r} while model names {adapter!r}: give one, or the same")])
        adapter, field = lora_path, "lora_path"
    return adapter, field


def sampling_names(max_tokens_field: str) -> Callable[[str], str]:
    """Names of resolve_sampling's violations: SamplingParams field -> the OpenAI request's field."""
    names = {**_OPENAI_NAMES, "max_new_tokens": max_tokens_field}
    return lambda name: names.get(name, name)


def sampling_pb(req: OpenAIRequest, max_tokens: int, constraint: ConstraintRequest | None
                ) -> generate_pb2.SamplingParams:
    """The request's sampling fields as GenerateService's SamplingParams (validated by resolve_sampling)."""
    pb = generate_pb2.SamplingParams(
        max_new_tokens=max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, stop_regex=req.stop_regex,
        ignore_eos=req.ignore_eos, no_stop_trim=req.no_stop_trim, logit_bias=req.logit_bias,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "skip_special_tokens", "json_whitespace_flexible"):
        if req.HasField(name):
            setattr(pb, name, getattr(req, name))
    if req.HasField("min_tokens"):
        pb.min_new_tokens = req.min_tokens
    if req.HasField("seed"):
        pb.sampling_seed = req.seed
    if constraint is not None:
        setattr(pb, constraint.kind, constraint.text)
    return pb


def _output_options(c: Collector, req: OpenAIRequest) -> OutputOptions:
    has_options = req.HasField("stream_options")
    c.check(req.stream or not has_options, "stream_options", "only with stream")
    return OutputOptions(
        stream=req.stream, include_usage=req.stream_options.include_usage,
        continuous_usage=req.stream_options.continuous_usage_stats, return_token_ids=req.return_token_ids,
        cached_details=req.return_cached_tokens_details,
    )


def _response_format(c: Collector, fmt: openai_pb2.ResponseFormat) -> ConstraintRequest | None:
    kind = fmt.type or "text"
    c.check(not fmt.HasField("json_schema") or kind == "json_schema", "response_format.json_schema",
            f'only with type "json_schema", got type {kind!r}')
    c.check(not (fmt.structures or fmt.triggers) or kind == "structural_tag", "response_format.structures",
            f'structures and triggers only with type "structural_tag", got type {kind!r}')
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintRequest("response_format", "json_schema", json.dumps({"type": "object"}))
    if kind == "json_schema":
        c.check(fmt.json_schema.HasField("schema"), "response_format.json_schema.schema",
                'required with type "json_schema"')
        schema = struct_dict(fmt.json_schema.schema)
        return ConstraintRequest("response_format", "json_schema", json.dumps(schema))
    if kind == "structural_tag":
        # The grammar module checks the rest (triggers starting structures, schemas) and names what is wrong.
        tag = {"type": "structural_tag", "triggers": list(fmt.triggers), "structures": [
            {"begin": s.begin, "schema": struct_dict(s.schema) if s.HasField("schema") else None, "end": s.end}
            for s in fmt.structures]}
        return ConstraintRequest("response_format", "structural_tag", json.dumps(tag))
    c.check(False, "response_format.type",
            f'must be "text", "json_object", "json_schema" or "structural_tag", got {kind!r}')
    return None


def _constraint(c: Collector, req: OpenAIRequest) -> ConstraintRequest | None:
    from_format = _response_format(c, req.response_format)
    which = req.WhichOneof("constraint")
    if which is None:
        return from_format
    c.check(from_format is None, which,
            "at most one structured-output constraint: not both response_format and " + which)
    kind: ConstraintKind = "json_schema" if which == "json_schema" else "regex" if which == "regex" else "ebnf"
    return ConstraintRequest(which, kind, getattr(req, which))


def _n(c: Collector, req: OpenAIRequest) -> int:
    n = req.n if req.HasField("n") else 1
    c.check(n >= 1, "n", f"must be >= 1, got {n}")
    return n


# ---- completions -----------------------------------------------------------------------------------------------


def completion_options(req: openai_pb2.CompleteRequest) -> CompletionOptions:
    """Every check that needs no tokenizer (the prompts' token ids are checked by check_prompt)."""
    c = Collector()
    kinds = [k for k in ("prompt", "prompt_token_ids") if len(getattr(req, k))]
    c.check(len(kinds) == 1, kinds[1] if len(kinds) > 1 else "prompt",
            "give exactly one of prompt and prompt_token_ids" if kinds else "no prompt: set prompt or "
                                                                           "prompt_token_ids")
    for i, text in enumerate(req.prompt):
        c.check(len(text) > 0, f"prompt[{i}]", "must not be empty")
    for i, ids in enumerate(req.prompt_token_ids):
        c.check(len(ids.ids) > 0, f"prompt_token_ids[{i}]", "must not be empty")
    n = _n(c, req)
    best_of = req.best_of if req.HasField("best_of") else n
    c.check(best_of >= n, "best_of", f"must be >= n ({n}), got {best_of}")
    c.check(not (req.stream and best_of > n), "best_of",
            f"best_of > n ({best_of} > {n}) cannot be streamed: the best are known only when all have finished")
    logprobs = req.logprobs if req.HasField("logprobs") else None
    c.check(logprobs is None or 0 <= logprobs <= validation.MAX_TOP_LOGPROBS, "logprobs",
            f"must be in [0, {validation.MAX_TOP_LOGPROBS}], got {logprobs}")
    output = _output_options(c, req)
    constraint = _constraint(c, req)
    c.raise_if_any()
    return CompletionOptions(n=n, best_of=best_of, echo=req.echo, logprobs=logprobs, suffix=req.suffix,
                             constraint=constraint, output=output)


def check_prompt(ids: list[int], field: str, info: ModelInfo, req: OpenAIRequest) -> None:
    c = Collector()
    validation.check_prompt_ids(c, ids, field, info)
    validation.check_routed_start(c, req, len(ids))
    c.raise_if_any()


# ---- chat --------------------------------------------------------------------------------------------------------


def chat_options(req: openai_pb2.ChatCompleteRequest, template_parameters: frozenset[str]) -> ChatOptions:
    """Every check of a chat request but the template's own (rendering errors name `messages`).
    template_parameters: names chat_template_kwargs may not use (the renderer's own parameters)."""
    c = Collector()
    c.check(len(req.messages) > 0, "messages", "must not be empty")
    for i, message in enumerate(req.messages):
        _check_message(c, f"messages[{i}]", message)
    n = _n(c, req)
    c.check(not (req.HasField("max_tokens") and req.HasField("max_completion_tokens")), "max_completion_tokens",
            "give max_completion_tokens or max_tokens, not both")
    top = req.top_logprobs if req.HasField("top_logprobs") else None
    c.check(top is None or 0 <= top <= validation.MAX_TOP_LOGPROBS, "top_logprobs",
            f"must be in [0, {validation.MAX_TOP_LOGPROBS}], got {top}")
    c.check(top is None or req.logprobs, "top_logprobs", "only with logprobs")
    continue_final = req.continue_final_message
    add_prompt = req.add_generation_prompt if req.HasField("add_generation_prompt") else not continue_final
    c.check(not (add_prompt and continue_final), "continue_final_message",
            "not with add_generation_prompt: the prompt either opens a new assistant message or continues the last")
    c.check(not continue_final or (len(req.messages) > 0 and req.messages[-1].role == "assistant"),
            "continue_final_message", "the last message must be an assistant message to continue")
    kwargs = struct_dict(req.chat_template_kwargs) if req.HasField("chat_template_kwargs") else {}
    clash = sorted(set(kwargs) & template_parameters)
    c.check(not clash, "chat_template_kwargs", f"may not set the renderer's own parameters {clash}")
    tools = tuple(_tool(c, f"tools[{i}]", t) for i, t in enumerate(req.tools))
    names = [t.name for t in tools]
    c.check(len(set(names)) == len(names), "tools", "function names must be distinct")
    mode, tool_name = _tool_choice(c, req.tool_choice if req.HasField("tool_choice") else None, names)
    constraint = _constraint(c, req)
    c.check(mode == "none" or constraint is None, "tool_choice",
            f'tool calls (tool_choice "{mode}") and {constraint.field if constraint else ""} cannot both constrain '
            'the output; set tool_choice "none" or drop the constraint')
    output = _output_options(c, req)
    c.raise_if_any()
    return ChatOptions(
        n=n, logprobs=(top or 0) if req.logprobs else None, tools=tools if mode != "none" else (), tool_mode=mode,
        tool_name=tool_name, add_generation_prompt=add_prompt, continue_final_message=continue_final,
        parallel_tool_calls=req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True,
        template_kwargs=kwargs, constraint=constraint, output=output,
    )


def chat_media_items(req: openai_pb2.ChatCompleteRequest) -> list[WireItem]:
    """The conversation's image_url and input_audio parts as media items, in message order (checked by
    chat_options); input_audio's base64 becomes a data: URI, read as any other."""
    items: list[WireItem] = []
    for i, message in enumerate(req.messages):
        for j, part in enumerate(message.content_parts):
            at = f"messages[{i}].content_parts[{j}]"
            if part.type == "image_url":
                items.append(WireItem(Modality.IMAGE, at, generate_pb2.MediaItem(url=part.image_url.url)))
            elif part.type == "input_audio":
                uri = f"data:audio/{part.input_audio.format};base64,{part.input_audio.data}"
                items.append(WireItem(Modality.AUDIO, at, generate_pb2.MediaItem(url=uri)))
    return items


def chat_max_tokens(req: openai_pb2.ChatCompleteRequest, info: ModelInfo) -> tuple[int, str]:
    """(max tokens, the field that set it); unset: the whole context (resolve_sampling caps it to what is left)."""
    if req.HasField("max_completion_tokens"):
        return req.max_completion_tokens, "max_completion_tokens"
    if req.HasField("max_tokens"):
        return req.max_tokens, "max_tokens"
    return info.max_context_length, "max_completion_tokens"


def _check_message(c: Collector, at: str, m: openai_pb2.ChatMessage) -> None:
    c.check(m.role in ROLES, f"{at}.role", f"must be one of {', '.join(ROLES)}, got {m.role!r}")
    c.check(not (m.HasField("content") and m.content_parts), f"{at}.content_parts", "not with content")
    for j, part in enumerate(m.content_parts):
        where = f"{at}.content_parts[{j}]"
        c.check(part.type in PART_TYPES, f"{where}.type",
                f'must be "text", "image_url" or "input_audio", got {part.type!r}')
        if part.type == "image_url":
            c.check(bool(part.image_url.url), f"{where}.image_url.url", "required for an image_url part")
        if part.type == "input_audio":
            c.check(bool(part.input_audio.data), f"{where}.input_audio.data", "required for an input_audio part")
            c.check(part.input_audio.format in AUDIO_FORMATS, f"{where}.input_audio.format",
                    f'must be "wav", "mp3" or "flac", got {part.input_audio.format!r}')
    c.check(not m.tool_calls or m.role == "assistant", f"{at}.tool_calls", "only in assistant messages")
    for j, call in enumerate(m.tool_calls):
        where = f"{at}.tool_calls[{j}]"
        c.check(call.type in ("", "function"), f"{where}.type", f'must be "function", got {call.type!r}')
        c.check(bool(call.function.name), f"{where}.function.name", "must not be empty")
        c.check(_json_object(call.function.arguments or "{}"), f"{where}.function.arguments",
                "must be a JSON object (as text)")
    if m.role == "tool":
        c.check(bool(m.tool_call_id), f"{at}.tool_call_id", "required in tool messages")
    else:
        c.check(not m.tool_call_id, f"{at}.tool_call_id", "only in tool messages")


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _tool(c: Collector, at: str, tool: openai_pb2.Tool) -> ToolSpec:
    c.check(tool.type in ("", "function"), f"{at}.type", f'must be "function", got {tool.type!r}')
    name = tool.function.name
    c.check(TOOL_NAME.fullmatch(name) is not None, f"{at}.function.name",
            f"must match [a-zA-Z0-9_-]{{1,64}}, got {name!r}")
    parameters: dict[str, Any] = (
        struct_dict(tool.function.parameters) if tool.function.HasField("parameters")
        else {"type": "object", "properties": {}}
    )
    return ToolSpec(name=name, description=tool.function.description, parameters=parameters)


def _tool_choice(c: Collector, choice: openai_pb2.ToolChoice | None, names: list[str]) -> tuple[ToolMode, str | None]:
    if choice is None or not choice.type:
        return ("auto" if names else "none"), None
    modes: dict[str, ToolMode] = {"none": "none", "auto": "auto", "required": "required", "function": "function"}
    kind = modes.get(choice.type)
    if kind is None:
        c.check(False, "tool_choice.type", f'must be "none", "auto", "required" or "function", got {choice.type!r}')
        return "none", None
    c.check(kind == "none" or bool(names), "tool_choice", f'"{kind}" needs tools')
    if kind != "function":
        return kind, None
    name = choice.function.name
    c.check(name in names, "tool_choice.function.name", f"must name one of the tools {names}, got {name!r}")
    return "function", name
