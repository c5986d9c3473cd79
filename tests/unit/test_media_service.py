"""Media items through the real servicers (GenerateService over fake_engine's FakeEngine, OpenAIService over
scripted_engine's ScriptedEngine) with a fake multimodal processor: what reaches prepare(), the expanded prompt the
engine gets, and every error reaching the client as its status with the item's field path, the server serving on."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from fake_engine import FakeEngine, serving
from media_fixtures import Loopback, clip, closed_port, data_uri, encoded, loopback
from scripted_engine import Scripted, ScriptedEngine, serving_openai
from status_details import violations
from transformers import PreTrainedTokenizerBase

from lmrpc.server.config import EngineConfig, MediaConfig, SchedulerConfig, ServerConfig
from lmrpc.server.engine.async_engine import AsyncEngine
from lmrpc.server.engine.types import EngineRequest
from lmrpc.server.frontend import Frontend
from lmrpc.server.generate.service import GenerateService
from lmrpc.server.media.types import Media, MediaError, Modality, MultimodalPrompt
from lmrpc.v1 import generate_pb2, generate_pb2_grpc, openai_pb2, openai_pb2_grpc

IMG, AUD = 500, 501  # the fake model's placeholder ids
EXPAND = 3  # positions each item fills
PNG = encoded("PNG")


@dataclass
class FakeProcessor:
    """A MultimodalProcessor: each placeholder id becomes EXPAND copies; items beyond the placeholders are refused
    naming the first one left over, as a model's processor does."""

    modalities: frozenset[Modality] = frozenset({Modality.IMAGE, Modality.AUDIO})
    sampling_rate: int = 16000
    min_audio_samples: int = 0
    max_audio_seconds: float | None = None
    placeholders: dict[Modality, str] = field(default_factory=lambda: {Modality.IMAGE: "<image>",
                                                                      Modality.AUDIO: "<audio>"})
    engine_media: Any = None  # what prepare() hands the engine
    # count the placeholder ids against the items (False for chat prompts, whose placeholders are text here: the
    # tests read them back from the prompt)
    strict: bool = True
    calls: list[tuple[list[int], list[Media]]] = field(default_factory=list)  # every prepare(), in order

    def prepare(self, prompt: str | Sequence[int], media: Sequence[Media]) -> MultimodalPrompt:
        assert not isinstance(prompt, str)
        self.calls.append((list(prompt), list(media)))
        for modality, token in ((Modality.IMAGE, IMG), (Modality.AUDIO, AUD)):
            items = [m for m in media if m.modality is modality]
            slots = list(prompt).count(token)
            if self.strict and len(items) > slots:
                raise MediaError(items[slots].wire_field, f"{len(items)} items for {slots} placeholders")
        ids = [t for token in prompt for t in ([token] * EXPAND if token in (IMG, AUD) else [token])]
        return MultimodalPrompt(tuple(ids), self.engine_media, EXPAND * len(media))


@dataclass
class MediaEngine(FakeEngine):
    """FakeEngine with the loaded model's processor where the frontend looks for it, and the requests it got."""

    media_processor: FakeProcessor | None = None
    seen: list[EngineRequest] = field(default_factory=list)

    async def generate(self, requests: list[EngineRequest]) -> AsyncIterator[Any]:
        self.seen += requests
        async for out in super().generate(requests):
            yield out


def service(engine: MediaEngine, media: MediaConfig) -> GenerateService:
    frontend = Frontend(cast(AsyncEngine, engine),
                        EngineConfig(scheduler=SchedulerConfig(max_running_requests=8), sampling_defaults="openai"),
                        ServerConfig(host="127.0.0.1", port=0, media=media))
    return GenerateService(frontend)


@pytest.fixture(scope="module")
def web() -> Any:
    with loopback({"/a.png": PNG}) as server:
        yield server


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "a.png").write_bytes(PNG)
    return tmp_path


def request(*items: generate_pb2.MediaItem, ids: Sequence[int] = (1, IMG, 2),
            audio: Sequence[generate_pb2.MediaItem] = ()) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(input_ids=[generate_pb2.TokenIds(ids=ids)],
                                       sampling_params=[generate_pb2.SamplingParams(max_new_tokens=16)])
    if items:
        req.image_data.add().items.extend(items)
    if audio:
        req.audio_data.add().items.extend(audio)
    return req


