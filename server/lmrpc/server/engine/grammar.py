"""Structured output with llguidance: compile constraints (cached), fill token bitmasks in one batched call while
the model runs (MaskFiller), advance matchers with sampled tokens. Masks are applied to the logits by the sampler
(lmrpc.kernels.sampling.apply_bitmask, plain torch).

json_schema, regex and ebnf go to llguidance's own front ends (a regex as a one-rule Lark grammar). A
structural_tag (SGLang's format, below) is translated here into a Lark grammar: free text with lazily matched
triggers, each forcing one of its structures (`begin`, a JSON value of the structure's schema, `end`) before free
text resumes.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

from lmrpc.server.protocol import Constraint, ConstraintKind

_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped
# A regex's \d and \w are ASCII ([0-9], [0-9a-zA-Z_]), as in JSON-schema patterns, xgrammar and Outlines: left
# Unicode, "\d{3}" lets a model write digits from any script (it does: U+1FBF8 SEGMENTED DIGIT EIGHT).
_REGEX_ASCII_CLASSES = "dw"

# json_whitespace_flexible=False: exactly json.dumps' default layout (", " and ": ", nothing else), what xgrammar
# produces without any_whitespace. llguidance's own rigid mode (",", ":") is a layout models rarely saw in training.
_RIGID_JSON: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FLEXIBLE_JSON: JsonCompileOptions = {"whitespace_flexible": True}


class GrammarError(ValueError):
    """A constraint that does not compile; the message names the kind and carries the compiler's error."""

    def __init__(self, kind: ConstraintKind, message: str) -> None:
        super().__init__(f"invalid {kind}: {message}")
        self.kind = kind
        self.message = message


class GrammarMatcher:
    """One request's grammar state."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def advance(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)

    def allows(self, token_id: int) -> bool:
        """Whether the grammar accepts this token next (its state unchanged)."""
        return bool(self.matcher.validate_tokens([token_id]) == 1)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete (it accepted EOS or cannot be extended)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self.matcher.get_error()) if self.matcher.is_error() else None

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self.matcher.deep_copy())


# ---- structural tags -------------------------------------------------------------------------------------------


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


def parse_structural_tag(text: str) -> StructuralTag:
    """The structural tag in `text` (JSON); raises GrammarError naming what is wrong."""

    def fail(message: str) -> GrammarError:
        return GrammarError("structural_tag", message)

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
    structures = tuple(_parse_structure(i, s, triggers) for i, s in enumerate(raw_structures))
    for trigger in triggers:
        # A trigger no structure continues would forbid that text outright: surely a mistake in the request.
        if not any(s.begin.startswith(trigger) for s in structures):
            raise fail(f"trigger {trigger!r} starts no structure's begin")
    return StructuralTag(structures, triggers)


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


def _parse_structure(index: int, raw: object, triggers: tuple[str, ...]) -> TagStructure:
    where = f"structures[{index}]"
    if not isinstance(raw, dict):
        raise GrammarError("structural_tag", f"{where} must be an object with begin, schema and end")
    begin, schema, end = raw.get("begin"), raw.get("schema"), raw.get("end")
    if not isinstance(begin, str) or not begin:
        raise GrammarError("structural_tag", f'{where}.begin must be a non-empty string')
    if not isinstance(end, str):
        raise GrammarError("structural_tag", f'{where}.end must be a string')
    if isinstance(schema, str):  # a schema sent as JSON text, as json_schema takes it
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


# ---- the backend -----------------------------------------------------------------------------------------------


class GrammarBackend:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(cast("TokenizersBackend", tokenizer), n_vocab=vocab_size)
        self._executor = llguidance.LLExecutor()
        self._compiled: OrderedDict[tuple[str, str, bool | None], str] = OrderedDict()
        self._lock = threading.Lock()  # compile runs on service threads, matchers on the engine thread
        # Tokens llguidance treats as special (never part of free text): a structural tag names them as tokens.
        self._special_tokens = {
            text: token_id for text, token_id in tokenizer.get_added_vocab().items()
            if 0 <= token_id < vocab_size and self._tokenizer.is_special_token(token_id)
        }

    def compile(self, constraint: Constraint) -> str:
        """The llguidance grammar of a constraint (cached by kind, text and options); raises GrammarError."""
        key = (constraint.kind, constraint.text, constraint.json_whitespace_flexible)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        grammar = self._translate(constraint)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(constraint.kind, str(error))
        with self._lock:
            self._compiled[key] = grammar
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    def _translate(self, constraint: Constraint) -> str:
        """The constraint as an (unvalidated) llguidance grammar."""
        kind = constraint.kind
        flexible = constraint.json_whitespace_flexible
        json_options = None if flexible is None else _FLEXIBLE_JSON if flexible else _RIGID_JSON
        if kind == "json_schema":
            try:
                schema = json.loads(constraint.text)
            except json.JSONDecodeError as exc:
                raise GrammarError(kind, f"not valid JSON: {exc}") from exc
            if schema is False:
                raise GrammarError(kind, "the schema is false: nothing matches it")
            if schema is True:
                schema = {}  # the same schema (anything), in the object form llguidance applies options to
            if not isinstance(schema, dict):
                raise GrammarError(kind, f"a JSON schema is an object, got {type(schema).__name__}")
            try:
                # overrides: an explicit request option beats the schema's own "x-guidance"
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_options)
            except ValueError as exc:
                raise GrammarError(kind, str(exc)) from exc
        if kind == "structural_tag":
            tag = parse_structural_tag(constraint.text)
            return llguidance.grammar_from("lark", structural_tag_lark(tag, json_options, self._special_tokens))
        if kind == "regex":
            text = constraint.text
            if (len(text) - len(text.rstrip("\\"))) % 2:  # regex_to_lark would silently drop it
                raise GrammarError(kind, "incomplete escape sequence: the pattern ends with a lone backslash")
            pattern = llguidance.regex_to_lark(text, _REGEX_ASCII_CLASSES)
            return llguidance.grammar_from("lark", f"start: /{pattern}/")
        try:
            return llguidance.grammar_from("ebnf", constraint.text)  # GBNF (`root ::= ...`) or Lark
        except ValueError as exc:
            raise GrammarError(kind, str(exc)) from exc

    def check(self, constraint: Constraint) -> str | None:
        try:
            self.compile(constraint)
        except GrammarError as exc:
            return str(exc)
        return None

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (a byte-level token may hold part of a UTF-8 character); special tokens as their
        text. Thread-safe (llguidance's tokenizer is immutable)."""
        return bytes(self._tokenizer.decode_bytes([token_id]))

    def new_matcher(self, constraint: Constraint) -> GrammarMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, self.compile(constraint))
        if matcher.is_error():
            raise GrammarError(constraint.kind, str(matcher.get_error()))
        return GrammarMatcher(matcher)

    def fill_bitmasks(self, rows: list[tuple[GrammarMatcher, int]], out: torch.Tensor) -> None:
        """out [B, ceil(vocab/32)] int32: for each (matcher, i), row i <- its allowed tokens; one parallel call.
        Touches no torch kernel (llguidance writes the rows through the tensor's pointer), so any thread may call it."""
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(m.matcher, i) for m, i in rows], out)


