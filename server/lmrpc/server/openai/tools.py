"""Tool calls: the constraints that make the model call tools, the prompt that tells it about them when its chat
template does not, and the parsing of its output into calls.

- tool_choice "function": the output is the arguments of that function (its parameters' JSON schema).
- "required": the output is a JSON list of one or more calls, [{"name": ..., "arguments": {...}}, ...], each
  valid for its function's schema.
- "auto": free text in which the Hermes tool-call format, <tool_call>\\n{"name": ..., "arguments": ...}\\n
  </tool_call>, is enforced by a structural tag once the model starts it; `HermesParser` splits such output into
  content and calls, incrementally, so that streamed and merged answers agree.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lmrpc.server.openai.validation import ToolMode, ToolSpec

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    """One function call read from the model's output."""

    id: str  # "call_" + 24 hex digits, fresh for each call
    name: str  # the function's name
    arguments: str  # its arguments, JSON text of an object (json.dumps' layout)


def new_call(name: str, arguments: Any) -> ParsedCall:
    return ParsedCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))


# ---- constraints -----------------------------------------------------------------------------------------------


def named_schema(tool: ToolSpec) -> str:
    """tool_choice "function": the output is the function's arguments."""
    return json.dumps(dict(tool.parameters))


def required_schema(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """tool_choice "required": a non-empty JSON list of calls of the given tools (of one call unless parallel)."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def hermes_structural_tag(tools: Sequence[ToolSpec]) -> str:
    """tool_choice "auto": once the output holds <tool_call>, it must go on into a call of one of the tools."""
    structures = [{"begin": f'{CALL_BEGIN}\n{{"name": {json.dumps(t.name)}, "arguments": ',
                   "schema": dict(t.parameters), "end": f"}}\n{CALL_END}"} for t in tools]
    return json.dumps({"type": "structural_tag", "triggers": [CALL_BEGIN], "structures": structures})


# ---- the prompt, for templates that do not render tools --------------------------------------------------------


def hermes_system_prompt(tools: Sequence[ToolSpec]) -> str:
    """Tells the model which functions exist and how to call them (Hermes format), for a template that ignores
    the request's tools."""
    described = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": dict(t.parameters)}}, ensure_ascii=False)
        for t in tools)
    return ("You can call functions to answer the user. They are described, as JSON schemas, between <tools> and "
            f"</tools>:\n<tools>\n{described}\n</tools>\nTo call one, write its name and arguments as a JSON "
            f'object between {CALL_BEGIN} and {CALL_END}:\n{CALL_BEGIN}\n{{"name": <function name>, "arguments": '
            f"<arguments object>}}\n{CALL_END}")


def hermes_call_text(name: str, arguments: str) -> str:
    """A past call, written in the Hermes format (for a template that ignores messages' tool_calls)."""
    return f'{CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}\n{CALL_END}'


# ---- parsing -----------------------------------------------------------------------------------------------------


def parse_named(name: str, text: str) -> list[ParsedCall] | None:
    """The output of tool_choice "function" as its one call; None if it is not a JSON object (cut short)."""
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [new_call(name, arguments)] if isinstance(arguments, dict) else None


def parse_required(text: str) -> list[ParsedCall] | None:
    """The output of tool_choice "required" as its calls; None if it is not a complete list of calls."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list) or not calls:
        return None
    parsed: list[ParsedCall] = []
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"),
                                                                                              dict)):
            return None
        parsed.append(new_call(call["name"], call["arguments"]))
    return parsed


@dataclass(frozen=True)
class Piece:
    """What the parser can say about the output so far: content, calls, or both."""

    content: str = ""  # text to show as content ("" none)
    calls: tuple[ParsedCall, ...] = ()  # calls completed by this piece


class CallParser(Protocol):
    """Reads one choice's output text, delta by delta, into content and calls."""

    @property
    def called(self) -> bool:
        """At least one call was read."""
        ...

    def feed(self, text: str) -> Piece:
        """The next text delta; returns what is decided."""
        ...

    def finish(self) -> Piece:
        """The output ended; returns the rest."""
        ...


