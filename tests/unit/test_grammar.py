"""Structured output (issue 5): the llguidance backend on the real tokenizer (structural tags, JSON whitespace
layout, compiler errors), a random-weight tiny model whose garbage still obeys every grammar, the real SmolLM2 model
whose outputs finished by GRAMMAR_END all validate, and a 40-request mix where constraints never change the
unconstrained outputs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import PreTrainedTokenizerBase

from lmrpc.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.grammar import GrammarBackend, GrammarError, GrammarMatcher, MaskFiller
from lmrpc.server.engine.types import (
    Constraint,
    ConstraintKind,
    EngineRequest,
    Finish,
    FinishReason,
    LogprobOptions,
    SamplingParams,
)

VOCAB = 49152
GRAMMAR_END, LENGTH = FinishReason.GRAMMAR_END, FinishReason.LENGTH

# ---- constraints used throughout -----------------------------------------------------------------------------------

# (task for the model, schema): nested objects, arrays, enums, integer/number bounds, string patterns, required and
# optional fields.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a person named Alice who is 30.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 150}},
      "required": ["name", "age"], "additionalProperties": False}),
    ("List three fruits.",
     {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                  "minItems": 3, "maxItems": 3}},
      "required": ["fruits"], "additionalProperties": False}),
    ("What color is the sky?",
     {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
      "required": ["color"]}),
    ("Give the temperature in Paris.",
     {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                       "celsius": {"type": "number", "minimum": -50, "maximum": 60}},
      "required": ["city", "celsius"], "additionalProperties": False}),
    ("Give a US phone number.",
     {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}},
      "required": ["phone"], "additionalProperties": False}),
    ("Describe a book with its author.",
     {"type": "object",
      "properties": {"title": {"type": "string", "maxLength": 40},
                     "author": {"type": "object",
                                "properties": {"first": {"type": "string", "maxLength": 20},
                                               "last": {"type": "string", "maxLength": 20}},
                                "required": ["first", "last"], "additionalProperties": False},
                     "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
      "required": ["title", "author"], "additionalProperties": False}),
    ("List two points with x and y.",
     {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                 "required": ["x", "y"], "additionalProperties": False},
      "minItems": 2, "maxItems": 2}),
    ("Is water wet?",
     {"type": "object", "properties": {"answer": {"type": "boolean"},
                                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["answer"], "additionalProperties": False}),
    ("Give a product with a price and tags.",
     {"type": "object",
      "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                     "price": {"type": "number", "exclusiveMinimum": 0},
                     "tags": {"type": "array", "items": {"type": "string", "enum": ["new", "sale", "eco"]},
                              "maxItems": 3},
                     "note": {"type": ["string", "null"], "maxLength": 30}},
      "required": ["sku", "price"], "additionalProperties": False}),
    ("Report the status of a job.",
     {"type": "object",
      "properties": {"status": {"enum": ["queued", "running", "done"]},
                     "progress": {"type": "integer", "minimum": 0, "maximum": 100},
                     "errors": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2}},
      "required": ["status", "progress"], "additionalProperties": False}),
]

EMAIL = r"[a-z][a-z0-9._]{0,19}@[a-z]{1,15}\.(com|org|net)"
ISO_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
REGEXES: list[tuple[str, str]] = [
    (r"(Hello|Hi|Hey)", "Greet me with one word."),
    (r"\d{3}-\d{4}", "Give me a phone number like 555-1234."),
    (r"#[0-9A-F]{6}", "Give a hex color code."),
    (EMAIL, "Give an example e-mail address."),
    (ISO_DATE, "Give a date in ISO format."),
]

JSON_GBNF = r"""root ::= object
object ::= "{" ws ( pair ( "," ws pair )* )? ws "}"
pair ::= string ":" ws value
value ::= object | array | string | number | "true" | "false" | "null"
array ::= "[" ws ( value ( "," ws value )* )? ws "]"
string ::= "\"" [a-zA-Z0-9 ]* "\""
number ::= "-"? [0-9]+ ( "." [0-9]+ )?
ws ::= [ \n]*"""
DIGITS_GBNF = 'root ::= digit ("," digit){0,4}\ndigit ::= [0-9]'
YES_NO_GBNF = 'root ::= "yes" | "no" | "maybe"'


def _is_json_object(text: str) -> bool:
    return isinstance(json.loads(text), dict)


# (grammar, task, what a complete output satisfies)
EBNFS: list[tuple[str, str, Any]] = [
    (YES_NO_GBNF, "Is the sky blue? Answer yes, no or maybe.", lambda t: t in {"yes", "no", "maybe"}),
    (DIGITS_GBNF, "List the digits from 1 to 5, separated by commas.",
     lambda t: re.fullmatch(r"[0-9](,[0-9]){0,4}", t) is not None),
    (JSON_GBNF, 'Give a JSON object with the keys "name" and "age" for a cat.', _is_json_object),
]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
         "required": ["timezone"], "additionalProperties": False}
TOOLS_TAG = {
    "type": "structural_tag",
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": CLOCK, "end": "</function>"},
    ],
    "triggers": ["<function="],
}
CALL = re.compile(r"<function=(get_weather|get_time)>(.*?)</function>", re.DOTALL)


def json_constraint(schema: dict[str, Any], flexible: bool | None = None) -> Constraint:
    return Constraint("json_schema", json.dumps(schema), flexible)


# ---- matcher-level helpers -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer: PreTrainedTokenizerBase) -> GrammarBackend:
    return GrammarBackend(smollm2_tokenizer, VOCAB)


def feed(backend: GrammarBackend, constraint: Constraint, token_ids: list[int]) -> GrammarMatcher | None:
    """A fresh matcher fed `token_ids`; None if the grammar rejects one of them."""
    matcher = backend.new_matcher(constraint)
    for token in token_ids:
        if matcher.is_finished:
            return None  # the grammar had ended: nothing may follow
        matcher.advance(token)
        if matcher.error is not None:
            return None
    return matcher


def accepts(backend: GrammarBackend, tokenizer: PreTrainedTokenizerBase, constraint: Constraint, text: str) -> bool:
    """The whole text is a complete output of the constraint."""
    matcher = feed(backend, constraint, tokenizer.encode(text, add_special_tokens=False))
    return matcher is not None and bool(matcher.matcher.is_accepting())


def prefix_ok(backend: GrammarBackend, tokenizer: PreTrainedTokenizerBase, constraint: Constraint, text: str) -> bool:
    """The text can be continued into a complete output (it breaks no rule so far)."""
    return feed(backend, constraint, tokenizer.encode(text, add_special_tokens=False)) is not None


# ---- structural tags -----------------------------------------------------------------------------------------------


def test_structural_tag_free_text_and_valid_calls_pass(backend: GrammarBackend,
                                                       smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    tag = Constraint("structural_tag", json.dumps(TOOLS_TAG))
    for text in [
        "No tool needed: it is sunny.",
        '<function=get_weather>{"city": "Paris", "unit": "celsius"}</function>',
        'Let me check. <function=get_weather>{"city": "Oslo", "unit": "fahrenheit"}</function> Done.',
        '<function=get_time>{"timezone": "UTC"}</function>\n<function=get_weather>{"city": "Rome", '
        '"unit": "celsius"}</function>',
    ]:
        assert accepts(backend, smollm2_tokenizer, tag, text), text


@pytest.mark.parametrize("text", [
    '<function=get_weather>{"city": "Paris"}</function>',  # a required argument missing
    '<function=get_weather>{"city": "Paris", "unit": "kelvin"}</function>',  # not in the enum
    '<function=get_weather>{"city": "Paris", "unit": "celsius", "x": 1}</function>',  # additionalProperties
    '<function=get_stock>{"symbol": "X"}</function>',  # no such structure after the trigger
    '<function=get_weather>{"city": "Paris", "unit": "celsius"}</tool>',  # wrong end
    'text <function=get_weather>not json</function>',
])
def test_structural_tag_bad_calls_are_rejected(backend: GrammarBackend, smollm2_tokenizer: PreTrainedTokenizerBase,
                                               text: str) -> None:
    tag = Constraint("structural_tag", json.dumps(TOOLS_TAG))
    assert not accepts(backend, smollm2_tokenizer, tag, text)


def test_structural_tag_schema_forms(backend: GrammarBackend, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    """A schema may come as JSON text or as `true`, like SGLang's dicts; a begin may start with any trigger."""
    tag = Constraint("structural_tag", json.dumps({
        "structures": [{"begin": "<f=n>", "schema": json.dumps({"type": "integer"}), "end": "</f>"},
                       {"begin": "<f=any>", "schema": True, "end": "</f>"},
                       {"begin": "[[x", "schema": {"enum": ["a"]}, "end": "]]"}],
        "triggers": ["<f=", "[["],
    }))
    assert accepts(backend, smollm2_tokenizer, tag, 'a <f=n>42</f> b <f=any>[1, "x"]</f> c [[x"a"]] d')
    assert not accepts(backend, smollm2_tokenizer, tag, "a <f=n>4.5</f>")
    assert not accepts(backend, smollm2_tokenizer, tag, 'a [[x"b"]]')


