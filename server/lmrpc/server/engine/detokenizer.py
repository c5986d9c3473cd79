"""Incremental detokenization and the stop rules of one output.

`OutputProcessor.process(token)` is called after each sampled token. It decides whether the output ends (in the
order of docs/semantics.md "Stopping": length, grammar end, EOS / stop token, stop string, stop regex) and returns
new text that is safe to show: never half a UTF-8 character, never the beginning of what may still become a stop
string. The concatenation of all returned texts is the output's final text (trimmed of the stop string / token).

Decoding works on a small window of token ids (prefix and read offsets, as in vLLM's detokenizer): the new text of a
token is decode(window) minus decode(window without the newest tokens), so the cost per token does not grow with
the output. A window whose text ends in U+FFFD waits for the bytes that complete the character.

Stop regexes are matched against a bounded tail of the text. The `regex` module's partial matching tells which
suffix could still grow into a match, and that suffix is held back exactly like the beginning of a stop string.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import regex

from lmrpc.server.engine.types import Finish, FinishReason, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (leading-space rules)
MAX_PENDING_TOKENS = 8  # undecodable tokens to wait for before giving up on completing a character
MAX_WINDOW_TOKENS = 16  # decoded ids kept as context at most (runs of invisible tokens)
REGEX_WINDOW = 512  # characters of decoded tail a stop_regex is matched against (and held back at most)


@dataclass(frozen=True)
class StepText:
    """What one token adds to an output."""

    text: str  # new text that is safe to emit ("" while held back)
    finish: Finish | None  # set when this token ends the output


def _decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], skip_special_tokens: bool) -> str:
    # No clean-up of tokenization spaces: it would make a window's text depend on what follows it.
    text = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    return text


class IncrementalDecoder:
    """Token ids in, text deltas out, over a bounded window of ids."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        context_ids: Sequence[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only meaningful when special tokens are kept: joins added/special tokens and text runs with spaces
        # (the slow tokenizers' rule; fast tokenizers ignore the flag, so it is applied here).
        self._join_with_spaces = spaces_between_special_tokens and not skip_special_tokens
        self._added_ids: frozenset[int] = (
            frozenset(tokenizer.added_tokens_decoder) if self._join_with_spaces else frozenset()
        )
        self.ids: list[int] = list(context_ids)  # the window: ids[prefix:read] is decoded, ids[read:] is new
        self.prefix = 0
        self.read = len(self.ids)

    def decode(self, ids: Sequence[int]) -> str:
        if not self._join_with_spaces or not self._added_ids.intersection(ids):
            return _decode(self.tokenizer, ids, self.skip_special_tokens)
        pieces: list[str] = []
        run: list[int] = []
        for t in ids:
            if t in self._added_ids:
                if run:
                    pieces.append(_decode(self.tokenizer, run, False))
                    run = []
                pieces.append(_decode(self.tokenizer, [t], False))
            else:
                run.append(t)
        if run:
            pieces.append(_decode(self.tokenizer, run, False))
        return " ".join(pieces)

    def step(self, token_id: int) -> str:
        """Add a token; return the text that is now decided ("" while a character is incomplete)."""
        self.ids.append(token_id)
        return self._advance(force=False)

    def flush(self) -> str:
        """The text of tokens still waiting for the rest of a character (the end of the output)."""
        return self._advance(force=True) if self.read < len(self.ids) else ""

    def _advance(self, force: bool) -> str:
        prefix_text = self.decode(self.ids[self.prefix : self.read])
        full_text = self.decode(self.ids[self.prefix :])
        waiting = full_text.endswith(REPLACEMENT) and len(self.ids) - self.read < MAX_PENDING_TOKENS
        if waiting and not force:
            return ""
        if len(full_text) <= len(prefix_text) and not force:
            # Nothing visible (e.g. a skipped special token): mark it read; keep the prefix as decoding context
            # unless a long run of such tokens would make the window grow.
            self.read = len(self.ids)
            if self.read - self.prefix > MAX_WINDOW_TOKENS:
                self.prefix = self.read - PROMPT_CONTEXT_TOKENS
                self._trim()
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        self._trim()
        return delta

    def _trim(self) -> None:
        # Ids before the prefix offset are never decoded again: drop them so memory stays bounded too.
        if self.prefix > 0:
            del self.ids[: self.prefix]
            self.read -= self.prefix
            self.prefix = 0


