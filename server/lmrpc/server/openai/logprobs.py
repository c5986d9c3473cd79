"""OpenAI's logprob shapes from the engine's PositionLogprobs.

A token's text (`tokens`, chat's `token`) is the text it adds to the output, found with the detokenizer's own
incremental rule, so that the texts concatenate to the output's text and `text_offset` points into it exactly (a
token that starts a multi-byte character adds "", the one completing it the character). Alternatives, which were
not generated, are decoded on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from google.protobuf import struct_pb2

from lmrpc.server.engine.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDecoder, decode_token
from lmrpc.server.engine.types import PositionLogprobs, SamplingParams, TokenLogprob
from lmrpc.v1 import openai_pb2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TokenBytes = Callable[[int], bytes]  # a token's own bytes


class TokenTexts:
    """The text each token of one output adds, token by token (streamed outputs keep one across deltas)."""

    def __init__(self, decoder: IncrementalDecoder) -> None:
        self._decoder = decoder

    @classmethod
    def for_output(cls, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int],
                   params: SamplingParams) -> TokenTexts:
        """Generated tokens, decoded as the engine decodes the output's text (same context and options)."""
        return cls(IncrementalDecoder(tokenizer, list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]), params.skip_special_tokens,
                                      params.spaces_between_special_tokens))

    @classmethod
    def for_prompt(cls, tokenizer: PreTrainedTokenizerBase) -> TokenTexts:
        """Prompt tokens (echo), special tokens kept and nothing added between them: they spell the prompt."""
        return cls(IncrementalDecoder(tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=False))

    def add(self, token_ids: Sequence[int], last: bool) -> list[str]:
        """The texts of the next tokens; `last`: no token follows, so a pending partial character is flushed."""
        texts = [self._decoder.step(t) for t in token_ids]
        if last and texts:
            texts[-1] += self._decoder.flush()
        return texts


class CompletionLogprobsWriter:
    """One choice's completions logprobs, delta by delta; offsets run on across deltas."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.offset = 0  # where the next token's text starts in the choice's text

    def write(self, positions: Sequence[PositionLogprobs], texts: Sequence[str],
              into: openai_pb2.CompletionLogprobs) -> None:
        for position, text in zip(positions, texts, strict=True):
            into.tokens.append(text)
            value = into.token_logprobs.add()
            if position.chosen.logprob is None:
                value.null_value = struct_pb2.NULL_VALUE  # the first prompt token: nothing predicts it
            else:
                value.number_value = position.chosen.logprob
            top = into.top_logprobs.add()
            for alternative in position.top:  # best first: of alternatives spelled alike, the likelier one stays
                key = decode_token(self._tokenizer, alternative.token_id)
                if key not in top.fields and alternative.logprob is not None:
                    top[key] = alternative.logprob
            into.text_offset.append(self.offset)
            self.offset += len(text)


def chat_logprobs(tokenizer: PreTrainedTokenizerBase, token_bytes: TokenBytes,
                  positions: Sequence[PositionLogprobs], texts: Sequence[str]) -> list[openai_pb2.ChatTokenLogprob]:
    """Chat logprobs entries of generated tokens."""
    entries = []
    for position, text in zip(positions, texts, strict=True):
        chosen = position.chosen
        entries.append(openai_pb2.ChatTokenLogprob(
            token=text, logprob=_scored(chosen), bytes=token_bytes(chosen.token_id),
            top_logprobs=[openai_pb2.ChatTopLogprob(token=decode_token(tokenizer, t.token_id), logprob=_scored(t),
                                                    bytes=token_bytes(t.token_id)) for t in position.top],
        ))
    return entries


def _scored(token: TokenLogprob) -> float:
    assert token.logprob is not None, "generated tokens and alternatives always have a logprob"
    return token.logprob