async def refused(stub: generate_pb2_grpc.GenerateServiceStub, req: generate_pb2.GenerateRequest,
                  code: grpc.StatusCode, field: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [_ async for _ in stub.Generate(req)]
    assert err.value.code() == code, err.value.details()
    found = violations(err.value)
    assert field in found, found
    return found[field]


async def test_image_reaches_prepare_and_the_engine_gets_the_expanded_prompt(web: Loopback, root: Path) -> None:
    engine = MediaEngine(media_processor=FakeProcessor())
    async with serving(service(engine, MediaConfig(allowed_local_media_path=str(root)))) as stub:
        for item in (generate_pb2.MediaItem(data=PNG), generate_pb2.MediaItem(url=data_uri(PNG)),
                     generate_pb2.MediaItem(url=web.url("/a.png")), generate_pb2.MediaItem(url=str(root / "a.png"))):
            [out] = [m async for m in stub.Generate(request(item))]
            assert len(out.token_ids) == 2 + EXPAND  # FakeEngine: one token per prompt position
    assert engine.media_processor is not None
    calls = engine.media_processor.calls
    assert [prompt for prompt, _ in calls] == [[1, IMG, 2]] * 4
    assert len({media[0].digest for _, media in calls}) == 1  # the same picture however it came
    assert all(media[0].wire_field == "image_data[0].items[0]" for _, media in calls)
    assert [r.prompt_ids for r in engine.seen] == [(1, IMG, IMG, IMG, 2)] * 4


async def test_images_then_audio_per_prompt_and_one_list_for_every_prompt() -> None:
    engine = MediaEngine(media_processor=FakeProcessor())
    req = generate_pb2.GenerateRequest(input_ids=[generate_pb2.TokenIds(ids=[IMG, AUD, 3]),
                                                  generate_pb2.TokenIds(ids=[IMG, AUD, 4])])
    req.image_data.add().items.add(data=PNG)  # one list: every prompt's
    req.audio_data.add().items.add(data=clip("WAV"))
    req.audio_data.add().items.add(data=clip("FLAC"))  # one list per prompt
    async with serving(service(engine, MediaConfig())) as stub:
        outs = [m async for m in stub.Generate(req)]
    assert len(outs) == 2
    assert engine.media_processor is not None
    fields_by_prompt = sorted([m.wire_field for m in media] for _, media in engine.media_processor.calls)
    assert fields_by_prompt == [["image_data[0].items[0]", "audio_data[0].items[0]"],
                                ["image_data[0].items[0]", "audio_data[1].items[0]"]]
    audio = [media[1] for _, media in engine.media_processor.calls]
    assert all(a.sampling_rate == 16000 and a.audio is not None and len(a.audio) == 16000 for a in audio)
    assert audio[0].digest == audio[1].digest  # WAV and FLAC of the same samples


async def test_every_item_error_names_the_item_and_the_server_serves_on(web: Loopback, root: Path) -> None:
    engine = MediaEngine(media_processor=FakeProcessor())
    ok = generate_pb2.MediaItem(data=PNG)
    at = "image_data[0].items[1]"
    two = (1, IMG, IMG, 2)
    invalid, denied = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED
    async with serving(service(engine, MediaConfig(allowed_local_media_path=str(root), max_media_bytes=1 << 20,
                                                   allowed_media_domains=("127.0.0.1",)))) as stub:
        said = await refused(stub, request(ok, generate_pb2.MediaItem(data=b"junk"), ids=two), invalid, at)
        assert "PNG, JPEG or WebP" in said
        said = await refused(stub, request(ok, generate_pb2.MediaItem(url="data:image/png;base64,@@"), ids=two),
                             invalid, at)
        assert "base64" in said
        said = await refused(stub, request(ok, generate_pb2.MediaItem(data=b"\0" * ((1 << 20) + 1)), ids=two),
                             invalid, at)
        assert "--max-media-bytes" in said
        said = await refused(stub, request(ok, generate_pb2.MediaItem(url=web.url("/gone.png")), ids=two),
                             invalid, at)
        assert "404" in said
        said = await refused(stub, request(ok, generate_pb2.MediaItem(url=f"http://127.0.0.1:{closed_port()}/a"),
                                           ids=two), grpc.StatusCode.UNAVAILABLE, at)
        assert "unreachable" in said
        await refused(stub, request(ok, generate_pb2.MediaItem(url=web.url("/to-localhost/a.png")), ids=two),
                      denied, at)
        await refused(stub, request(ok, generate_pb2.MediaItem(url="http://example.com/a.png"), ids=two), denied, at)
        await refused(stub, request(ok, generate_pb2.MediaItem(url=str(root.parent / "x.png")), ids=two), denied, at)
        said = await refused(stub, request(ok, ok), invalid, at)  # two images, one placeholder: the processor's
        assert "2 items for 1 placeholders" in said
        [out] = [m async for m in stub.Generate(request(ok))]  # still serving
        assert out.finish.reason == generate_pb2.FINISH_REASON_EOS


async def test_request_shape_and_item_count_are_checked() -> None:
    engine = MediaEngine(media_processor=FakeProcessor())
    async with serving(service(engine, MediaConfig(max_media_items=2))) as stub:
        req = generate_pb2.GenerateRequest(input_ids=[generate_pb2.TokenIds(ids=[IMG]) for _ in range(3)])
        req.image_data.add().items.add(data=PNG)
        req.image_data.add().items.add(data=PNG)
        said = await refused(stub, req, grpc.StatusCode.INVALID_ARGUMENT, "image_data")
        assert "one list per prompt (3), got 2" in said
        item = generate_pb2.MediaItem(data=PNG)
        said = await refused(stub, request(item, item, item, ids=(IMG, IMG, IMG)), grpc.StatusCode.INVALID_ARGUMENT,
                             "image_data[0].items[2]")
        assert "--max-media-items" in said
        embeds = generate_pb2.GenerateRequest(input_embeds=[generate_pb2.PromptEmbeddings(
            positions=[generate_pb2.Embedding(values=[0.0])])])
        embeds.image_data.add().items.add(data=PNG)
        await refused(stub, embeds, grpc.StatusCode.INVALID_ARGUMENT, "image_data")
    assert engine.media_processor is not None and not engine.media_processor.calls  # nothing reached the processor


async def test_text_only_model_refuses_media_naming_the_item() -> None:
    engine = MediaEngine()  # no processor: a text-only model
    async with serving(service(engine, MediaConfig())) as stub:
        said = await refused(stub, request(generate_pb2.MediaItem(url="http://example.com/a.png")),
                             grpc.StatusCode.INVALID_ARGUMENT, "image_data[0].items[0]")
        assert "takes no images" in said
        said = await refused(stub, request(audio=[generate_pb2.MediaItem(data=b"x")]),
                             grpc.StatusCode.INVALID_ARGUMENT, "audio_data[0].items[0]")
        assert "takes no audio" in said
    image_only = MediaEngine(media_processor=FakeProcessor(modalities=frozenset({Modality.IMAGE}), sampling_rate=0))
    async with serving(service(image_only, MediaConfig())) as stub:
        said = await refused(stub, request(audio=[generate_pb2.MediaItem(data=clip("WAV"))]),
                             grpc.StatusCode.INVALID_ARGUMENT, "audio_data[0].items[0]")
        assert "takes no audio (images only)" in said


async def test_engine_media_goes_into_the_engine_request() -> None:
    """The processor's engine media rides in EngineRequest.prompt_media."""
    marker = object()
    engine = MediaEngine(media_processor=FakeProcessor(engine_media=marker))
    async with serving(service(engine, MediaConfig())) as stub:
        [_ async for _ in stub.Generate(request(generate_pb2.MediaItem(data=PNG)))]
        assert engine.seen[-1].prompt_media is marker


# ---- ChatComplete ----------------------------------------------------------------------------------------------------


def chat_request(*parts: openai_pb2.ContentPart) -> openai_pb2.ChatCompleteRequest:
    return openai_pb2.ChatCompleteRequest(messages=[
        openai_pb2.ChatMessage(role="user", content_parts=list(parts[:2])),
        openai_pb2.ChatMessage(role="assistant", content="Seen."),
        openai_pb2.ChatMessage(role="user", content_parts=list(parts[2:]))], max_tokens=4)


def image_part(data: bytes = PNG) -> openai_pb2.ContentPart:
    return openai_pb2.ContentPart(type="image_url", image_url=openai_pb2.ImageUrl(url=data_uri(data)))


def audio_part(fmt: str = "wav") -> openai_pb2.ContentPart:
    import base64
    return openai_pb2.ContentPart(type="input_audio", input_audio=openai_pb2.InputAudio(
        data=base64.b64encode(clip(fmt.upper())).decode(), format=fmt))


def text_part(text: str) -> openai_pb2.ContentPart:
    return openai_pb2.ContentPart(type="text", text=text)


# A template that renders content lists, as multimodal models' do: it writes its own placeholders.
PARTS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}[IMG]{% elif p.type == 'audio' %}[AUD]{% else %}{{ p.text }}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("template", [None, PARTS_TEMPLATE])
def test_chat_media_parts_reach_prepare_in_message_order(smollm2_tokenizer: PreTrainedTokenizerBase,
                                                         template: str | None) -> None:
    """Parts become media items in message order, each in the model's placeholder where it stood: the processor's
    placeholder text for SmolLM2's string-only template, the template's own for one that renders content lists."""
    engine = ScriptedEngine(smollm2_tokenizer, lambda r: Scripted("A cat."))
    processor = FakeProcessor(strict=False)
    engine.media_processor = processor
    req = chat_request(image_part(), text_part("What is this?"), audio_part("flac"), image_part(encoded("WEBP")))
    with serving_openai(engine, template) as target, grpc.insecure_channel(target) as channel:
        stub = openai_pb2_grpc.OpenAIServiceStub(channel)
        [reply] = list(stub.ChatComplete(req, timeout=30))
        assert reply.choices[0].message.content == "A cat."
    [(prompt, media)] = processor.calls
    assert [(m.modality, m.wire_field) for m in media] == [
        (Modality.IMAGE, "messages[0].content_parts[0]"), (Modality.AUDIO, "messages[2].content_parts[0]"),
        (Modality.IMAGE, "messages[2].content_parts[1]")]
    assert media[0].digest == media[2].digest  # PNG and lossless WebP of one picture
    text = str(smollm2_tokenizer.decode(prompt))
    if template is None:
        assert "<image>\nWhat is this?" in text and text.index("<audio>") < text.rindex("<image>")
    else:
        assert text.startswith("<user>[IMG]What is this?<assistant>Seen.<user>[AUD][IMG]")


