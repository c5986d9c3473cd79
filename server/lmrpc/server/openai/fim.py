"""Fill in the middle (CompleteRequest.suffix): find a tokenizer's FIM tokens and lay a prompt out around them.

Code models are trained on prefix-suffix-middle prompts: <prefix-token> prefix <suffix-token> suffix
<middle-token>, after which the model writes the middle. The token spellings differ by family; a tokenizer with
none of the known sets cannot fill in the middle, and a suffix is then refused rather than ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# (prefix, suffix, middle) spellings of the families that have them: StarCoder/SantaCoder, Qwen2.5-Coder,
# DeepSeek-Coder (begin, hole, end) and Code Llama (its tokens carry SentencePiece's leading-space mark).
FIM_SPELLINGS: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),
)


@dataclass(frozen=True)
class FimTokens:
    """The token ids that frame a fill-in-the-middle prompt."""

    prefix: int  # comes before the text before the gap
    suffix: int  # comes before the text after the gap
    middle: int  # ends the prompt: the model writes the gap next


def find_fim_tokens(tokenizer: PreTrainedTokenizerBase) -> FimTokens | None:
    """The first known FIM token set whose three tokens are all in the vocabulary, else None."""
    vocab = tokenizer.get_vocab()
    for spelling in FIM_SPELLINGS:
        if all(token in vocab for token in spelling):
            prefix, suffix, middle = (vocab[token] for token in spelling)
            return FimTokens(prefix, suffix, middle)
    return None


def fim_prompt(tokens: FimTokens, leading: Sequence[int], prefix: Sequence[int], suffix: Sequence[int]) -> list[int]:
    """Prefix-suffix-middle layout; `leading` are the special tokens the tokenizer puts first (e.g. BOS)."""
    return [*leading, tokens.prefix, *prefix, tokens.suffix, *suffix, tokens.middle]


def leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts before any text (BOS for Llama-style tokenizers; none for byte-level BPE ones)."""
    with_special = list(tokenizer.encode("a"))
    without = list(tokenizer.encode("a", add_special_tokens=False))
    at = len(with_special) - len(without)
    return with_special[:at] if at > 0 and with_special[at:] == without else []