def test_structural_tag_unfinished_call_is_not_complete(backend: GrammarBackend,
                                                        smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    tag = Constraint("structural_tag", json.dumps(TOOLS_TAG))
    text = 'Sure: <function=get_weather>{"city": "Paris"'
    assert prefix_ok(backend, smollm2_tokenizer, tag, text)
    assert not accepts(backend, smollm2_tokenizer, tag, text)


def test_structural_tag_special_token_trigger(backend: GrammarBackend,
                                              smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    """A trigger that is a special token is matched as that token (a model emits it as one token)."""
    tag = Constraint("structural_tag", json.dumps({
        "structures": [{"begin": "<|im_start|>call", "schema": {"type": "integer"}, "end": "<|im_end|>"}],
        "triggers": ["<|im_start|>"],
    }))
    start, end = smollm2_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    text = smollm2_tokenizer.encode("Here: ", add_special_tokens=False)
    call = smollm2_tokenizer.encode("call42", add_special_tokens=False)
    matcher = feed(backend, tag, [*text, start, *call, end])
    assert matcher is not None and matcher.is_finished
    assert feed(backend, tag, [*text, start, *smollm2_tokenizer.encode("call4x", add_special_tokens=False)]) is None


def test_structural_tag_json_whitespace_option_reaches_the_schemas(
        backend: GrammarBackend, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    loose = '<function=get_time>{ "timezone" : "UTC" }</function>'
    tight = '<function=get_time>{"timezone": "UTC"}</function>'
    text = json.dumps(TOOLS_TAG)
    assert accepts(backend, smollm2_tokenizer, Constraint("structural_tag", text), loose)
    assert not accepts(backend, smollm2_tokenizer, Constraint("structural_tag", text, False), loose)
    assert accepts(backend, smollm2_tokenizer, Constraint("structural_tag", text, False), tight)
    odd = json.dumps({"structures": [{"begin": "<f>", "schema": {"x-guidance": "junk"}, "end": ""}],
                      "triggers": ["<f"]})
    assert backend.check(Constraint("structural_tag", odd, False)) is None  # the option replaces a malformed one


STRUCTURE = {"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}


@pytest.mark.parametrize(("tag", "message"), [
    ("not json", "not valid JSON"),
    ("[]", "expected a JSON object"),
    (json.dumps({"type": "json_schema", "structures": [STRUCTURE], "triggers": ["<f="]}), '"type" must be'),
    (json.dumps({"structures": [STRUCTURE]}), '"triggers" must be a non-empty list'),
    (json.dumps({"structures": [STRUCTURE], "triggers": [""]}), "non-empty strings"),
    (json.dumps({"structures": [], "triggers": ["<f="]}), '"structures" must be a non-empty list'),
    (json.dumps({"structures": [{**STRUCTURE, "begin": "<g>"}], "triggers": ["<f="]}), "starts with none of"),
    (json.dumps({"structures": [STRUCTURE], "triggers": ["<f=", "<h"]}), "starts no structure's begin"),
    (json.dumps({"structures": [{**STRUCTURE, "schema": 3}], "triggers": ["<f="]}), "schema must be"),
    (json.dumps({"structures": [{**STRUCTURE, "schema": False}], "triggers": ["<f="]}), "nothing matches"),
    (json.dumps({"structures": [{**STRUCTURE, "schema": "{nope"}], "triggers": ["<f="]}), "schema is not valid JSON"),
    (json.dumps({"structures": [{**STRUCTURE, "end": None}], "triggers": ["<f="]}), "end must be a string"),
    (json.dumps({"structures": [{**STRUCTURE, "schema": {"type": "objekt"}}], "triggers": ["<f="]}), "objekt"),
    (json.dumps({"structures": [STRUCTURE], "triggers": ["<f="], "extra": 1}), "unknown key"),
    (json.dumps({"type": "structural_tag", "format": {"type": "triggered_tags"}}), '"format" form'),
])
def test_invalid_structural_tag_names_the_kind(backend: GrammarBackend, tag: str, message: str) -> None:
    with pytest.raises(GrammarError) as err:
        backend.compile(Constraint("structural_tag", tag))
    assert err.value.kind == "structural_tag"
    assert str(err.value).startswith("invalid structural_tag: ")
    assert message in err.value.message


# ---- JSON whitespace, regex classes, compiler errors ---------------------------------------------------------------


def test_json_whitespace_flexible_option(backend: GrammarBackend, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}}}
    loose, dumps, compact = '{ "a" : 1,\n "b": [ ] }', '{"a": 1, "b": []}', '{"a":1,"b":[]}'
    for flexible in (None, True):  # unset: llguidance's default, any whitespace
        for text in (loose, dumps, compact):
            assert accepts(backend, smollm2_tokenizer, json_constraint(schema, flexible), text), (flexible, text)
    rigid = json_constraint(schema, False)
    assert accepts(backend, smollm2_tokenizer, rigid, dumps)
    assert not accepts(backend, smollm2_tokenizer, rigid, loose)
    assert not accepts(backend, smollm2_tokenizer, rigid, compact)
    # The request's option beats the schema's own x-guidance; unset, the schema's x-guidance holds.
    own = {**schema, "x-guidance": {"whitespace_flexible": False}}
    assert not accepts(backend, smollm2_tokenizer, json_constraint(own), loose)
    assert accepts(backend, smollm2_tokenizer, json_constraint(own, True), loose)
    # The option is part of the cache key.
    assert backend.compile(json_constraint(schema, False)) != backend.compile(json_constraint(schema, True))
    # The schema `true` (anything) takes the option too.
    assert accepts(backend, smollm2_tokenizer, Constraint("json_schema", "true", False), dumps)
    assert not accepts(backend, smollm2_tokenizer, Constraint("json_schema", "true", False), loose)


def test_regex_digit_and_word_classes_are_ascii(backend: GrammarBackend,
                                                smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    phone = Constraint("regex", r"\d{3}-\d{4}")
    assert accepts(backend, smollm2_tokenizer, phone, "555-1234")
    assert not accepts(backend, smollm2_tokenizer, phone, "٥٥٥-١٢٣٤")  # Arabic-Indic digits are Unicode \d
    word = Constraint("regex", r"\w+")
    assert accepts(backend, smollm2_tokenizer, word, "abc_123")
    assert not accepts(backend, smollm2_tokenizer, word, "héllo")
    slash = Constraint("regex", r"a/b")  # a "/" must survive the trip through Lark's /.../
    assert accepts(backend, smollm2_tokenizer, slash, "a/b")


@pytest.mark.parametrize(("kind", "text", "message"), [
    ("json_schema", '{"type": "objekt"}', "Invalid type: objekt"),
    ("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}', "/nope"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "a JSON schema is an object"),
    ("json_schema", "false", "nothing matches"),
    ("json_schema", '{"type": "string", "pattern": "(a"}', "unclosed group"),
    ("regex", "(abc", "unclosed group"),
    ("regex", "a{2,1}", "invalid repetition count"),
    ("regex", "abc\\", "lone backslash"),
    ("ebnf", 'root ::= "a" | missing_rule', "missing_rule"),
    ("ebnf", "root ::= (", "Expected ')'"),
])
def test_invalid_constraints_carry_the_compiler_message(backend: GrammarBackend, kind: ConstraintKind, text: str,
                                                        message: str) -> None:
    assert backend.check(Constraint(kind, text)) is not None
    with pytest.raises(GrammarError) as err:
        backend.compile(Constraint(kind, text))
    assert err.value.kind == kind
    assert str(err.value).startswith(f"invalid {kind}: ")
    assert message in err.value.message


def test_ebnf_takes_lark_too(backend: GrammarBackend, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    lark = Constraint("ebnf", 'start: DIGIT ("," DIGIT)*\nDIGIT: /[0-9]/')
    assert accepts(backend, smollm2_tokenizer, lark, "1,2,3")
    assert not accepts(backend, smollm2_tokenizer, lark, "1,,2")


# ---- engine helpers ------------------------------------------------------------------------------------------------


def make_engine(model_dir: Path) -> AsyncEngine:
    config = EngineConfig(
        model=ModelConfig(path=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(page_size=16, num_tokens=16384),
        scheduler=SchedulerConfig(max_running_requests=64, max_batched_tokens=512, max_prefill_chunk=512),
        sampling_defaults="openai",
    )
    return AsyncEngine.start(config)


@dataclass(frozen=True)
class Result:
    token_ids: list[int]
    text: str
    finish: Finish


_serial = iter(range(10**9))


def request(prompt: list[int], params: SamplingParams, *, share: str | None = None) -> EngineRequest:
    rid = f"g{next(_serial)}"
    return EngineRequest(request_id=rid, rid=rid, index=0, prompt_ids=tuple(prompt), params=params,
                         share_prefill_with=share)


async def run(engine: AsyncEngine, reqs: list[EngineRequest]) -> list[Result]:
    """Each request's merged output, in request order."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    texts: dict[str, list[str]] = {r.request_id: [] for r in reqs}
    finishes: dict[str, Finish] = {}
    async for out in engine.generate(reqs):
        tokens[out.request_id].extend(out.token_ids)
        texts[out.request_id].append(out.text)
        if out.finish is not None:
            finishes[out.request_id] = out.finish
    return [Result(tokens[r.request_id], "".join(texts[r.request_id]), finishes[r.request_id]) for r in reqs]


def chat(tokenizer: PreTrainedTokenizerBase, *turns: str, system: str | None = None) -> list[int]:
    """The model's chat template over alternating user/assistant turns, ready for the assistant to answer."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    return list(tokenizer.encode(text, add_special_tokens=False))


def assert_obeys(backend: GrammarBackend, constraint: Constraint, result: Result) -> None:
    """The output never broke the grammar, and GRAMMAR_END came exactly when the grammar ended. (LENGTH wins when
    both happen on the last allowed token.)"""
    assert result.finish.reason in (GRAMMAR_END, LENGTH), result.finish
    matcher = feed(backend, constraint, result.token_ids)
    assert matcher is not None, f"output breaks its {constraint.kind}: {result.text!r}"
    if result.finish.reason is GRAMMAR_END:
        assert matcher.is_finished, result


def validate_json(result: Result, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(result.text), schema)


# ---- the random-weight tiny model: garbage, but grammatical garbage ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Path) -> Iterator[AsyncEngine]:
    eng = make_engine(tiny_llama_dir)
    yield eng
    eng.shutdown()


async def test_tiny_model_obeys_every_kind(tiny_engine: AsyncEngine,
                                           smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = smollm2_tokenizer.encode("Output:", add_special_tokens=False)
    cases: list[tuple[Constraint, Any]] = [(json_constraint(s), s) for _, s in SCHEMAS[:5]]
    cases += [(json_constraint(s, False), s) for _, s in SCHEMAS[5:]]
    cases += [(Constraint("regex", pattern), pattern) for pattern, _ in REGEXES]
    cases += [(Constraint("ebnf", grammar), check) for grammar, _, check in EBNFS]
    cases.append((Constraint("structural_tag", json.dumps(TOOLS_TAG)), None))
    reqs = [request(prompt, SamplingParams(max_new_tokens=48, temperature=1.0, seed=i, constraint=c))
            for i, (c, _) in enumerate(cases)]
    results = await run(tiny_engine, reqs)
    backend = tiny_engine.grammar
    for (constraint, check), result in zip(cases, results, strict=True):
        assert_obeys(backend, constraint, result)
        if result.finish.reason is not GRAMMAR_END:
            continue
        if constraint.kind == "json_schema":
            validate_json(result, check)
        elif constraint.kind == "regex":
            assert re.fullmatch(check, result.text, re.ASCII), result.text
        elif constraint.kind == "ebnf":
            assert check(result.text), result.text
    # Every regex is bounded well under 48 tokens, so each one must have ended by its grammar.
    regex_results = [r for (c, _), r in zip(cases, results, strict=True) if c.kind == "regex"]
    assert all(r.finish.reason is GRAMMAR_END for r in regex_results), regex_results


# ---- the real model ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_engine(smollm2_gguf: Path) -> Iterator[AsyncEngine]:
    eng = make_engine(smollm2_gguf)
    yield eng
    eng.shutdown()


async def test_json_schemas_validate(real_engine: AsyncEngine, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    reqs = [request(chat(smollm2_tokenizer, f"{task} Answer in JSON only."),
                    SamplingParams(max_new_tokens=160, temperature=0.0, constraint=json_constraint(schema)))
            for task, schema in SCHEMAS]
    results = await run(real_engine, reqs)
    for (_, schema), result in zip(SCHEMAS, results, strict=True):
        assert_obeys(real_engine.grammar, json_constraint(schema), result)
        if result.finish.reason is GRAMMAR_END:
            validate_json(result, schema)
    ended = sum(r.finish.reason is GRAMMAR_END for r in results)
    assert ended >= 8, [r.text for r in results if r.finish.reason is not GRAMMAR_END]



async def test_greedy_rows_sample_before_their_mask_and_get_the_masked_token(
        real_engine: AsyncEngine, smollm2_tokenizer: PreTrainedTokenizerBase,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows without logprobs are sampled unmasked and masked only when the grammar rejects the token
    (LiveRequest.lazy_grammar); asking for logprobs masks every step up front. Both give the same tokens, and the
    rejection path runs (the model's unmasked choice breaks the schema at some steps)."""
    filled_now: list[int] = []
    original = MaskFiller.fill_now

    def counting(self: MaskFiller, matchers: list[GrammarMatcher]) -> Any:
        filled_now.append(len(matchers))
        return original(self, matchers)

    monkeypatch.setattr(MaskFiller, "fill_now", counting)
    picked = [SCHEMAS[i] for i in (0, 3, 7)]
    prompts = [chat(smollm2_tokenizer, f"{task} Answer in JSON only.") for task, _ in picked]

    def params(schema: dict[str, Any]) -> SamplingParams:
        return SamplingParams(max_new_tokens=96, temperature=0.0, constraint=json_constraint(schema))

    lazy = await run(real_engine, [request(p, params(s)) for p, (_, s) in zip(prompts, picked, strict=True)])
    assert sum(filled_now) > 0  # some unmasked choices were rejected and sampled again with their mask
    eager_reqs = [dataclasses.replace(request(p, params(s)), logprobs=LogprobOptions())
                  for p, (_, s) in zip(prompts, picked, strict=True)]
    filled_now.clear()
    eager = await run(real_engine, eager_reqs)
    assert filled_now == []  # rows with logprobs never take the lazy path
    for (_, schema), a, b in zip(picked, lazy, eager, strict=True):
        assert a.token_ids == b.token_ids and a.finish == b.finish
        assert_obeys(real_engine.grammar, json_constraint(schema), a)

def _dumps_layout(text: str) -> bool:
    """No whitespace outside strings except exactly one space after each ',' and ':' (json.dumps' layout)."""
    skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return re.search(r"[,:](?! )", skeleton) is None and re.search(r"\s", re.sub(r"([,:]) ", r"\1", skeleton)) is None


async def test_rigid_json_layout(real_engine: AsyncEngine, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    picked = [SCHEMAS[i] for i in (0, 5, 6, 9)]
    reqs = [request(chat(smollm2_tokenizer, f"{task} Answer in JSON only."),
                    SamplingParams(max_new_tokens=96, temperature=0.7, seed=7,
                                   constraint=json_constraint(schema, False)))
            for task, schema in picked]
    results = await run(real_engine, reqs)
    for (_, schema), result in zip(picked, results, strict=True):
        assert_obeys(real_engine.grammar, json_constraint(schema, False), result)
        assert result.finish.reason is GRAMMAR_END, result.text  # these schemas bound the output's length
        validate_json(result, schema)
        assert _dumps_layout(result.text), result.text


async def test_regex_samples_match(real_engine: AsyncEngine, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    reqs: list[EngineRequest] = []
    for pattern, task in REGEXES:
        prompt = chat(smollm2_tokenizer, task)
        first = None
        for seed in range(3):  # n=3 samples, as the service builds them
            params = SamplingParams(max_new_tokens=48, temperature=0.7, seed=seed,
                                    constraint=Constraint("regex", pattern))
            req = request(prompt, params, share=first)
            first = first or req.request_id
            reqs.append(req)
    results = await run(real_engine, reqs)
    for i, result in enumerate(results):
        pattern = REGEXES[i // 3][0]
        assert result.finish.reason is GRAMMAR_END, (pattern, result)
        assert re.fullmatch(pattern, result.text, re.ASCII), (pattern, result.text)


async def test_ebnf_grammars_hold(real_engine: AsyncEngine, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    reqs = [request(chat(smollm2_tokenizer, task),
                    SamplingParams(max_new_tokens=96, temperature=0.0, constraint=Constraint("ebnf", grammar)))
            for grammar, task, _ in EBNFS]
    results = await run(real_engine, reqs)
    for (grammar, _, check), result in zip(EBNFS, results, strict=True):
        assert_obeys(real_engine.grammar, Constraint("ebnf", grammar), result)
        if result.finish.reason is GRAMMAR_END:
            assert check(result.text), result.text
    assert sum(r.finish.reason is GRAMMAR_END for r in results) >= 2, results


async def test_structural_tag_tool_call(real_engine: AsyncEngine, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    system = ("You are an assistant with two tools, get_weather and get_time. Call one by writing "
              '<function=NAME>{ARGUMENTS AS JSON}</function>.')
    example = '<function=get_weather>{"city": "Rome", "unit": "celsius"}</function>'
    constraint = Constraint("structural_tag", json.dumps(TOOLS_TAG))
    reqs = [request(chat(smollm2_tokenizer, "What is the weather in Rome?", example, question, system=system),
                    SamplingParams(max_new_tokens=64, temperature=0.0, constraint=constraint))
            for question in ("What is the weather in Paris?", "And in Tokyo?")]
    results = await run(real_engine, reqs)
    schemas = {"get_weather": WEATHER, "get_time": CLOCK}
    for result in results:
        assert_obeys(real_engine.grammar, constraint, result)
        calls = CALL.findall(result.text)
        assert calls, f"no tool call in {result.text!r}"
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
        assert result.text.count("<function=") == len(calls)  # every trigger became a complete call


TOPICS = ["the sea", "a cat", "mountains", "coffee", "the moon", "a library", "rain", "bicycles", "music", "bread",
          "winter", "a robot", "gardens", "trains", "the desert", "chess", "a lighthouse", "volcanoes", "tea", "owls"]

# Bounded schemas (enums, bounded integers, patterns, rigid whitespace): every output ends well within 64 tokens.
BOUNDED: list[tuple[str, dict[str, Any]]] = [
    ("What color is the sky?", SCHEMAS[2][1]),
    ("Give a US phone number.", SCHEMAS[4][1]),
    ("Report the status of a job.",
     {"type": "object", "properties": {"status": {"enum": ["queued", "running", "done"]},
                                       "progress": {"type": "integer", "minimum": 0, "maximum": 100}},
      "required": ["status", "progress"], "additionalProperties": False}),
    ("Is water wet?", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
                       "additionalProperties": False}),
    ("Give a product code.", {"type": "object", "properties": {"sku": {"type": "string",
                                                                       "pattern": "^[A-Z]{3}[0-9]{3}$"}},
                              "required": ["sku"], "additionalProperties": False}),
]


async def test_forty_concurrent_half_constrained(real_engine: AsyncEngine,
                                                 smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    free_prompts = [chat(smollm2_tokenizer, f"Write one sentence about {topic}.") for topic in TOPICS]
    free = SamplingParams(max_new_tokens=8, temperature=0.0)
    solo = [(await run(real_engine, [request(p, free)]))[0].token_ids for p in free_prompts]

    constrained: list[tuple[EngineRequest, Constraint, Any]] = []
    for i in range(20):
        if i % 2 == 0:
            task, schema = BOUNDED[(i // 2) % len(BOUNDED)]
            constraint, check = json_constraint(schema, False), schema
        else:
            pattern, task = REGEXES[(i // 2) % len(REGEXES)]
            constraint, check = Constraint("regex", pattern), pattern
        params = SamplingParams(max_new_tokens=64, temperature=0.7, seed=i, constraint=constraint)
        constrained.append((request(chat(smollm2_tokenizer, task), params), constraint, check))
    free_reqs = [request(p, free) for p in free_prompts]
    mixed: list[EngineRequest] = [r for pair in zip(free_reqs, (c[0] for c in constrained), strict=True)
                                  for r in pair]
    results = dict(zip((r.request_id for r in mixed), await asyncio.wait_for(run(real_engine, mixed), 300),
                       strict=True))

    for i, req in enumerate(free_reqs):
        assert results[req.request_id].token_ids == solo[i], f"free prompt {i} changed next to constrained ones"
    for req, constraint, check in constrained:
        result = results[req.request_id]
        assert_obeys(real_engine.grammar, constraint, result)
        assert result.finish.reason is GRAMMAR_END, result
        if constraint.kind == "json_schema":
            validate_json(result, check)
            assert _dumps_layout(result.text), result.text
        else:
            assert re.fullmatch(check, result.text, re.ASCII), result.text


def test_mask_filler_fills_constrained_rows_off_thread(backend: GrammarBackend,
                                                       smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    filler = MaskFiller(backend)
    try:
        assert filler.start([None, None]).wait() is None  # nothing constrained: no masks at all
        yes_no = backend.new_matcher(Constraint("regex", "(yes|no)"))
        digit = backend.new_matcher(Constraint("regex", "[0-9]"))
        masks = filler.start([yes_no, None, digit]).wait()
        assert masks is not None and masks.shape == (3, (VOCAB + 31) // 32)
        allowed = [{t for t in range(VOCAB) if masks[r, t // 32] >> (t % 32) & 1} for r in range(3)]
        assert len(allowed[1]) == VOCAB  # the unconstrained row allows everything
        assert smollm2_tokenizer.encode("yes", add_special_tokens=False)[0] in allowed[0]
        assert all(smollm2_tokenizer.decode([t]).strip() in "0123456789" for t in allowed[2])
        assert 0 < len(allowed[0]) < 100 and 0 < len(allowed[2]) < 100
        # The buffer is reused: a later fill of fewer rows starts from all-allowed again.
        again = filler.start([None, digit]).wait()
        assert again is not None and bool((again[0] == -1).all())
    finally:
        filler.shutdown()
