"""SGLang's structural tag ({"type": "structural_tag", "structures": [...], "triggers": [...]}): parsed and checked
against the grammar limits, then translated into a Lark grammar for llguidance: free text with lazily matched
triggers, each forcing one of its structures (`begin`, a JSON value of the structure's schema, `end`) before free
text resumes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from lmrpc.server.engine.grammar_limits import TAG_LEVELS, GrammarError, GrammarLimits

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# How limit errors name a structural tag's schemas: one too deep, all of them with too many $ref targets.
_SCHEMA, _WHOLE = "a schema of the structural tag", "the structural tag"


@dataclass(frozen=True)
class TagStructure:
    """One structure of a structural tag: the output holds `begin`, then JSON valid for `schema`, then `end`."""

    begin: str  # starts with one of the tag's triggers, e.g. "<function=get_weather>"
    schema: str  # the JSON schema of what comes between begin and end, as JSON text
    end: str  # e.g. "</function>"; may be empty


@dataclass(frozen=True)
class StructuralTag:
    """SGLang's structural tag: {"type": "structural_tag", "structures": [...], "triggers": [...]}."""

    structures: tuple[TagStructure, ...]
    triggers: tuple[str, ...]  # text that, once generated, must continue into a structure whose begin it starts


def parse_structural_tag(text: str, limits: GrammarLimits | None = None) -> StructuralTag:
    """The structural tag in `text` (JSON), within `limits` (default GrammarLimits()); raises GrammarError naming
    what is wrong."""
    limits = limits or GrammarLimits()

    def fail(message: str) -> GrammarError:
        return GrammarError("structural_tag", message)

    too_big = tag_limit_error(text, limits)  # before json.loads recurses
    if too_big:
        raise fail(too_big)
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(f"not valid JSON: {exc}") from exc
    if not isinstance(spec, dict):
        raise fail(f"expected a JSON object, got {type(spec).__name__}")
    kind = spec.get("type", "structural_tag")  # SGLang's native parameter omits it; response_format carries it
    if kind != "structural_tag":
        raise fail(f'"type" must be "structural_tag", got {kind!r}')
    if "format" in spec:
        raise fail('the "format" form is not supported; give "structures" and "triggers"')
    unknown = sorted(set(spec) - {"type", "structures", "triggers"})
    if unknown:
        raise fail(f"unknown key(s) {', '.join(map(repr, unknown))}")
    raw_triggers = spec.get("triggers")
    if not isinstance(raw_triggers, list) or not raw_triggers:
        raise fail('"triggers" must be a non-empty list of strings')
    if not all(isinstance(t, str) and t for t in raw_triggers):
        raise fail('"triggers" must hold non-empty strings')
    triggers = tuple(dict.fromkeys(cast("list[str]", raw_triggers)))
    raw_structures = spec.get("structures")
    if not isinstance(raw_structures, list) or not raw_structures:
        raise fail('"structures" must be a non-empty list of {"begin", "schema", "end"} objects')
    structures = tuple(_parse_structure(i, s, triggers, limits) for i, s in enumerate(raw_structures))
    # All schemas together (one list level added), which also sees the schemas given as JSON text.
    too_big = limits.json_error(f"[{','.join(s.schema for s in structures)}]", _SCHEMA, 1, _WHOLE)
    if too_big:
        raise fail(too_big)
    for trigger in triggers:
        # A trigger no structure continues would forbid that text outright: surely a mistake in the request.
        if not any(s.begin.startswith(trigger) for s in structures):
            raise fail(f"trigger {trigger!r} starts no structure's begin")
    return StructuralTag(structures, triggers)


def tag_limit_error(text: str, limits: GrammarLimits) -> str | None:
    """Why a structural tag's text is past the limits (its schemas' depth, their $ref targets), or None; no parse."""
    return limits.json_error(text, _SCHEMA, TAG_LEVELS, _WHOLE)


def _check_special_placement(tag: StructuralTag, special_tokens: Mapping[str, int]) -> None:
    """A text trigger is matched as one lazy lexeme, and a lexeme cannot hold a special token: a trigger may start
    with a special token but not contain one after text."""
    for trigger in tag.triggers:
        if any(trigger.startswith(name) for name in special_tokens):
            continue
        inner = next((name for name in special_tokens if name in trigger), None)
        if inner is not None:
            raise GrammarError("structural_tag", f"trigger {trigger!r} holds the special token {inner!r} after "
                                                 "text; a trigger may only start with a special token")


