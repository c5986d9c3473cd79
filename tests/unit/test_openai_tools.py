"""Tool calls: constraints (their schemas accept exactly the calls they should, and compile), the Hermes parser
(incremental = whole, hold-back of <tool_call> prefixes and layout whitespace), and the JSON call parsers."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lmrpc.server.engine.grammar import parse_structural_tag
from lmrpc.server.openai import tools
from lmrpc.server.openai.tools import CALL_BEGIN, CALL_END, HermesParser, Piece
from lmrpc.server.openai.validation import ToolSpec

WEATHER = ToolSpec("get_weather", "weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"], "additionalProperties": False})
TIME = ToolSpec("get_time", "time", {"type": "object", "properties": {}})


def call_text(name: str, arguments: dict[str, object]) -> str:
    return f"{CALL_BEGIN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_END}"


def test_required_schema_accepts_calls_of_the_tools_only() -> None:
    schema = json.loads(tools.required_schema([WEATHER, TIME], parallel=True))
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris"}},
                         {"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "other", "arguments": {}}],
                [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(tools.required_schema([WEATHER, TIME], parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, one)


def test_named_schema_is_the_functions_parameters() -> None:
    assert json.loads(tools.named_schema(WEATHER)) == WEATHER.parameters


def test_hermes_structural_tag_is_a_valid_tag() -> None:
    tag = parse_structural_tag(tools.hermes_structural_tag([WEATHER, TIME]))
    assert tag.triggers == (CALL_BEGIN,)
    assert [s.begin for s in tag.structures] == [f'{CALL_BEGIN}\n{{"name": "get_weather", "arguments": ',
                                                 f'{CALL_BEGIN}\n{{"name": "get_time", "arguments": ']
    assert all(s.end == f"}}\n{CALL_END}" for s in tag.structures)
    # begin + arguments + end is exactly what the parser reads as a call
    text = tag.structures[0].begin + '{"city": "Rome"}' + tag.structures[0].end
    piece = HermesParser().feed(text)
    assert [(c.name, json.loads(c.arguments)) for c in piece.calls] == [("get_weather", {"city": "Rome"})]


OUTPUT = ("Let me check. \n" + call_text("get_weather", {"city": "Paris"}) + "\n"
          + call_text("get_time", {}) + "\n\n")


def _run(parser: HermesParser, deltas: list[str]) -> Piece:
    content: list[str] = []
    calls = []
    for delta in deltas:
        piece = parser.feed(delta)
        content.append(piece.content)
        calls += piece.calls
    end = parser.finish()
    return Piece("".join(content) + end.content, tuple(calls) + end.calls)


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(OUTPUT)])
def test_hermes_parser_gives_the_same_pieces_whatever_the_deltas(size: int) -> None:
    piece = _run(HermesParser(), [OUTPUT[i:i + size] for i in range(0, len(OUTPUT), size)])
    assert piece.content == "Let me check."  # layout whitespace around calls dropped
    assert [(c.name, json.loads(c.arguments)) for c in piece.calls] == [("get_weather", {"city": "Paris"}),
                                                                       ("get_time", {})]
    assert len({c.id for c in piece.calls}) == 2 and all(c.id.startswith("call_") for c in piece.calls)


def test_hermes_parser_holds_back_what_may_start_a_call() -> None:
    parser = HermesParser()
    assert parser.feed("Sure <tool").content == "Sure"  # " <tool" may be the start of a call
    assert parser.feed("box> here").content == " <toolbox> here"  # it was not
    assert parser.finish() == Piece()
    assert not parser.called


def test_hermes_parser_text_without_calls_is_content_with_its_whitespace() -> None:
    assert _run(HermesParser(), ["Hello ", "world.\n"]).content == "Hello world.\n"


def test_hermes_parser_unfinished_call_is_text_and_a_stopped_one_a_call() -> None:
    cut = _run(HermesParser(), ["Hi ", CALL_BEGIN, '\n{"name": "get_weather", "argu'])
    assert cut.content == f'Hi {CALL_BEGIN}\n{{"name": "get_weather", "argu' and cut.calls == ()
    # Generation stopped at </tool_call> (stop string, trimmed): the JSON is complete, so it is a call.
    stopped = _run(HermesParser(), [CALL_BEGIN + '\n{"name": "get_time", "arguments": {}}\n'])
    assert stopped.content == "" and [c.name for c in stopped.calls] == ["get_time"]


def test_hermes_parser_malformed_call_is_shown() -> None:
    piece = _run(HermesParser(), [f"{CALL_BEGIN}not json{CALL_END} ok"])
    assert piece.content == f"{CALL_BEGIN}not json{CALL_END} ok" and piece.calls == ()


def test_json_call_parsers() -> None:
    [call] = tools.parse_named("get_weather", '{"city": "Paris"}') or []
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert tools.parse_named("get_weather", '{"city": "Par') is None  # cut short by max_tokens
    calls = tools.parse_required('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                                 '"arguments": {"city": "Oslo"}}]') or []
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    for bad in ('[{"name": "get_time"', "[]", '{"name": "get_time", "arguments": {}}', '[{"name": 1}]'):
        assert tools.parse_required(bad) is None
    parser = tools.parser_for("required", None)
    assert parser.feed('[{"name": "get_time", ') == Piece() and not parser.called
    parser.feed('"arguments": {}}]')
    assert [c.name for c in parser.finish().calls] == ["get_time"] and parser.called
    truncated = tools.parser_for("function", "get_weather")
    truncated.feed('{"city": "Os')
    assert truncated.finish() == Piece('{"city": "Os') and not truncated.called


def test_system_prompt_and_past_calls_in_hermes_format() -> None:
    prompt = tools.hermes_system_prompt([WEATHER])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and CALL_BEGIN in prompt
    text = tools.hermes_call_text("get_weather", '{"city": "Paris"}')
    piece = HermesParser().feed(text)
    assert [(c.name, json.loads(c.arguments)) for c in piece.calls] == [("get_weather", {"city": "Paris"})]
