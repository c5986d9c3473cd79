"""Structured-output grammars can never take the server down: GrammarLimits checked on the text before any parse
(size, nesting depth, rules and $ref targets), llguidance's compiles on deep-stack threads, grammars with an empty
language refused at the check, compiler messages short and readable.

What could crash the process (a native stack overflow) runs in a subprocess, so a regression fails a test instead
of ending the test run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from lmrpc.server.engine import grammar as grammar_module
from lmrpc.server.engine.grammar import GrammarBackend, GrammarError
from lmrpc.server.engine.grammar_limits import (
    DEFAULT_MAX_GRAMMAR_BYTES,
    DEFAULT_MAX_GRAMMAR_DEPTH,
    DEFAULT_MAX_GRAMMAR_RULES,
    MAX_MESSAGE_CHARS,
    GrammarLimits,
    grammar_shape,
    json_shape,
    readable,
)
from lmrpc.server.engine.types import Constraint, ConstraintKind

VOCAB = 49152


def gbnf_chain(rules: int) -> str:
    """root plus `rules - 1` chained rules: r0 ::= "x" r1 | "y", ... (what crashed the compiler at 5,000)."""
    links = [f'r{i} ::= "x" r{i + 1} | "y"' for i in range(rules - 2)]
    return "\n".join(["root ::= r0", *links, f'r{rules - 2} ::= "y"'])


def lark_chain(rules: int) -> str:
    links = [f'r{i}: "x" r{i + 1} | "y"' for i in range(rules - 2)]
    return "\n".join(["start: r0", *links, f'r{rules - 2}: "y"'])


def ref_chain(refs: int) -> str:
    """A schema whose $defs chain: a0 -> a1 -> ... (one distinct $ref target per link)."""
    defs = {f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}} for i in range(refs - 1)}
    defs[f"a{refs - 1}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/a0", "$defs": defs})


def nested_schema(levels: int) -> str:
    """{"type": "object", "properties": {"a": ...}} nested `levels` times, as text (json.dumps would recurse)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer: PreTrainedTokenizerBase) -> GrammarBackend:
    return GrammarBackend(smollm2_tokenizer, VOCAB)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: PreTrainedTokenizerBase) -> Path:
    """The tokenizer saved as files: a subprocess loads it in a second, not the GGUF's 15 s."""
    path = tmp_path_factory.mktemp("tokenizer")
    smollm2_tokenizer.save_pretrained(path)
    return path


def refused(backend: GrammarBackend, constraint: Constraint) -> str:
    """The check's message (it must refuse), also raised as GrammarError by compile and new_matcher."""
    message = backend.check(constraint)
    assert message is not None
    for call in (backend.compile, backend.new_matcher):
        with pytest.raises(GrammarError) as err:
            call(constraint)
        assert str(err.value) == message
    return message


# ---- the limits and the scans ------------------------------------------------------------------------------------


def test_defaults_and_validation() -> None:
    limits = GrammarLimits()
    assert (limits.max_grammar_bytes, limits.max_grammar_depth, limits.max_grammar_rules) == (
        DEFAULT_MAX_GRAMMAR_BYTES, DEFAULT_MAX_GRAMMAR_DEPTH, DEFAULT_MAX_GRAMMAR_RULES) == (262144, 64, 1000)
    for bad in [{"max_grammar_bytes": 0}, {"max_grammar_depth": 0}, {"max_grammar_depth": 129},
                {"max_grammar_rules": 0}, {"max_grammar_rules": 10_001}]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            GrammarLimits(**bad)


def test_json_shape_counts_brackets_outside_strings() -> None:
    assert json_shape('{"a": [1, {"b": []}]}').depth == 4
    # brackets and quotes inside strings (escaped quotes, backslashes) are text, not structure
    assert json_shape(r'{"a": "[[[{{{\"]]]", "b\\": "\\"}').depth == 1
    assert json_shape(nested_schema(990)).depth == 990 * 2 + 1
    # distinct $ref targets; "$ref" as a value or inside a string is not one
    text = '{"x": {"$ref": "#/a"}, "y": {"$ref" : "#/a"}, "z": {"$ref": "#/b"}, "w": "$ref", "v": "\\"$ref\\": 1"}'
    assert json_shape(text).refs == 2
    assert json_shape(ref_chain(5000)).refs == 5000


def test_grammar_shape_gbnf_and_lark() -> None:
    gbnf = 'root ::= ( "a" ( "(" | [()] ) )* # a comment ( ( (\nx ::= "::=" | "\\"(" y\ny ::= [^"\\]] "b"'
    assert (grammar_shape(gbnf).rules, grammar_shape(gbnf).depth) == (3, 2)
    lark = textwrap.dedent('''\
        // a comment: b: ((((
        start: a+ "(:" /[(]+\\/(/ b
        ?a.2: ("a" ["b" ("c")])
        B[lazy]: /x/
            | "y:"
        b: %json {"type": "object", "properties": {"x": {"$ref": "#/$defs/y"}}, "$defs": {"y": {}}}
    ''')
    shape = grammar_shape(lark)
    assert (shape.rules, shape.depth, shape.refs) == (4, 3, 1)
    assert grammar_shape(gbnf_chain(5000)).rules == 5000


