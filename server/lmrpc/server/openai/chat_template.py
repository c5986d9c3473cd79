"""Chat templates: a conversation (ChatMessage list) rendered into the model's prompt text.

The template is the tokenizer's (tokenizer_config.json's chat_template, or a GGUF's), unless the server was started
with --chat-template FILE. Rendering is transformers' own apply_chat_template (the sandboxed Jinja environment and
helpers every template is written against), so a prompt is exactly what the tokenizer would make of the same
messages. Tools are handed to the template; a template that does not render them gets them described in a system
message in the Hermes format instead (see tools.py), so that the model knows what it may call.

Content parts: a template that renders content given as a list of parts (as multimodal models' templates do, like
Qwen2-VL's) gets every message sent as parts as that list, the shape transformers' apply_chat_template takes:
{"type": "text", "text": ...}, and {"type": "image"} / {"type": "audio"} where a media part stands, whose placeholder
the template writes itself; so a prompt is the one transformers renders from the same messages. A template that
renders content as a string only (SmolLM2's) gets the text parts joined, each media part as the model's placeholder
text (the processor's `placeholders`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import jinja2
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from lmrpc.server import statuses
from lmrpc.server.openai import tools as tool_calls
from lmrpc.server.openai.validation import ToolSpec
from lmrpc.v1 import openai_pb2

Message = dict[str, Any]  # one message as templates read it: OpenAI's JSON form
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio"}  # content part type -> the part templates read
_PROBE = "\x1flmrpc-probe\x1f"  # text no conversation holds: finds whether a template renders content lists
# Names chat_template_kwargs may not use: apply_chat_template's own parameters.
# "messages" is what transformers hands the template the conversation as.
RESERVED_KWARGS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self", "kwargs"} | {"messages"}


@dataclass(frozen=True)
class Rendered:
    """A conversation rendered for the model."""

    text: str  # the prompt text (special tokens spelled out, as the template writes them)
    tool_format_known: bool  # the model's tool-call format is Hermes' (the template's, or the one we described)


def compile_error(source: str) -> str | None:
    """Why a template does not compile as transformers compiles it at each render ("message (line n)"), or None: a
    broken template is found once (at start for --chat-template's file), not at every chat call."""
    try:
        _compile_jinja_template(source)
    except jinja2.TemplateSyntaxError as e:
        return f"{e.message} (line {e.lineno})"
    return None


class ChatTemplate:
    """The server's chat template: the override's text, else the tokenizer's; None when it has none."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, override: str | None = None) -> None:
        self._tokenizer = tokenizer
        source = override if override is not None else getattr(tokenizer, "chat_template", None)
        # A tokenizer may carry several named templates; "default" is the one a plain render uses.
        if isinstance(source, Mapping):
            source = source.get("default")
        self.source: str | None = source if isinstance(source, str) and source.strip() else None
        self._renders_parts: bool | None = None  # whether the template renders content lists (probed once)
        # Why the template cannot be used though there is one (it does not compile); None when it can.
        error = None if self.source is None else compile_error(self.source)
        self.unusable: str | None = None if error is None else f"the chat template does not compile: {error}"

    def renders_parts(self) -> bool:
        """Whether the template renders a message whose content is a list of parts (text parts' text written, not
        the list's repr). Probed once with one text part (blocking)."""
        if self._renders_parts is None:
            probe: list[Message] = [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
            try:
                text = self._tokenizer.apply_chat_template(probe, chat_template=self.require(), tokenize=False)
            except (jinja2.TemplateError, ValueError, TypeError):
                text = ""
            self._renders_parts = isinstance(text, str) and _PROBE in text and "'text'" not in text \
                and '"text"' not in text
        return self._renders_parts

    def require(self) -> str:
        if self.unusable is not None:  # --chat-template's own file is checked at start: this is the tokenizer's
            raise statuses.RequestError(grpc.StatusCode.FAILED_PRECONDITION, [statuses.Violation(
                "chat_template", f"{self.unusable}; start the server with a --chat-template FILE that does")])
        if self.source is None:
            raise statuses.RequestError(grpc.StatusCode.FAILED_PRECONDITION, [statuses.Violation(
                "chat_template", "the model has no chat template (tokenizer_config.json has no chat_template); "
                                 "start the server with --chat-template FILE")])
        return self.source

    def render(self, messages: Sequence[openai_pb2.ChatMessage], tools: Sequence[ToolSpec], *,
               add_generation_prompt: bool, continue_final_message: bool,
               template_kwargs: Mapping[str, Any], placeholders: Mapping[str, str] | None = None) -> Rendered:
        """Render the conversation (blocking: call it off the event loop). A template error is INVALID_ARGUMENT
        naming messages, with the template's message. placeholders: the model's placeholder text per media part
        type ("image_url", "input_audio"), for a template that renders content as a string only; such a template
        and a conversation with a media part the model names no placeholder for: FAILED_PRECONDITION."""
        source = self.require()
        used = {p.type for m in messages for p in m.content_parts if p.type in MEDIA_PARTS}
        as_parts = any(m.content_parts for m in messages) and self.renders_parts()
        as_text: Mapping[str, str] | None = None
        if used and not as_parts:
            missing = sorted(used - set(placeholders or {}))
            if missing:
                raise statuses.RequestError(grpc.StatusCode.FAILED_PRECONDITION, [statuses.Violation(
                    "chat_template", f"the chat template renders message content as text only and the model names "
                                     f"no placeholder text for {' or '.join(missing)} parts; start the server with a "
                                     "--chat-template that renders content lists")])
            as_text = placeholders
        conversation = [template_message(m, as_text, as_parts=as_parts) for m in messages]
        tool_dicts: list[dict[Any, Any] | Callable[..., Any]] | None = [_tool_dict(t) for t in tools] or None

        def run(conv: list[Message], with_tools: list[dict[Any, Any] | Callable[..., Any]] | None) -> str:
            text = self._tokenizer.apply_chat_template(
                conv, tools=with_tools, chat_template=source, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, **template_kwargs)
            assert isinstance(text, str)
            return text

        try:
            if tool_dicts is None:
                return Rendered(run(conversation, None), tool_format_known=False)
            text = run(conversation, tool_dicts)
            if text != run(conversation, None):  # the template renders tools itself
                return Rendered(text, tool_format_known=tool_calls.CALL_BEGIN in source)
            described = described_tools(messages, tools, as_text, as_parts=as_parts)
            return Rendered(run(described, None), tool_format_known=True)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            # What a template (or transformers around it) raises on a conversation it cannot render: the template's
            # raise_exception(...) and undefined names are TemplateErrors, str + None in it a TypeError, and
            # transformers' checks (continue_final_message) ValueErrors.
            raise statuses.invalid("messages", f"the chat template cannot render them: {exc}") from exc


def template_message(m: openai_pb2.ChatMessage, placeholders: Mapping[str, str] | None = None, *,
                     as_parts: bool = False) -> Message:
    """A message in OpenAI's JSON form, as templates expect it, tool calls' arguments as objects (templates write them
    with tojson). Content given as parts: with as_parts, a list of parts ({"type": "text", "text": ...}, {"type":
    "image"}, {"type": "audio"}) for a template that renders lists; else a string, text parts joined with "\\n" and
    each media part as its `placeholders` text (part type -> the model's placeholder text)."""
    content: str | list[dict[str, str]]
    if m.HasField("content") or not m.content_parts:
        content = m.content
    elif as_parts:
        content = [{"type": MEDIA_PARTS[p.type]} if p.type in MEDIA_PARTS else {"type": "text", "text": p.text}
                   for p in m.content_parts]
    else:
        assert placeholders is not None or not any(p.type in MEDIA_PARTS for p in m.content_parts)
        content = "\n".join(placeholders[p.type] if placeholders is not None and p.type in MEDIA_PARTS else p.text
                            for p in m.content_parts)
    message: Message = {"role": m.role, "content": content}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments or "{}")}}
            for c in m.tool_calls]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def _append_text(message: Message, text: str, separator: str) -> None:
    """text after the message's content (after `separator` where it has some): a string's, or a text part of its own
    at the end of a list of parts."""
    content = message["content"]
    if isinstance(content, list):
        content.append({"type": "text", "text": f"{separator}{text}" if content else text})
    else:
        message["content"] = f"{content}{separator}{text}" if content else text


def described_tools(messages: Sequence[openai_pb2.ChatMessage], tools: Sequence[ToolSpec],
                    placeholders: Mapping[str, str] | None = None, *, as_parts: bool = False) -> list[Message]:
    """The conversation for a template that ignores tools: the tools described in the system message (appended to
    the first one, or a new one first), and past calls written into their messages' content in the same format."""
    prompt = tool_calls.hermes_system_prompt(tools)
    conversation = [template_message(m, placeholders, as_parts=as_parts) for m in messages]
    for message, m in zip(conversation, messages, strict=True):
        if m.tool_calls:
            calls = "\n".join(tool_calls.hermes_call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            _append_text(message, calls, "\n")
            del message["tool_calls"]
    if conversation and conversation[0]["role"] == "system":
        _append_text(conversation[0], prompt, "\n\n")
    else:
        conversation.insert(0, {"role": "system", "content": prompt})
    return conversation


def _tool_dict(tool: ToolSpec) -> Message:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": dict(tool.parameters)}}
