"""How OpenAIService builds prompts: chat templates (the tokenizer's own rendering, --chat-template, no template,
tools described for a template that ignores them), fill-in-the-middle layouts, and the token texts of logprobs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lmrpc.server.__main__ import parse_args, read_chat_template
from lmrpc.server.engine.types import SamplingParams
from lmrpc.server.openai import fim
from lmrpc.server.openai.chat_template import ChatTemplate, template_message
from lmrpc.server.openai.logprobs import TokenTexts
from lmrpc.server.openai.validation import ToolSpec
from lmrpc.server.statuses import RequestError
from lmrpc.v1 import openai_pb2

WEATHER = ToolSpec("get_weather", "The weather", {"type": "object", "properties": {"city": {"type": "string"}}})
# A template in the style of Qwen's: it writes the tools, and calls as Hermes <tool_call> tags.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}. Call with "
    "<tool_call></tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def msg(role: str, content: str | None = None, **fields: object) -> openai_pb2.ChatMessage:
    m = openai_pb2.ChatMessage(role=role, **fields)  # type: ignore[arg-type]
    if content is not None:
        m.content = content
    return m


def render(template: ChatTemplate, messages: list[openai_pb2.ChatMessage], tools: list[ToolSpec] | None = None,
           add_generation_prompt: bool = True) -> str:
    return template.render(messages, tools or [], add_generation_prompt=add_generation_prompt,
                           continue_final_message=False, template_kwargs={}).text


def test_render_is_the_tokenizers_own(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", "Why?")]
    expected = smollm2_tokenizer.apply_chat_template([template_message(m) for m in messages], tokenize=False,
                                                     add_generation_prompt=True)
    assert render(ChatTemplate(smollm2_tokenizer), messages) == expected


def test_text_parts_are_joined_and_arguments_are_objects() -> None:
    parts = msg("user", content_parts=[openai_pb2.ContentPart(type="text", text="a"),
                                       openai_pb2.ContentPart(type="text", text="b")])
    assert template_message(parts) == {"role": "user", "content": "a\nb"}
    call = openai_pb2.ToolCall(id="c1", function=openai_pb2.FunctionCall(name="f", arguments='{"x": 1}'))
    assert template_message(msg("assistant", tool_calls=[call]))["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]


def part(kind: str, text: str = "") -> openai_pb2.ContentPart:
    if kind == "image_url":
        return openai_pb2.ContentPart(type=kind, image_url=openai_pb2.ImageUrl(url="data:image/png;base64,AAAA"))
    if kind == "input_audio":
        return openai_pb2.ContentPart(type=kind, input_audio=openai_pb2.InputAudio(data="AAAA", format="wav"))
    return openai_pb2.ContentPart(type="text", text=text)


def test_a_parts_template_renders_as_transformers_does(tiny_qwen2vl_dir: Path) -> None:
    """Qwen2-VL's own template (it iterates over content parts) gets every message sent as parts as its list, the
    shape transformers' apply_chat_template takes: the prompt is the one transformers renders from the same messages
    (text parts run together, not joined with newlines; each image part its vision markers)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2vl_dir)
    assert "for content in message['content']" in tokenizer.chat_template
    template = ChatTemplate(tokenizer)
    assert template.renders_parts()
    messages = [
        msg("system", content_parts=[part("text", "Be"), part("text", " brief.")]),
        msg("user", content_parts=[part("image_url"), part("text", "What is this?"), part("text", "And this:"),
                                   part("image_url")]),
        msg("assistant", "Two cats."),
        msg("user", content_parts=[part("text", "Sure?")]),
    ]
    expected = tokenizer.apply_chat_template([
        {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": " brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"},
                                     {"type": "text", "text": "And this:"}, {"type": "image"}]},
        {"role": "assistant", "content": "Two cats."},
        {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
    ], tokenize=False, add_generation_prompt=True)
    rendered = render(template, messages)
    assert rendered == expected
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                               "<|vision_start|><|image_pad|><|vision_end|>What is this?And this:<|vision_start|>")
    # the tools described for a template that ignores them land in a text part of the system message's list
    with_tools = template.render(messages, [WEATHER], add_generation_prompt=True, continue_final_message=False,
                                 template_kwargs={})
    assert with_tools.text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")