def test_chat_media_errors_name_the_part(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    engine = ScriptedEngine(smollm2_tokenizer, lambda r: Scripted("ok"))
    with serving_openai(engine) as target, grpc.insecure_channel(target) as channel:
        stub = openai_pb2_grpc.OpenAIServiceStub(channel)

        def code_and_fields(req: openai_pb2.ChatCompleteRequest) -> tuple[grpc.StatusCode, list[str]]:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.ChatComplete(req, timeout=30))
            return err.value.code(), list(violations(err.value))  # type: ignore[arg-type]

        # a text-only model (no processor)
        assert code_and_fields(chat_request(text_part("hi"), image_part())) == (
            grpc.StatusCode.INVALID_ARGUMENT, ["messages[0].content_parts[1]"])
        engine.media_processor = FakeProcessor(strict=False)
        bad = openai_pb2.ContentPart(type="image_url", image_url=openai_pb2.ImageUrl(url=data_uri(b"junk")))
        assert code_and_fields(chat_request(text_part("hi"), bad)) == (
            grpc.StatusCode.INVALID_ARGUMENT, ["messages[0].content_parts[1]"])
        wrong = openai_pb2.ContentPart(type="input_audio", input_audio=openai_pb2.InputAudio(data="AAAA",
                                                                                           format="ogg"))
        assert code_and_fields(chat_request(text_part("hi"), wrong)) == (
            grpc.StatusCode.INVALID_ARGUMENT, ["messages[0].content_parts[1].input_audio.format"])
        local = openai_pb2.ContentPart(type="image_url", image_url=openai_pb2.ImageUrl(url="/etc/passwd"))
        assert code_and_fields(chat_request(text_part("hi"), local)) == (
            grpc.StatusCode.PERMISSION_DENIED, ["messages[0].content_parts[1]"])
        [reply] = list(stub.ChatComplete(chat_request(text_part("hi")), timeout=30))  # still serving
        assert reply.choices[0].message.content == "ok"