def test_readable_cuts_compiler_messages() -> None:
    dump = 'NoExtensionBias\n<state>\nTokens: ⟦⟧\n0 tokens, 0 bytes; grm_prefix: ""\nParser: {\n  "rows": []}'
    assert readable(dump) == readable("NoExtensionBias\n<non-verbose/>") == "NoExtensionBias"
    regex = 'at 1(8): invalid regex "(abc" (in regex): regex parse error:\n    (abc\n    ^\nerror: unclosed group\n' \
            '   1 | start: /(abc/\n              ^\n'
    assert readable(regex) == 'unclosed group (at 1(8): invalid regex "(abc" (in regex): regex parse error: (abc)'
    long = readable("x" * 1000)
    assert len(long) == MAX_MESSAGE_CHARS and long.endswith("…")


# ---- each limit refused quickly, by name -------------------------------------------------------------------------


@pytest.mark.parametrize("levels", [990, 1200, 5000])
def test_deep_json_schema_is_refused_without_recursion(backend: GrammarBackend, levels: int) -> None:
    start = time.monotonic()
    message = refused(backend, Constraint("json_schema", nested_schema(levels)))
    assert time.monotonic() - start < 2.0
    assert message == (f"invalid json_schema: the schema nests {2 * levels + 1} levels deep; the server takes at "
                       "most 64 (--max-grammar-depth)")


def test_rule_chain_past_the_limit_is_refused_before_parsing(backend: GrammarBackend) -> None:
    for text in (gbnf_chain(5000), lark_chain(5000), gbnf_chain(1001)):
        start = time.monotonic()
        message = refused(backend, Constraint("ebnf", text))
        assert time.monotonic() - start < 1.0  # converting a 5,000-rule GBNF chain alone takes ~30 s
        assert "rules; the server takes at most 1000 (--max-grammar-rules)" in message


def test_grammars_at_the_limits_still_compile(backend: GrammarBackend,
                                              smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    assert backend.check(Constraint("ebnf", gbnf_chain(1000))) is None  # the worst case: GBNF conversion ~1.6 s
    assert backend.check(Constraint("ebnf", lark_chain(1000))) is None
    assert backend.check(Constraint("json_schema", ref_chain(1000))) is None
    assert backend.check(Constraint("json_schema", nested_schema(31))) is None  # 63 levels
    matcher = backend.new_matcher(Constraint("ebnf", lark_chain(1000)))
    (x,) = smollm2_tokenizer.encode("x", add_special_tokens=False)
    for _ in range(50):
        matcher.advance(x)
    assert matcher.error is None and not matcher.is_finished


def test_ref_chain_and_size_and_depth_of_other_kinds(backend: GrammarBackend) -> None:
    assert "the schema refers to 1001 distinct $ref targets; the server takes at most 1000 (--max-grammar-rules)" \
        in refused(backend, Constraint("json_schema", ref_chain(1001)))
    big = "a" * (DEFAULT_MAX_GRAMMAR_BYTES + 1)
    assert refused(backend, Constraint("regex", big)) == (
        f"invalid regex: the pattern is {len(big)} bytes; the server takes at most 262144 (--max-grammar-bytes)")
    wide = json.dumps({"description": "é" * 140_000}, ensure_ascii=False)  # 140,000 characters, 280,000 bytes
    assert "the schema is 280019 bytes" in refused(backend, Constraint("json_schema", wide))
    parens = "root ::= " + "(" * 500 + '"a"' + ")" * 500  # past ~200 llguidance's GBNF converter hits recursion
    assert "the grammar nests 500 levels deep" in refused(backend, Constraint("ebnf", parens))
    lark_json = 'start: %json ' + nested_schema(100)
    assert "the grammar nests 201 levels deep" in refused(backend, Constraint("ebnf", lark_json))


def test_structural_tag_schemas_are_held_to_the_limits(backend: GrammarBackend) -> None:
    def tag(schema: object) -> Constraint:
        return Constraint("structural_tag", json.dumps(
            {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]}))

    ok = json.loads(nested_schema(31))
    assert backend.check(tag(ok)) is None
    assert backend.check(tag(json.dumps(ok))) is None  # the schema as JSON text
    deep_text = Constraint("structural_tag", '{"structures": [{"begin": "<f>", "end": "", "schema": '
                           f'{nested_schema(5000)}}}], "triggers": ["<f>"]}}')
    assert "a schema of the structural tag nests 10001 levels deep" in refused(backend, deep_text)
    # given as JSON text, the schema is a string to the tag's scan: checked on its own before json.loads
    assert "structures[0].schema nests 10001 levels deep" in refused(backend, tag(nested_schema(5000)))
    many_refs = json.loads(ref_chain(1001))
    assert "the structural tag refers to 1001 distinct $ref targets" in refused(backend, tag(many_refs))
    assert "structures[0].schema refers to 1001 distinct $ref targets" in refused(backend, tag(ref_chain(1001)))