def test_a_text_template_gets_parts_as_one_string(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    """SmolLM2's template renders content as a string only: text parts joined, media parts as the model's
    placeholder text."""
    template = ChatTemplate(smollm2_tokenizer)
    assert not template.renders_parts()
    messages = [msg("user", content_parts=[part("text", "a"), part("image_url"), part("input_audio"),
                                           part("text", "b")])]
    text = template.render(messages, [], add_generation_prompt=False, continue_final_message=False,
                           template_kwargs={}, placeholders={"image_url": "<image>", "input_audio": "<audio>"}).text
    assert "<|im_start|>user\na\n<image>\n<audio>\nb<|im_end|>" in text


def test_override_and_missing_template(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    bare = copy.deepcopy(smollm2_tokenizer)
    bare.chat_template = None
    with pytest.raises(RequestError) as err:
        render(ChatTemplate(bare), [msg("user", "Hi")])
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION and "--chat-template" in str(err.value)
    override = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert render(ChatTemplate(bare, override), [msg("user", "Hi")]) == "[user] Hi\n"


def test_a_model_template_that_does_not_compile_is_failed_precondition(
        smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    broken = copy.deepcopy(smollm2_tokenizer)
    broken.chat_template = "{% for m in messages %}{{ m.content }}"  # no endfor
    with pytest.raises(RequestError) as err:
        render(ChatTemplate(broken), [msg("user", "Hi")])
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION  # the server's template, not the caller's messages
    violation = err.value.violations[0]
    assert violation.field == "chat_template" and "does not compile: Unexpected end of template" in \
        violation.description and "--chat-template" in violation.description


def test_chat_template_flag_reads_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0].content }}")
    args = parse_args(["--chat-template", str(template)])
    assert read_chat_template(args.chat_template) == "{{ messages[0].content }}"
    assert read_chat_template(None) is None
    (tmp_path / "empty.jinja").write_text("  \n")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }}")  # no endfor: fails every call
    for bad, says in ((tmp_path / "missing.jinja", "cannot read"), (tmp_path / "empty.jinja", "is empty"),
                      (tmp_path / "broken.jinja", "is no valid template: Unexpected end of template")):
        with pytest.raises(SystemExit) as exit_:
            read_chat_template(str(bad))
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_template_error_is_invalid_argument(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    with pytest.raises(RequestError) as err:
        render(ChatTemplate(smollm2_tokenizer, strict), [msg("system", "x")])
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.violations[0].field == "messages" and "first must be user" in err.value.violations[0].description


def test_tools_described_for_a_template_that_ignores_them(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    template = ChatTemplate(smollm2_tokenizer)  # SmolLM2's template ignores tools
    past = openai_pb2.ToolCall(id="c1", function=openai_pb2.FunctionCall(name="get_weather",
                                                                         arguments='{"city": "Oslo"}'))
    messages = [msg("user", "Weather in Oslo?"), msg("assistant", tool_calls=[past]),
                msg("tool", "-3C", tool_call_id="c1"), msg("user", "And Paris?")]
    rendered = template.render(messages, [WEATHER], add_generation_prompt=True, continue_final_message=False,
                               template_kwargs={})
    assert rendered.tool_format_known
    text = rendered.text
    assert text.startswith("<|im_start|>system\nYou can call functions")  # replaces the default system message
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n-3C<|im_end|>" in text


def test_a_template_that_renders_tools_is_used_as_is(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    rendered = ChatTemplate(smollm2_tokenizer, HERMES_TEMPLATE).render(
        [msg("user", "Hi")], [WEATHER], add_generation_prompt=True, continue_final_message=False,
        template_kwargs={})
    assert rendered.tool_format_known and rendered.text.startswith("<|im_start|>system\nTools: get_weather.")
    other = HERMES_TEMPLATE.replace("<tool_call></tool_call>", "[CALLS]")
    assert not ChatTemplate(smollm2_tokenizer, other).render(
        [msg("user", "Hi")], [WEATHER], add_generation_prompt=True, continue_final_message=False,
        template_kwargs={}).tool_format_known


def test_fim_tokens_and_layout(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    assert fim.find_fim_tokens(smollm2_tokenizer) is None  # SmolLM2 has none: suffix is refused
    coder = copy.deepcopy(smollm2_tokenizer)
    coder.add_special_tokens({"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]})
    tokens = fim.find_fim_tokens(coder)
    assert tokens is not None
    vocab = coder.get_vocab()
    assert (tokens.prefix, tokens.suffix, tokens.middle) == (vocab["<fim_prefix>"], vocab["<fim_suffix>"],
                                                             vocab["<fim_middle>"])
    assert fim.leading_special_ids(coder) == []  # byte-level BPE adds no BOS
    prefix, suffix = coder.encode("def f(", add_special_tokens=False), coder.encode("):", add_special_tokens=False)
    ids = fim.fim_prompt(tokens, [], prefix, suffix)
    assert coder.decode(ids) == "<fim_prefix>def f(<fim_suffix>):<fim_middle>"


def test_token_texts_spell_the_text_across_split_characters(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "naïve 龘𝔘 🙂 ok"
    ids = smollm2_tokenizer.encode(text)
    texts = TokenTexts.for_prompt(smollm2_tokenizer).add(ids, last=True)
    assert "".join(texts) == text and len(texts) == len(ids)
    split = [i for i, t in enumerate(texts) if t == ""]
    assert split, "some character spans several tokens: its first tokens add nothing"
    assert all("\ufffd" not in t for t in texts)
    # Output tokens: decoded with the prompt as context, streamed in pieces, they still spell the text.
    out = TokenTexts.for_output(smollm2_tokenizer, smollm2_tokenizer.encode("Say:"), SamplingParams())
    pieces = out.add(ids[:3], last=False) + out.add(ids[3:], last=True)
    assert "".join(pieces) == text


def test_struct_schema_numbers_stay_integers() -> None:
    from lmrpc.server.openai.validation import struct_dict

    tool = openai_pb2.Tool()
    tool.function.parameters.update({"type": "string", "maxLength": 40})
    assert json.dumps(struct_dict(tool.function.parameters), sort_keys=True) == '{"maxLength": 40, "type": "string"}'