def parser_for(mode: ToolMode, function: str | None) -> CallParser:
    if mode == "auto":
        return HermesParser()
    if mode in ("required", "function"):
        return JsonCallParser(function)
    return PlainParser()


class PlainParser:
    """No tools: all output is content."""

    called = False

    def feed(self, text: str) -> Piece:
        return Piece(text)

    def finish(self) -> Piece:
        return Piece()


class JsonCallParser:
    """tool_choice "function" or "required": the output is JSON for the call(s), read once it is complete. Output
    that is not (cut short by max_tokens) is content."""

    def __init__(self, function: str | None) -> None:
        self._function = function  # the named function; None: "required", the output names its calls
        self._text: list[str] = []
        self.called = False

    def feed(self, text: str) -> Piece:
        self._text.append(text)
        return Piece()

    def finish(self) -> Piece:
        text = "".join(self._text)
        calls = parse_required(text) if self._function is None else parse_named(self._function, text)
        if calls is None:
            return Piece(text)
        self.called = True
        return Piece(calls=tuple(calls))


class HermesParser:
    """Splits output text into content and <tool_call> calls as it arrives.

    Content is held back while it may still be the beginning of <tool_call>, and so is trailing whitespace (dropped
    when a call follows it, or when the output ends after a call). Feeding the whole text at once gives the same
    pieces, concatenated, as feeding it in deltas.
    """

    def __init__(self) -> None:
        self._buffer = ""  # text not decided yet
        self._inside = False  # between <tool_call> and </tool_call>
        self._layout = ""  # whitespace before the current call: dropped if it is a call, shown if not
        self._calls = 0  # calls completed so far

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> Piece:
        self._buffer += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self._inside:
                end = self._buffer.find(CALL_END)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_END):]
                self._inside = False
                call = _hermes_call(body)
                if call is None:  # not a call after all (possible only without the structural tag): show it
                    content.append(self._layout + CALL_BEGIN + body + CALL_END)
                else:
                    calls.append(call)
                    self._calls += 1
                self._layout = ""
                continue
            begin = self._buffer.find(CALL_BEGIN)
            if begin < 0:
                safe = _undecided_from(self._buffer)
                content.append(self._buffer[:safe])
                self._buffer = self._buffer[safe:]
                break
            before = self._buffer[:begin]
            content.append(before.rstrip())  # whitespace before a call is layout, not content
            self._layout = before[len(before.rstrip()):]
            self._buffer = self._buffer[begin + len(CALL_BEGIN):]
            self._inside = True
        return Piece("".join(content), tuple(calls))

    def finish(self) -> Piece:
        """The end of the output: what is still held back is content, except whitespace after the last call. A
        call whose JSON is complete counts even without its end tag (generation stopped at </tool_call>, as
        it does for one call only); an unfinished one shows as text."""
        if self._inside:
            call = _hermes_call(self._buffer)
            if call is not None:
                self._buffer, self._inside, self._layout = "", False, ""
                self._calls += 1
                return Piece(calls=(call,))
        rest = (self._layout + CALL_BEGIN if self._inside else "") + self._buffer
        self._buffer, self._inside, self._layout = "", False, ""
        if self._calls and not rest.strip():
            return Piece()
        return Piece(rest)


def _undecided_from(text: str) -> int:
    """Where the undecided tail of content starts: trailing whitespace, and a suffix that may begin <tool_call>."""
    cut = len(text)
    for k in range(min(len(CALL_BEGIN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_BEGIN[:k]):
            cut = len(text) - k
            break
    head = text[:cut]
    return len(head.rstrip())


def _hermes_call(body: str) -> ParsedCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    arguments = call.get("arguments", {})
    return new_call(call["name"], arguments) if isinstance(arguments, dict) else None
