"""Structured output with llguidance: compile constraints (cached), fill token bitmasks in one batched call,
advance matchers with sampled tokens, apply masks to logits with plain torch."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Literal, cast

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

from lmrpc.server.protocol import Constraint, ConstraintKind

# Our constraint kinds -> llguidance.grammar_from formats ("ebnf" takes GBNF `root ::= ...` or Lark).
GrammarFormat = Literal["json_schema", "regex", "ebnf"]
_FORMATS: dict[ConstraintKind, GrammarFormat] = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}
_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped


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

    @property
    def is_finished(self) -> bool:
        """The grammar is complete (it accepted EOS or cannot be extended)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self.matcher.get_error()) if self.matcher.is_error() else None

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self.matcher.deep_copy())


class GrammarBackend:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(cast("TokenizersBackend", tokenizer), n_vocab=vocab_size)
        self._executor = llguidance.LLExecutor()
        self._compiled: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()  # compile runs on service threads, matchers on the engine thread

    def compile(self, constraint: Constraint) -> str:
        """The llguidance grammar of a constraint (cached by kind and text); raises GrammarError."""
        key = (constraint.kind, constraint.text)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        if constraint.kind not in _FORMATS:
            raise GrammarError(constraint.kind, "not supported yet")
        try:
            grammar = llguidance.grammar_from(_FORMATS[constraint.kind], constraint.text)
        except ValueError as exc:
            raise GrammarError(constraint.kind, str(exc)) from exc
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(constraint.kind, str(error))
        with self._lock:
            self._compiled[key] = grammar
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    def check(self, constraint: Constraint) -> str | None:
        try:
            self.compile(constraint)
        except GrammarError as exc:
            return str(exc)
        return None

    def new_matcher(self, constraint: Constraint) -> GrammarMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, self.compile(constraint))
        if matcher.is_error():
            raise GrammarError(constraint.kind, str(matcher.get_error()))
        return GrammarMatcher(matcher)

    def fill_bitmasks(self, rows: list[tuple[GrammarMatcher, int]], out: torch.Tensor) -> None:
        """out [B, ceil(vocab/32)] int32: for each (matcher, i), row i <- its allowed tokens; one parallel call."""
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(m.matcher, i) for m, i in rows], out)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] in place: tokens whose bit is 0 get -inf; columns past the mask's width are disallowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # [B, words * 32]
    width = min(allowed.shape[1], logits.shape[1])
    logits[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
    logits[:, width:] = float("-inf")