def _parse_structure(index: int, raw: object, triggers: tuple[str, ...], limits: GrammarLimits) -> TagStructure:
    where = f"structures[{index}]"
    if not isinstance(raw, dict):
        raise GrammarError("structural_tag", f"{where} must be an object with begin, schema and end")
    begin, schema, end = raw.get("begin"), raw.get("schema"), raw.get("end")
    if not isinstance(begin, str) or not begin:
        raise GrammarError("structural_tag", f'{where}.begin must be a non-empty string')
    if not isinstance(end, str):
        raise GrammarError("structural_tag", f'{where}.end must be a string')
    if isinstance(schema, str):  # a schema sent as JSON text, as json_schema takes it
        too_big = limits.json_error(schema, f"{where}.schema")  # before json.loads recurses
        if too_big:
            raise GrammarError("structural_tag", too_big)
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError("structural_tag", f"{where}.schema is not valid JSON: {exc}") from exc
    if schema is False:
        raise GrammarError("structural_tag", f"{where}.schema is false: nothing matches it")
    if schema is True:
        schema = {}  # the same schema (anything), in the object form %json takes
    if not isinstance(schema, dict):
        raise GrammarError("structural_tag", f"{where}.schema must be a JSON schema (an object)")
    if not any(begin.startswith(t) for t in triggers):
        raise GrammarError("structural_tag", f"{where}.begin {begin!r} starts with none of the triggers")
    return TagStructure(begin=begin, schema=json.dumps(schema, ensure_ascii=False), end=end)


def structural_tag_lark(tag: StructuralTag, json_options: JsonCompileOptions | None,
                        special_tokens: Mapping[str, int]) -> str:
    """A Lark grammar for `tag`: any text; a trigger in it must go on into one of the structures it starts, then
    any text again (any number of calls, none required).

    A text trigger is a lazy lexeme (free text up to the first occurrence of the trigger). A trigger that starts
    with a special token of the tokenizer (e.g. <|python_tag|>) is matched as that token: free text never contains
    special tokens, so no laziness is needed, and a model emits such a trigger as the single token, not spelled out.
    `json_options` (whitespace layout) go into each schema's "x-guidance", which %json honours.
    """
    _check_special_placement(tag, special_tokens)
    lines = [
        "%llguidance {}",
        "start: call* TEXT",
        r"TEXT: /(.|\n)*/",
    ]
    calls: list[str] = []
    for i, trigger in enumerate(tag.triggers):
        bodies = []
        for s in tag.structures:
            if not s.begin.startswith(trigger):
                continue
            schema = json.loads(s.schema)  # an object: _parse_structure made sure
            if json_options is not None:  # the request's option beats the schema's own, as for json_schema
                own = schema.get("x-guidance")
                schema = {**schema, "x-guidance": {**(own if isinstance(own, dict) else {}), **json_options}}
            parts = [_lark_text(s.begin[len(trigger):], special_tokens), "%json " + json.dumps(schema),
                     _lark_text(s.end, special_tokens)]
            bodies.append(" ".join(p for p in parts if p))
        if any(trigger.startswith(name) for name in special_tokens):
            head = f"TEXT {_lark_text(trigger, special_tokens)}"
        else:
            lines.append(f"trigger_{i}[lazy]: TEXT {_lark_string(trigger)}")
            head = f"trigger_{i}"
        lines.append(f"call_{i}: {head} ({' | '.join(bodies)})")
        calls.append(f"call_{i}")
    lines.append(f"call: {' | '.join(calls)}")
    return "\n".join(lines) + "\n"


def _lark_string(text: str) -> str:
    # A JSON string literal is a valid Lark string literal (same escapes); keep non-ASCII as is.
    return json.dumps(text, ensure_ascii=False)


def _lark_text(text: str, special_tokens: Mapping[str, int]) -> str:
    """Lark for a literal: plain text as strings, special tokens inside it as token references."""
    out: list[str] = []
    rest = text
    while rest:
        hits = [(rest.find(name), name) for name in special_tokens if name in rest]
        if not hits:
            out.append(_lark_string(rest))
            break
        at, name = min(hits, key=lambda h: (h[0], -len(h[1])))
        if at:
            out.append(_lark_string(rest[:at]))
        out.append(f"<[{special_tokens[name]}]>")
        rest = rest[at + len(name):]
    return " ".join(out)
