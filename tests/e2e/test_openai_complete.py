"""Issue 12's acceptance for OpenAIService.Complete over a real server with the real SmolLM2 model: prompt forms,
n and best_of, echo, logprobs with text offsets, stop and matched_stop, JSON output, stream options, suffix."""

from __future__ import annotations

import json
import math

import grpc
import jsonschema
import pytest

from lmrpc.client import Client, Completion, CompletionChoice, CompletionFinishReason, LmrpcError

pytestmark = pytest.mark.e2e

CAPITAL = "The capital of France is"
COUNTING = "1, 2, 3, 4, 5,"
EOS = 2  # <|im_end|>


def chat_prompt(question: str) -> str:
    """SmolLM2's chat format written by hand, so that a completion answers rather than continues."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def assert_offsets_spell_text(choice: CompletionChoice) -> None:
    """text_offset[i] is where tokens[i] starts in the text, and the tokens spell the text."""
    assert choice.logprobs is not None
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    offset = 0
    for token, at in zip(lp.tokens, lp.text_offset, strict=True):
        assert at == offset
        assert choice.text[at:at + len(token)] == token
        offset += len(token)
    assert "".join(lp.tokens) == choice.text


def test_complete_a_string(client: Client) -> None:
    info = client.model_info()
    completion = client.complete(CAPITAL, max_tokens=8, temperature=0, return_token_ids=True)
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.model == info.served_model_name and completion.created > 0
    [choice] = completion.choices
    assert choice.index == 0 and choice.text
    assert choice.finish_reason in (CompletionFinishReason.LENGTH, CompletionFinishReason.STOP)
    assert choice.prompt_token_ids == client.tokenize(CAPITAL)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(choice.prompt_token_ids)
    assert completion.usage.completion_tokens == len(choice.token_ids) <= 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert client.detokenize(choice.token_ids) == choice.text


def test_usage_reports_cached_prompt_tokens(client: Client) -> None:
    prompt = "A prompt sent twice, to see the prefix cache at work in the usage of a completion."
    first = client.complete(prompt, max_tokens=1, temperature=0).usage
    again = client.complete(prompt, max_tokens=1, temperature=0, return_cached_tokens_details=True).usage
    assert first is not None and again is not None
    assert first.cached_tokens_details is None  # not asked for
    assert again.cached_tokens == again.prompt_tokens - 1  # all but the last, which must be computed for logits
    assert again.cached_tokens_details == {"device": again.cached_tokens, "host": 0}


@pytest.mark.parametrize("form", ["strings", "ids", "id lists"])
def test_complete_strings_ids_and_id_lists(client: Client, form: str) -> None:
    prompts = [CAPITAL, "Water boils at"]
    ids = [client.tokenize(p) for p in prompts]
    prompt: list[str] | list[int] | list[list[int]] = {"strings": prompts, "ids": ids[0], "id lists": ids}[form]
    expected = ids[:1] if form == "ids" else ids
    completion = client.complete(prompt, max_tokens=4, temperature=0, return_token_ids=True)
    assert [c.index for c in completion.choices] == list(range(len(expected)))
    assert [c.prompt_token_ids for c in completion.choices] == expected
    assert all(c.text and len(c.token_ids) <= 4 for c in completion.choices)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == sum(len(i) for i in expected)
    assert completion.usage.completion_tokens == sum(len(c.token_ids) for c in completion.choices)


def _mean(choice: CompletionChoice) -> float:
    assert choice.logprobs is not None
    scores = [v for v in choice.logprobs.token_logprobs if v is not None]
    return math.fsum(scores) / len(scores)


def test_n_choices_are_prompt_major(client: Client) -> None:
    completion = client.complete(["Once upon a time", "Roses are red"], n=3, seed=5, max_tokens=6,
                                 return_token_ids=True)
    assert [c.index for c in completion.choices] == list(range(6))
    first, second = client.tokenize("Once upon a time"), client.tokenize("Roses are red")
    assert [c.prompt_token_ids for c in completion.choices] == [first] * 3 + [second] * 3
    assert len({tuple(c.token_ids) for c in completion.choices[:3]}) > 1, "seeded samples must differ"


def test_best_of_returns_the_candidates_with_the_highest_mean_logprob(client: Client) -> None:
    # The same seeded request with n=4 shows all four candidates (candidate i is seeded seed + i either way).
    asked = {"max_tokens": 8, "seed": 11, "temperature": 1.0, "logprobs": 0, "return_token_ids": True}
    candidates = client.complete("Once upon a time", n=4, **asked).choices  # type: ignore[arg-type]
    ranked = sorted(candidates, key=lambda c: -_mean(c))
    best = client.complete("Once upon a time", n=2, best_of=4, **asked)  # type: ignore[arg-type]
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.token_ids for c in best.choices] == [c.token_ids for c in ranked[:2]]
    assert _mean(best.choices[0]) >= _mean(best.choices[1])  # best first
    assert best.usage is not None  # every candidate's tokens were generated (and are counted)
    assert best.usage.completion_tokens == sum(len(c.token_ids) for c in candidates)


def test_echo_without_logprobs(client: Client) -> None:
    completion = client.complete(CAPITAL, echo=True, max_tokens=4, temperature=0, return_token_ids=True)
    [choice] = completion.choices
    assert choice.text.startswith(CAPITAL) and len(choice.text) > len(CAPITAL)
    assert choice.text[len(CAPITAL):] == client.detokenize(choice.token_ids)
    assert choice.logprobs is None
    ids = client.tokenize(CAPITAL)  # token ids echo as their text
    [from_ids] = client.complete(ids, echo=True, max_tokens=1, temperature=0).choices
    assert from_ids.text.startswith(CAPITAL)


def test_echo_with_logprobs(client: Client) -> None:
    prompt = "Héllo wörld 🙂 ça va"
    completion = client.complete(prompt, echo=True, logprobs=2, max_tokens=5, temperature=0, return_token_ids=True)
    [choice] = completion.choices
    assert choice.logprobs is not None
    lp = choice.logprobs
    prompt_ids = choice.prompt_token_ids
    assert len(lp.tokens) == len(prompt_ids) + len(choice.token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] == {}  # nothing predicts the first prompt token
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert "".join(lp.tokens[:len(prompt_ids)]) == prompt
    assert_offsets_spell_text(choice)


def test_logprobs_n_with_text_offsets(client: Client) -> None:
    completion = client.complete(chat_prompt("Write a short sentence about Paris, with an accent: café."),
                                 logprobs=3, max_tokens=16, temperature=0, ignore_eos=True)
    [choice] = completion.choices
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == 16
    for chosen, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True):
        assert chosen is not None and 1 <= len(top) <= 3
        assert chosen == max(top.values())  # greedy: the chosen token is the most likely one
    assert choice.logprobs.text_offset[0] == 0
    assert_offsets_spell_text(choice)


def test_stop_string_and_matched_stop(client: Client) -> None:
    [choice] = client.complete(COUNTING, stop=[","], max_tokens=16, temperature=0).choices
    assert choice.finish_reason is CompletionFinishReason.STOP
    assert choice.matched_stop == ","
    assert "," not in choice.text and choice.text.strip()


def test_stop_token_and_eos_matched_stop(client: Client) -> None:
    comma = client.tokenize(",", add_special_tokens=False)
    assert len(comma) == 1
    [choice] = client.complete(COUNTING, stop_token_ids=comma, max_tokens=16, temperature=0,
                               return_token_ids=True).choices
    assert choice.finish_reason is CompletionFinishReason.STOP and choice.matched_stop == comma[0]
    assert choice.token_ids[-1] == comma[0]
    # The model's end of sequence, made certain with logit_bias: stop, matched_stop the EOS id, no text.
    [ended] = client.complete(COUNTING, logit_bias={EOS: 100}, max_tokens=16, temperature=0,
                              return_token_ids=True).choices
    assert ended.finish_reason is CompletionFinishReason.STOP and ended.matched_stop == EOS
    assert ended.token_ids == [EOS] and ended.text == ""


JOB = {"type": "object",
       "properties": {"status": {"enum": ["queued", "running", "done"]},
                      "progress": {"type": "integer", "minimum": 0, "maximum": 100}},
       "required": ["status", "progress"], "additionalProperties": False}


def test_response_format_json_schema_validates(client: Client) -> None:
    completion = client.complete(chat_prompt("Report the status of a build job as JSON."), max_tokens=48,
                                 temperature=0, json_whitespace_flexible=False,
                                 response_format={"type": "json_schema", "json_schema": {"name": "job", "schema": JOB}})
    [choice] = completion.choices
    assert choice.finish_reason is CompletionFinishReason.STOP, choice
    jsonschema.validate(json.loads(choice.text), JOB)


def test_response_format_json_object_parses(client: Client) -> None:
    completion = client.complete(chat_prompt("Describe a cat as a JSON object with its name and age."),
                                 max_tokens=96, temperature=0, json_whitespace_flexible=False,
                                 response_format={"type": "json_object"})
    [choice] = completion.choices
    assert choice.finish_reason is CompletionFinishReason.STOP, choice
    assert isinstance(json.loads(choice.text), dict)


def _chunks(client: Client, **options: bool) -> list[Completion]:
    return list(client.complete(CAPITAL, stream=True, max_tokens=6, temperature=0, return_token_ids=True,
                                stream_options=options))


def test_stream_options_include_usage(client: Client) -> None:
    *chunks, last = _chunks(client, include_usage=True)
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert last.usage.completion_tokens == sum(len(c.choices[0].token_ids) for c in chunks)
    assert last.usage.prompt_tokens == len(client.tokenize(CAPITAL))
    assert chunks[-1].choices[0].finish_reason is not CompletionFinishReason.UNSPECIFIED
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [CompletionFinishReason.UNSPECIFIED] * (
        len(chunks) - 1)
    assert all(c.id == last.id for c in chunks)


def test_stream_options_continuous_usage_stats(client: Client) -> None:
    chunks = _chunks(client, continuous_usage_stats=True)
    assert all(c.usage is not None and len(c.choices) == 1 for c in chunks)  # no usage-only chunk without it
    generated = 0
    for c in chunks:
        generated += len(c.choices[0].token_ids)
        assert c.usage is not None and c.usage.completion_tokens == generated
        assert c.usage.total_tokens == c.usage.prompt_tokens + generated
    [*_, with_both] = _chunks(client, include_usage=True, continuous_usage_stats=True)
    assert with_both.choices == [] and with_both.usage is not None
    assert with_both.usage.completion_tokens == generated


def test_suffix_is_invalid_argument_without_fim_tokens(client: Client) -> None:
    with pytest.raises(LmrpcError) as err:
        client.complete("def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))", max_tokens=8)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    [violation] = err.value.field_violations
    assert violation.field == "suffix" and "fill-in-the-middle" in violation.description
