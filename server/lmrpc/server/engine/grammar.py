"""Structured output with llguidance: compile constraints (cached), fill token bitmasks in one batched call while
the model runs (MaskFiller), advance matchers with sampled tokens. Masks are applied to the logits by the sampler
(lmrpc.kernels.sampling.apply_bitmask, plain torch).

json_schema, regex and ebnf go to llguidance's own front ends (a regex as a one-rule Lark grammar); a structural_tag
is translated into a Lark grammar (structural_tag.py). Every constraint is first held to the grammar limits, and
compiled on deep-stack threads (grammar_limits.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import llguidance
import llguidance.hf
import llguidance.numpy
import torch
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

from lmrpc.server.engine.grammar_limits import (
    DeepStackThreads,
    GrammarError,
    GrammarLimits,
    readable,
    shared_threads,
)
from lmrpc.server.engine.structural_tag import parse_structural_tag, structural_tag_lark, tag_limit_error
from lmrpc.server.engine.types import Constraint

T = TypeVar("T")

__all__ = ["GrammarBackend", "GrammarError", "GrammarLimits", "GrammarMatcher", "MaskFiller", "PendingMasks",
           "parse_structural_tag"]

# Compiled grammars kept (least recently used dropped), bounded by count and by the characters of their keys and
# grammars: a schema at the byte limit translates to a grammar of about its size, so 256 of them could hold 130 MiB.
_CACHE_SIZE = 256
_CACHE_CHARS = 16 * 2**20
# Checked matchers kept so that a repeated constraint (the same schema on every call) is not compiled again for its
# check: building one compiles the grammar (2 s for a 3,000-property schema). A matcher holds about 65 bytes per
# character of its grammar (13 MiB for a 200 KB one), so they are bounded by their grammars' characters: 32 MiB
# of matchers at most. A request carries its own (Constraint.checked), so dropping one here never costs the engine.
_PROTOTYPES = 16
_PROTOTYPE_CHARS = 512 * 1024
# Compiles for checks run on this many deep-stack threads (grammar_limits.py); the engine's matchers on one of their
# own, so a slow user grammar never holds up the engine loop. Two also bound the cores hostile grammars can take.
_CHECK_THREADS = 2
# A grammar whose language is empty (`root ::= root "a"`: no rule ever ends) passes llguidance's compile; the first
# mask finds it, with an internal dump for a message.
_EMPTY_LANGUAGE = "it matches no text at all, so no output can satisfy it"
_EMPTY_LANGUAGE_HINT = ' (does a rule never end? e.g. root ::= root "a" has no alternative without root)'
# A regex's \d and \w are ASCII ([0-9], [0-9a-zA-Z_]), as in JSON-schema patterns, xgrammar and Outlines: left
# Unicode, "\d{3}" lets a model write digits from any script (it does: U+1FBF8 SEGMENTED DIGIT EIGHT).
_REGEX_ASCII_CLASSES = "dw"

# json_whitespace_flexible=False: exactly json.dumps' default layout (", " and ": ", nothing else), what xgrammar
# produces without any_whitespace. llguidance's own rigid mode (",", ":") is a layout models rarely saw in training.
_RIGID_JSON: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FLEXIBLE_JSON: JsonCompileOptions = {"whitespace_flexible": True}


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
        return readable(self.matcher.get_error()) if self.matcher.is_error() else None

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self.matcher.deep_copy())


# ---- the backend -----------------------------------------------------------------------------------------------


class GrammarBackend:
    """Constraints -> llguidance grammars and matchers, within `limits` (grammar_limits.py).

    Each constraint is checked on its text first (size, depth, rules: linear scans on the calling thread, before any
    parse), then translated and compiled on deep-stack threads, where a compile the limits let through cannot
    overflow a stack; the engine's matchers are built there too (building one compiles the grammar again).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 limits: GrammarLimits | None = None) -> None:
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self._tokenizer = llguidance.hf.from_tokenizer(cast("TokenizersBackend", tokenizer), n_vocab=vocab_size)
        self._executor = llguidance.LLExecutor()
        # llguidance's own bounds at their defaults (lexer fuel, Earley items per step, 500,000 grammar symbols);
        # verbose_errors off: an error is a line, not a dump of parser state and grammar.
        self._parser_limits = llguidance.LLParserLimits(verbose_errors=False)
        self._check_threads = shared_threads("lmrpc-grammar-check", _CHECK_THREADS)
        self._matcher_threads = shared_threads("lmrpc-grammar-matcher", 1)
        self._compiled = _Bounded[str](_CACHE_SIZE, _CACHE_CHARS)
        self._prototypes = _Bounded[llguidance.LLMatcher](_PROTOTYPES, _PROTOTYPE_CHARS)
        self._lock = threading.Lock()  # compile runs on service threads, matchers on the engine thread
        # Tokens llguidance treats as special (never part of free text): a structural tag names them as tokens.
        self._special_tokens = {
            text: token_id for text, token_id in tokenizer.get_added_vocab().items()
            if 0 <= token_id < vocab_size and self._tokenizer.is_special_token(token_id)
        }

    def compile(self, constraint: Constraint) -> str:
        """The llguidance grammar of a constraint (cached by kind, text and options); raises GrammarError."""
        grammar = self._cached(constraint)
        if grammar is None:
            grammar, _ = self._check_threads.run(lambda: self._build(constraint))
        return grammar

    def checked(self, constraint: Constraint) -> Constraint:
        """The constraint with a matcher of its own (`Constraint.checked`) once it compiles; raises GrammarError.
        A repeated constraint gets the kept matcher; a cached grammar a new matcher (no translation)."""
        return replace(constraint, checked=self._prototype(constraint, self._check_threads))

    def _prototype(self, constraint: Constraint, threads: DeepStackThreads) -> llguidance.LLMatcher:
        """The kept matcher of a constraint, else a new one built on `threads` (and kept)."""
        with self._lock:
            prototype = self._prototypes.get(_key(constraint))
        if prototype is not None:
            return prototype
        grammar = self._cached(constraint)
        if grammar is None:
            return threads.run(lambda: self._build(constraint)[1])
        return threads.run(lambda: self._matcher(constraint, grammar))

    def _cached(self, constraint: Constraint) -> str | None:
        """The cached grammar, or None after checking the limits (a constraint past them never gets further)."""
        with self._lock:
            grammar = self._compiled.get(_key(constraint))
        if grammar is not None:
            return grammar
        error = self._limit_error(constraint)
        if error:
            raise GrammarError(constraint.kind, error)
        return None

    def _limit_error(self, constraint: Constraint) -> str | None:
        kind, text, limits = constraint.kind, constraint.text, self.limits
        what = {"json_schema": "the schema", "structural_tag": "the structural tag", "regex": "the pattern"}
        error = limits.size_error(text, what.get(kind, "the grammar"))
        if error is None and kind == "json_schema":
            error = limits.json_error(text, "the schema")
        if error is None and kind == "structural_tag":
            error = tag_limit_error(text, limits)
        if error is None and kind == "ebnf":
            error = limits.grammar_error(text)
        # A regex needs no more: its parser refuses groups nested past 250 (regex-syntax's nest limit), iteratively.
        return error

    def _build(self, constraint: Constraint) -> tuple[str, llguidance.LLMatcher]:
        """Translate, compile and check the constraint (on a deep-stack thread); cache the grammar. A new matcher
        comes with it, its first mask computed: a language with no text shows only there."""
        grammar = self._translate(constraint)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, limits=self._parser_limits)
        if not matcher.is_error():
            mask = matcher.compute_bitmask()
            nothing_allowed = not any(mask) and not matcher.is_accepting()
            if nothing_allowed or (matcher.is_error() and matcher.get_error().startswith("NoExtension")):
                hint = _EMPTY_LANGUAGE_HINT if constraint.kind == "ebnf" else ""
                raise GrammarError(constraint.kind, _EMPTY_LANGUAGE + hint)
        if matcher.is_error():
            raise GrammarError(constraint.kind, readable(matcher.get_error()))
        key, size = _key(constraint), len(grammar)
        with self._lock:
            self._compiled.put(key, grammar, len(constraint.text) + size)
            self._prototypes.put(key, matcher, size)
        return grammar, matcher

    def _matcher(self, constraint: Constraint, grammar: str) -> llguidance.LLMatcher:
        """A new matcher of a grammar that compiled before (on a deep-stack thread); kept to be reused."""
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, limits=self._parser_limits)
        if matcher.is_error():
            raise GrammarError(constraint.kind, readable(matcher.get_error()))
        with self._lock:
            self._prototypes.put(_key(constraint), matcher, len(grammar))
        return matcher

    def _translate(self, constraint: Constraint) -> str:
        """The constraint as an (unvalidated) llguidance grammar; its text is within the limits."""
        kind = constraint.kind
        flexible = constraint.json_whitespace_flexible
        json_options = None if flexible is None else _FLEXIBLE_JSON if flexible else _RIGID_JSON
        if kind == "json_schema":
            try:
                schema = json.loads(constraint.text)  # nested no deeper than max_grammar_depth: no RecursionError
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
                raise GrammarError(kind, readable(str(exc))) from exc
        if kind == "structural_tag":
            tag = parse_structural_tag(constraint.text, self.limits)
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
            raise GrammarError(kind, readable(str(exc))) from exc

    def check(self, constraint: Constraint) -> str | None:
        """None if the constraint compiles, else why not."""
        try:
            self.checked(constraint)
        except GrammarError as exc:
            return str(exc)
        return None

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (a byte-level token may hold part of a UTF-8 character); special tokens as their
        text. Thread-safe (llguidance's tokenizer is immutable)."""
        return bytes(self._tokenizer.decode_bytes([token_id]))

    def new_matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher (engine thread): a copy of the one the service's check built, else (a constraint that
        never went through a check: in-process callers) one checked on the matcher's own deep-stack thread."""
        prototype = constraint.checked
        if prototype is None:
            prototype = self._prototype(constraint, self._matcher_threads)
        return GrammarMatcher(prototype.deep_copy())

    def fill_bitmasks(self, rows: list[tuple[GrammarMatcher, int]], out: torch.Tensor) -> None:
        """out [B, ceil(vocab/32)] int32: for each (matcher, i), row i <- its allowed tokens; one parallel call.
        Touches no torch kernel (llguidance writes the rows through the array's pointer), so any thread may call it.
        llguidance.numpy, not llguidance.torch: importing the latter compiles a mask kernel with torch.compile (1.3 s
        of torch._inductor imports at every server start) that lmrpc never calls."""
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m.matcher, i) for m, i in rows], out.numpy())


def _key(constraint: Constraint) -> tuple[str, str, bool | None]:
    return constraint.kind, constraint.text, constraint.json_whitespace_flexible


class _Bounded(Generic[T]):
    """A least-recently-used map bounded by its entries and by the sum of their sizes (characters)."""

    def __init__(self, max_entries: int, max_size: int) -> None:
        self.max_entries, self.max_size = max_entries, max_size
        self._items: OrderedDict[tuple[str, str, bool | None], tuple[T, int]] = OrderedDict()
        self._size = 0

    def get(self, key: tuple[str, str, bool | None]) -> T | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: tuple[str, str, bool | None], value: T, size: int) -> None:
        """Keep `value` (nothing larger than the whole bound is kept); drop the least recently used past it."""
        old = self._items.pop(key, None)
        if old is not None:
            self._size -= old[1]
        if size > self.max_size:
            return
        self._items[key] = (value, size)
        self._size += size
        while len(self._items) > self.max_entries or self._size > self.max_size:
            _, (_, dropped) = self._items.popitem(last=False)
            self._size -= dropped

    def __len__(self) -> int:
        return len(self._items)


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