class PendingMasks:
    """A step's bitmask fill under way on the filler's thread."""

    def __init__(self, future: Future[None] | None, masks: torch.Tensor | None) -> None:
        self._future = future
        self._masks = masks  # [rows, words] int32; None when no row is constrained

    def wait(self) -> torch.Tensor | None:
        """The filled masks (a view of the filler's buffer, valid until its next fill); re-raises a fill error."""
        if self._future is not None:
            self._future.result()
        return self._masks


class MaskFiller:
    """Fills a step's allowed-token bitmasks on a thread of its own while the model runs.

    llguidance releases the GIL while it computes masks, so the fill overlaps the forward pass instead of
    following it. The buffer is reused across steps: the engine waits for every fill (also when the forward
    fails) before it starts the next one, and advances matchers only after the wait.
    """

    def __init__(self, backend: GrammarBackend) -> None:
        self._backend = backend
        self._words = (backend.vocab_size + 31) // 32
        self._buffer = torch.full((64, self._words), -1, dtype=torch.int32)  # [max rows so far, words]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmrpc-grammar")

    def start(self, matchers: list[GrammarMatcher | None]) -> PendingMasks:
        """Begin filling row i for matchers[i]; unconstrained rows (None) allow every token."""
        if all(m is None for m in matchers):
            return PendingMasks(None, None)
        if self._buffer.shape[0] < len(matchers):
            self._buffer = torch.full((len(matchers), self._words), -1, dtype=torch.int32)
        masks = self._buffer[: len(matchers)]  # [rows, words]
        masks.fill_(-1)  # here, on the engine thread: the filler's thread runs no torch kernel
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        return PendingMasks(self._pool.submit(self._backend.fill_bitmasks, rows, masks), masks)

    def fill_now(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """Masks [len(matchers), words] filled now, on the calling thread (rows sampled before their mask was
        known whose token the grammar rejected)."""
        masks = torch.full((len(matchers), self._words), -1, dtype=torch.int32)
        self._backend.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], masks)
        return masks

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