# ---- empty languages and messages --------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "text"), [
    ("ebnf", 'root ::= root "a"'),
    ("ebnf", 'start: start "a"'),
    ("ebnf", 'root ::= x\nx ::= x "b"'),
    ("regex", r"[^\s\S]"),
])
def test_empty_language_is_refused_at_the_check(backend: GrammarBackend, kind: ConstraintKind, text: str) -> None:
    message = refused(backend, Constraint(kind, text))
    assert message.startswith(f"invalid {kind}: it matches no text at all, so no output can satisfy it")
    assert "<" not in message and "\n" not in message and len(message) < 300


def test_satisfiable_recursion_and_empty_string_pass(backend: GrammarBackend) -> None:
    for text in ['root ::= "a" | root "a"', 'root ::= ""', 'root ::= "yes" | "no" | "maybe"']:
        assert backend.check(Constraint("ebnf", text)) is None, text


def test_runtime_errors_are_one_short_line(backend: GrammarBackend,
                                          smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    matcher = backend.new_matcher(Constraint("ebnf", 'root ::= "yes" | "no"'))
    matcher.advance(smollm2_tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert matcher.error is not None
    assert "\n" not in matcher.error and "<" not in matcher.error and len(matcher.error) <= MAX_MESSAGE_CHARS


def test_compiler_messages_are_cut(backend: GrammarBackend) -> None:
    message = refused(backend, Constraint("regex", "(" + "a" * 500))
    assert message.startswith("invalid regex: unclosed group (")
    assert len(message) <= len("invalid regex: ") + MAX_MESSAGE_CHARS


# ---- the deep stack, in a subprocess -----------------------------------------------------------------------------

# Limits raised past where the compiler overflows an 8 MiB stack (a Lark chain crashed at 2,750 rules, a $ref chain
# at 938): these compile only because the compile and the matcher run on the deep-stack threads. The default limits
# then refuse the crash reproducers quickly.
_CHILD = """
import json, sys, time
from transformers import AutoTokenizer
from lmrpc.server.engine.grammar import GrammarBackend, GrammarLimits
from lmrpc.server.engine.types import Constraint
sys.path.insert(0, sys.argv[2])
from test_grammar_limits import gbnf_chain, lark_chain, nested_schema, ref_chain

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
raised = GrammarBackend(tokenizer, 49152, GrammarLimits(max_grammar_rules=6000))
results = {}
for name, constraint in [("lark5000", Constraint("ebnf", lark_chain(5000))),
                         ("refs2500", Constraint("json_schema", ref_chain(2500)))]:
    results[name] = raised.check(constraint)
    matcher = raised.new_matcher(constraint)  # from this (8 MiB) main thread
    results[name + "_matcher"] = matcher.error
default = GrammarBackend(tokenizer, 49152)
for name, constraint in [("gbnf5000", Constraint("ebnf", gbnf_chain(5000))),
                         ("lark5000", Constraint("ebnf", lark_chain(5000))),
                         ("refs3000", Constraint("json_schema", ref_chain(3000))),
                         ("deep990", Constraint("json_schema", nested_schema(990))),
                         ("deep5000", Constraint("json_schema", nested_schema(5000)))]:
    start = time.monotonic()
    results["default_" + name] = [default.check(constraint), time.monotonic() - start]
print(json.dumps(results))
"""


def test_crash_reproducers_survive_in_a_subprocess(tokenizer_dir: Path) -> None:
    child = subprocess.run([sys.executable, "-c", _CHILD, str(tokenizer_dir), str(Path(__file__).parent)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"child died ({child.returncode}): {child.stderr[-2000:]}"
    results = json.loads(child.stdout.strip().splitlines()[-1])
    assert results["lark5000"] is None and results["lark5000_matcher"] is None
    assert results["refs2500"] is None and results["refs2500_matcher"] is None
    for name in ("gbnf5000", "lark5000", "refs3000", "deep990", "deep5000"):
        message, seconds = results["default_" + name]
        assert message is not None and ("--max-grammar-rules" in message or "--max-grammar-depth" in message), name
        assert seconds < 1.0, (name, seconds)


def test_engine_matchers_are_copies_of_the_checked_one(backend: GrammarBackend,
                                                       smollm2_tokenizer: PreTrainedTokenizerBase,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """After the service's check, the engine's matchers are copies (no grammar compiled again on the engine's path:
    n outputs of a large schema each rebuilt it and stalled the engine), and each copy advances on its own."""
    constraint = Constraint("ebnf", 'root ::= "yes" | "no"')
    assert backend.check(constraint) is None
    built: list[object] = []
    real = grammar_module.llguidance.LLMatcher

    def counting(*args: object, **kwargs: object) -> object:
        built.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(grammar_module.llguidance, "LLMatcher", counting)
    first, second = backend.new_matcher(constraint), backend.new_matcher(constraint)
    assert built == []
    yes = smollm2_tokenizer.encode("yes", add_special_tokens=False)[0]
    first.advance(yes)
    assert first.error is None and second.allows(yes)
    second.advance(smollm2_tokenizer.encode("no", add_special_tokens=False)[0])
    assert second.error is None and first.error is None
