"""Issue 5's acceptance over a real server with the real SmolLM2 model: constrained requests end by their grammar
and validate; invalid constraints are INVALID_ARGUMENT naming the field, the kind and the compiler's message."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from lmrpc.client import Client, FinishReason, response_format
from lmrpc.client.errors import LmrpcError

pytestmark = pytest.mark.e2e


def chat(question: str) -> str:
    """SmolLM2's chat format, so the model answers rather than continues the question."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


JOB = {"type": "object",
       "properties": {"status": {"enum": ["queued", "running", "done"]},
                      "progress": {"type": "integer", "minimum": 0, "maximum": 100},
                      "owner": {"type": "string", "pattern": "^[a-z]{1,12}$"}},
       "required": ["status", "progress"], "additionalProperties": False}


def test_json_schema_output_validates(client: Client) -> None:
    # Rigid layout and a bounded schema: the output cannot outgrow max_new_tokens, so it must end by its grammar.
    [result] = client.generate(chat("Report the status of a build job as JSON."), sampling_params={
        **response_format({"type": "json_schema", "json_schema": {"name": "job", "schema": JOB}}),
        "json_whitespace_flexible": False, "max_new_tokens": 64, "temperature": 0,
    })
    assert result.finish.reason is FinishReason.GRAMMAR_END, result
    jsonschema.validate(json.loads(result.text), JOB)
    assert json.dumps(json.loads(result.text)) == result.text  # json.dumps' layout, nothing else


def test_regex_samples_match(client: Client) -> None:
    pattern = r"\d{3}-\d{4}"
    results = client.generate(chat("Give me a phone number like 555-1234."), sampling_params={
        "regex": pattern, "n": 3, "temperature": 0.7, "sampling_seed": 11, "max_new_tokens": 16,
    })
    assert len(results) == 3
    for r in results:
        assert r.finish.reason is FinishReason.GRAMMAR_END, r
        assert re.fullmatch(pattern, r.text, re.ASCII), r.text


def test_structural_tag_call_validates(client: Client) -> None:
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
               "required": ["city"], "additionalProperties": False}
    tag = {"type": "structural_tag", "triggers": ["<function="],
           "structures": [{"begin": "<function=get_weather>", "schema": weather, "end": "</function>"}]}
    example = '<function=get_weather>{"city": "Rome"}</function>'
    prompt = (f"<|im_start|>system\nCall the tool get_weather by writing {example}.<|im_end|>\n"
              f"<|im_start|>user\nWhat is the weather in Rome?<|im_end|>\n<|im_start|>assistant\n{example}<|im_end|>\n"
              "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    [result] = client.generate(prompt, sampling_params={**response_format(tag), "max_new_tokens": 48,
                                                        "temperature": 0})
    calls = re.findall(r"<function=get_weather>(.*?)</function>", result.text)
    assert calls, result.text
    for arguments in calls:
        jsonschema.validate(json.loads(arguments), weather)


@pytest.mark.parametrize(("kind", "text", "compiler_says"), [
    ("json_schema", '{"type": "objekt"}', "Invalid type: objekt"),
    ("regex", "(abc", "unclosed group"),
    ("ebnf", 'root ::= "a" | missing_rule', "missing_rule"),
    ("structural_tag", json.dumps({"structures": [{"begin": "<f>", "schema": {}, "end": ""}], "triggers": ["<g"]}),
     "starts with none of the triggers"),
])
def test_invalid_constraint_is_invalid_argument(client: Client, kind: str, text: str, compiler_says: str) -> None:
    with pytest.raises(LmrpcError) as err:
        client.generate("Hello", sampling_params={kind: text, "max_new_tokens": 4})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    [violation] = err.value.field_violations
    assert violation.field == f"sampling_params[0].{kind}"
    assert violation.description.startswith(f"invalid {kind}: ")
    assert compiler_says in violation.description


def test_json_whitespace_option_needs_a_json_constraint(client: Client) -> None:
    with pytest.raises(LmrpcError) as err:
        client.generate("Hello", sampling_params={"regex": "a+", "json_whitespace_flexible": True})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    [violation] = err.value.field_violations
    assert violation.field == "sampling_params[0].json_whitespace_flexible"
    assert "regex" in violation.description
