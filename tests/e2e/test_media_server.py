"""Images and audio through a real server on tiny random-weight checkpoints (`--model DIR`): every form of the same
item gives the same output, a repeated item is served from the prefix cache, a different item is not, and media
requests running beside text requests leave every output as it is alone."""

from __future__ import annotations

import base64
import concurrent.futures
import http.server
import io
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration, Qwen2VLImageProcessorPil

from lmrpc.client import Client, GenerateResult, LmrpcError
from lmrpc.client.media import embedding, processor_output

if TYPE_CHECKING:
    from conftest import RunningServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png(1))
    return root


@pytest.fixture(scope="module")
def http_url(media_root: Path) -> Iterator[str]:
    """A loopback HTTP server over media_root."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(media_root), **kwargs)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def media_server(launch: Callable[..., RunningServer], model: Path, media_root: Path) -> RunningServer:
    return launch("--model", str(model), "--dtype", "float32", "--sampling-defaults", "openai",
                  "--allowed-local-media-path", str(media_root), "--kv-cache-tokens", "8192")


@pytest.fixture(scope="module")
def llava(launch_server: Callable[..., RunningServer], tiny_llava_dir: Path, media_root: Path
          ) -> Iterator[Client]:
    running = media_server(launch_server, tiny_llava_dir, media_root)
    with Client(running.target) as client:
        yield client
    assert running.stop() == 0


def generate(client: Client, prompt: str, **media: Any) -> GenerateResult:
    [result] = client.generate(prompt, sampling_params=GREEDY, return_logprob=True, **media)
    return result


def logprobs(r: GenerateResult) -> list[float | None]:
    return [p.chosen.logprob if p.chosen is not None else None for p in r.output_logprobs]


def same(a: GenerateResult, b: GenerateResult) -> bool:
    return a.token_ids == b.token_ids and logprobs(a) == logprobs(b)


def test_llava_every_form_of_an_image_gives_the_same_output(llava: Client, tiny_llava_dir: Path, media_root: Path,
                                                            http_url: str) -> None:
    picture = (media_root / "cat.png").read_bytes()
    prompt = "<image>\nWhat is in the picture?"
    first = generate(llava, prompt, image_data=picture)
    assert first.usage is not None and first.usage.prompt_tokens > 16  # the image fills 16 positions
    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    pixels = processor.image_processor(images=Image.open(io.BytesIO(picture)), return_tensors="np")["pixel_values"]
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        features = model.get_image_features(pixel_values=torch.from_numpy(pixels), vision_feature_layer=-2,
                                            vision_feature_select_strategy="default")
    rows = (features.pooler_output if hasattr(features, "pooler_output") else features)
    rows = torch.cat(list(rows)) if isinstance(rows, (list, tuple)) else rows.reshape(-1, rows.shape[-1])
    forms = {
        "data URI": "data:image/png;base64," + base64.b64encode(picture).decode(),
        "URL": f"{http_url}/cat.png",
        "path": str(media_root / "cat.png"),
        "file URL": (media_root / "cat.png").as_uri(),
        "processor output": processor_output({"pixel_values": pixels}),
    }
    for name, item in forms.items():
        again = generate(llava, prompt, image_data=item)
        assert same(again, first), name
    given = generate(llava, prompt, image_data=embedding(rows.numpy().astype(np.float32)))
    # The rows computed by transformers in this process: the server's encoder is the same modules on the same pixels.
    assert same(given, first), (logprobs(given), logprobs(first))


def test_llava_a_repeated_image_is_cached_and_another_is_not(llava: Client, media_root: Path) -> None:
    prompt = "Look: <image> and tell me."
    picture, other = png(11), png(12)
    cold = generate(llava, prompt, image_data=picture)
    warm = generate(llava, prompt, image_data=picture)
    assert same(warm, cold)
    assert warm.usage is not None and cold.usage is not None
    assert warm.usage.cached_tokens == warm.usage.prompt_tokens - 1  # all but the position that samples
    fresh = generate(llava, prompt, image_data=other)
    # Only the text before the image ("Look: ", a few tokens) can be shared with the other image's prompt.
    assert fresh.usage is not None and fresh.usage.cached_tokens < 8
    assert not same(fresh, cold)


def test_llava_media_beside_text_equals_alone(llava: Client) -> None:
    jobs: list[tuple[str, dict[str, Any]]] = [
        ("<image> first", {"image_data": png(21)}),
        ("The capital of France is", {}),
        ("<image> second", {"image_data": png(22)}),
        ("Count: 1, 2, 3,", {}),
        ("<image><image> both", {"image_data": [png(21), png(22)]}),
    ]
    alone = [generate(llava, p, **m) for p, m in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs) * 2) as pool:
        together = list(pool.map(lambda j: generate(llava, j[0], **j[1]), jobs * 2))
    for i, result in enumerate(together):
        assert same(result, alone[i % len(jobs)]), jobs[i % len(jobs)][0]


def test_llava_errors_name_the_item(llava: Client) -> None:
    with pytest.raises(LmrpcError) as info:
        llava.generate(["<image> a", "<image> b"], image_data=[[png(1)], [png(2), b"not an image"]],
                       sampling_params=GREEDY)
    assert info.value.code.name == "INVALID_ARGUMENT"
    assert "image_data[1].items[1]" in str(info.value)
    with pytest.raises(LmrpcError) as info:
        llava.generate("no placeholder here", image_data=png(1), sampling_params=GREEDY)
    assert info.value.code.name == "INVALID_ARGUMENT" and "image_data[0].items[0]" in str(info.value)
    with pytest.raises(LmrpcError) as info:
        llava.generate("<image>", image_data="/etc/passwd", sampling_params=GREEDY)
    assert info.value.code.name == "PERMISSION_DENIED"
    assert generate(llava, "<image> still serving", image_data=png(1)).token_ids


def wav(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """16-bit samples written as they are (libsndfile rounds float samples to 16 bits differently per format)."""
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, subtype="PCM_16")
    return out.getvalue()


def test_qwen2_audio_wav_and_flac_of_one_clip_agree_and_cache(launch_server: Callable[..., RunningServer],
                                                              tiny_qwen2_audio_dir: Path, media_root: Path) -> None:
    rng = np.random.default_rng(5)
    wave = 0.3 * np.sin(np.linspace(0, 440 * 2 * np.pi, 8000)) + 0.05 * rng.standard_normal(8000)
    clip = np.round(wave * 32767).astype(np.int16)
    running = media_server(launch_server, tiny_qwen2_audio_dir, media_root)
    try:
        with Client(running.target) as client:
            prompt = "<|audio_bos|><|AUDIO|><|audio_eos|>What is this sound?"
            first = generate(client, prompt, audio_data=wav(clip, 16000, "WAV"))
            again = generate(client, prompt, audio_data=wav(clip, 16000, "FLAC"))
            assert same(again, first)
            assert again.usage is not None and first.usage is not None
            assert again.usage.cached_tokens == first.usage.prompt_tokens - 1  # all but the position that samples
            resampled = generate(client, prompt, audio_data=wav(clip[::2].copy(), 8000, "WAV"))
            assert resampled.usage is not None and resampled.usage.cached_tokens < again.usage.cached_tokens
    finally:
        assert running.stop() == 0


def test_qwen2vl_forms_agree_and_rows_alone_are_refused(launch_server: Callable[..., RunningServer],
                                                        tiny_qwen2vl_dir: Path, media_root: Path) -> None:
    picture = png(31, (56, 84))
    # The image processor alone: transformers' Qwen2VLProcessor also builds a video processor, which needs torchvision.
    images = Qwen2VLImageProcessorPil.from_pretrained(tiny_qwen2vl_dir)
    out = images(images=Image.open(io.BytesIO(picture)), return_tensors="np")
    running = media_server(launch_server, tiny_qwen2vl_dir, media_root)
    try:
        with Client(running.target) as client:
            prompt = "<|vision_start|><|image_pad|><|vision_end|>Describe it."
            first = generate(client, prompt, image_data=picture)
            tensors = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
            assert same(generate(client, prompt, image_data=processor_output(tensors)), first)
            assert same(generate(client, prompt,
                                 image_data="data:image/png;base64," + base64.b64encode(picture).decode()), first)
            with pytest.raises(LmrpcError) as info:
                client.generate(prompt, image_data=embedding(np.zeros((4, 64), dtype=np.float32)),
                                sampling_params=GREEDY)
            assert info.value.code.name == "INVALID_ARGUMENT" and "image_data[0].items[0]" in str(info.value)
    finally:
        assert running.stop() == 0


def test_llava_chat_image_part_is_placed_and_cached(llava: Client) -> None:
    uri = "data:image/png;base64," + base64.b64encode(png(41)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                              {"type": "text", "text": "What is in it?"}]}]
    first = llava.chat(messages, max_tokens=6, temperature=0.0)
    again = llava.chat(messages, max_tokens=6, temperature=0.0)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens > 16  # the image's 16 positions, the template's text around them
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1
    with pytest.raises(LmrpcError) as info:  # an image part that does not decode: the part is named
        llava.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                 {"type": "image_url", "image_url": {"url": "data:,"}}]}],
                   max_tokens=2)
    assert info.value.code.name == "INVALID_ARGUMENT" and "content_parts[1]" in str(info.value)