class OutputProcessor:
    """Text and stop rules of one output. Call `process` once per generated token, in order."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.stops: tuple[str, ...] = tuple(s for s in params.stop if s)
        self.regexes = params.stop_patterns  # compiled at validation
        if len(self.regexes) != len(params.stop_regex):  # an in-process caller's: compiled here
            try:
                self.regexes = tuple(regex.compile(p, cache_pattern=False) for p in params.stop_regex)
            except regex.error as exc:
                raise ValueError(f"stop_regex: invalid pattern: {exc}") from exc
        self.decoder = IncrementalDecoder(
            tokenizer,
            list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]),
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )
        self.num_tokens = 0  # tokens processed so far
        self.finish: Finish | None = None
        self._pending = ""  # decoded text not emitted yet (it may start a stop string)
        self._emitted_tail = ""  # the last REGEX_WINDOW emitted characters (stop_regex context)

    def process(self, token_id: int, *, grammar_finished: bool = False) -> StepText:
        assert self.finish is None, "process() called after the output finished"
        self.num_tokens += 1
        finish = self._token_finish(token_id, grammar_finished)
        token_is_stop = token_id in self.eos_token_ids or token_id in self.stop_token_ids
        if finish is not None and finish.reason is not FinishReason.LENGTH and token_is_stop:
            # A stop token ends the text: it is not decoded into it unless no_stop_trim.
            new = (self.decoder.step(token_id) if self.params.no_stop_trim else "") + self.decoder.flush()
        else:
            new = self.decoder.step(token_id)
            if finish is not None:
                new += self.decoder.flush()
        self._pending += new
        if finish is None:
            finish, cut = self._text_finish()
            if finish is not None:
                return self._end(finish, self._pending[:cut])
            return StepText(self._release(self._pending_safe_length()), None)
        return self._end(finish, self._pending)

    # ---- stop rules --------------------------------------------------------------------------------------------

    def _token_finish(self, token_id: int, grammar_finished: bool) -> Finish | None:
        p = self.params
        if self.num_tokens >= p.max_new_tokens:
            return Finish(FinishReason.LENGTH)
        if grammar_finished:
            return Finish(FinishReason.GRAMMAR_END, matched_token_id=token_id)
        if not p.ignore_eos:
            if token_id in self.eos_token_ids:
                return Finish(FinishReason.EOS, matched_token_id=token_id)
            if token_id in self.stop_token_ids:
                return Finish(FinishReason.STOP_TOKEN, matched_token_id=token_id)
        return None

    def _text_finish(self) -> tuple[Finish | None, int]:
        """A stop string in the pending text, else a stop regex on the tail: (finish, where the text ends)."""
        best: tuple[int, str] | None = None
        for s in self.stops:
            at = self._pending.find(s)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            at, s = best
            return Finish(FinishReason.STOP_STRING, matched_text=s), at + (len(s) if self.params.no_stop_trim else 0)
        if self.regexes:
            tail = self._regex_tail()
            for rx in self.regexes:
                m = rx.search(tail)
                if m is not None:
                    end = m.end() if self.params.no_stop_trim else m.start()
                    # Text already emitted cannot be taken back: the cut is at least at the emitted boundary.
                    cut = end - (len(tail) - len(self._pending))
                    return Finish(FinishReason.STOP_REGEX, matched_text=rx.pattern), max(0, cut)
        return None, 0

    def _regex_tail(self) -> str:
        """The text a stop regex sees: the pending text after some emitted context, bounded."""
        # Bounded: the emitted tail keeps REGEX_WINDOW characters and a regex holds back at most as many.
        return self._emitted_tail + self._pending

    def _pending_safe_length(self) -> int:
        """How much of the pending text can be emitted: all but the longest suffix that may start a stop."""
        pending = self._pending
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:n]):
                    hold = n
                    break
        if self.regexes and pending:
            tail = self._regex_tail()
            for rx in self.regexes:
                m = rx.search(tail, partial=True)  # no full match here (checked first): a partial one at the end
                if m is not None and m.end() > m.start():
                    hold = max(hold, min(len(tail) - m.start(), len(pending), REGEX_WINDOW))
        return len(pending) - hold

    # ---- output ------------------------------------------------------------------------------------------------

    def _release(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        if out and self.regexes:
            self._emitted_tail = (self._emitted_tail + out)[-REGEX_WINDOW:]
        return out

    def _end(self, finish: Finish, text: str) -> StepText:
        self.finish = finish
        self._pending = ""
        return StepText(text, finish)


class _TokenTextCache:
    """Texts of single tokens per tokenizer (memoization only; keyed weakly so tokenizers can be freed)."""

    def __init__(self) -> None:
        self._by_tokenizer: weakref.WeakKeyDictionary[object, dict[int, str]] = weakref.WeakKeyDictionary()

    def get(self, tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
        texts = self._by_tokenizer.setdefault(tokenizer, {})
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = _decode(tokenizer, [token_id], False)
        return text


_token_texts = _TokenTextCache()  # a pure cache: same answers with or without it


def decode_token(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """A token's text decoded on its own, special tokens kept (logprob entries' text)."""
    return _token_texts.get(tokenizer, token_id)
