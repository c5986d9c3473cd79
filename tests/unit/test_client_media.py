"""The client's media arguments: Python values -> image_data / audio_data messages, and the CLI's --image/--audio."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_generate_server import FakeGenerateService, running_fake_server

from lmrpc.client import Client
from lmrpc.client.cli import main
from lmrpc.client.media import embedding, media_lists, processor_output, tensor
from lmrpc.v1 import generate_pb2

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeGenerateService]]:
    with running_fake_server() as s:
        yield s


def test_media_shapes() -> None:
    assert media_lists(None) == []
    one = media_lists("https://example.com/cat.png")
    assert len(one) == 1 and one[0].items[0].url == "https://example.com/cat.png"
    flat = media_lists([b"\x89PNG", "data:image/png;base64,AAAA"])
    assert len(flat) == 1 and flat[0].items[0].data == b"\x89PNG" and flat[0].items[1].url.startswith("data:")
    per_prompt = media_lists([["a.png"], [], ["b.png", "c.png"]])
    assert [len(m.items) for m in per_prompt] == [1, 0, 2]
    with pytest.raises(TypeError, match="not a mix"):
        media_lists(["a.png", ["b.png"]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="media item"):
        media_lists([3])  # type: ignore[list-item]


def test_tensors_keep_dtype_shape_and_bytes() -> None:
    pixels = np.arange(12, dtype=np.float32).reshape(3, 4)
    grid = np.array([[1, 2, 2]], dtype=np.int64)
    item = processor_output({"pixel_values": pixels, "image_grid_thw": grid}, max_pixels=4096)
    t = item.processor_output.tensors["pixel_values"]
    assert t.dtype == "float32" and list(t.shape) == [3, 4]
    assert np.array_equal(np.frombuffer(t.data, dtype="<f4").reshape(3, 4), pixels)
    assert item.processor_output.tensors["image_grid_thw"].dtype == "int64" and item.max_pixels == 4096
    rows = embedding(np.ones((5, 8), dtype=np.float16))
    assert rows.embedding.dtype == "float16" and list(rows.embedding.shape) == [5, 8]
    with pytest.raises(TypeError, match="dtype"):
        tensor(np.ones(3, dtype=np.uint8))


def test_generate_sends_media(server: tuple[str, FakeGenerateService]) -> None:
    with Client(server[0]) as client:
        client.generate("<image> what is it?", image_data=b"PNGDATA", audio_data=["https://example.com/a.wav"],
                        sampling_params={"max_new_tokens": 2})
    sent = server[1].requests[-1]
    assert [i.data for i in sent.image_data[0].items] == [b"PNGDATA"]
    assert [i.url for i in sent.audio_data[0].items] == ["https://example.com/a.wav"]


def test_cli_reads_local_files_and_passes_urls(server: tuple[str, FakeGenerateService], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    picture = tmp_path / "cat.png"
    picture.write_bytes(b"\x89PNG fake")
    code = main(["generate", "<image><image> compare", "--target", server[0], "--image", str(picture),
                 "--image", "https://example.com/dog.png", "--max-new-tokens", "2"])
    assert code == 0, capsys.readouterr().err
    items = server[1].requests[-1].image_data[0].items
    assert items[0].data == b"\x89PNG fake" and items[1].url == "https://example.com/dog.png"
    code = main(["generate", "x", "--target", server[0], "--image", str(tmp_path / "missing.png")])
    assert code == 2 and "missing.png" in capsys.readouterr().err
    assert isinstance(items[0], generate_pb2.MediaItem)
