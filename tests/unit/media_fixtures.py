"""What the media tests share: a picture (opaque, or with transparency) and a tone made here (encoded as
PNG/JPEG/WebP, WAV/FLAC/MP3), and a loopback HTTP server started by the test (http.server on a thread) with the
routes the fetch rules need."""

from __future__ import annotations

import base64
import io
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import soundfile
from PIL import Image

WIDTH, HEIGHT = 32, 24
TONE_RATE = 44100  # the clips' own rate
TONE_HZ = 440.0
TONE_SECONDS = 1.0
SLOW_SECONDS = 3.0  # how long /slow waits before answering


def picture() -> Image.Image:
    """A deterministic RGB picture: a gradient with a few hard edges (so lossy codecs change it, lossless do not)."""
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    pixels = np.stack([x * 8, y * 10, (x * y) % 256], axis=-1).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def transparent(kind: str = "RGBA") -> Image.Image:
    """The picture with transparency in one of the ways a PNG holds it: an alpha band ("RGBA", "LA"), a palette's
    transparent entries ("P"), a colour key ("RGB+tRNS"). The alpha runs through every level, 0 and 255 among them."""
    base = picture()
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    alpha = Image.fromarray(((x * 11 + y * 7) % 256).astype(np.uint8), "L")
    if kind in ("RGBA", "LA"):
        image = base if kind == "RGBA" else base.convert("L")
        image.putalpha(alpha)
        return image
    if kind == "P":
        palette = base.quantize(16)
        palette.info["transparency"] = bytes([0, 128] + [255] * 14)
        return palette
    assert kind == "RGB+tRNS"
    base.info["transparency"] = tuple(int(v) for v in np.asarray(base)[0, 0])
    return base


def encoded(fmt: str, image: Image.Image | None = None) -> bytes:
    out = io.BytesIO()
    extra = {"lossless": True} if fmt == "WEBP" else {}
    (image or picture()).save(out, format=fmt, **extra)
    return out.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height and whose data is a few bytes: what a decompression bomb looks like
    before it is decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + \
        chunk(b"IEND", b"")


def tone(seconds: float = TONE_SECONDS, rate: int = TONE_RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)


def clip(fmt: str, samples: np.ndarray | None = None, rate: int = TONE_RATE) -> bytes:
    """The tone (or `samples`: [n] or [n, channels]) encoded as WAV, FLAC or MP3 by libsndfile."""
    out = io.BytesIO()
    data = tone() if samples is None else samples
    if fmt == "MP3":
        soundfile.write(out, data, rate, format=fmt, subtype="MPEG_LAYER_III")
    else:  # 16-bit PCM, quantized here: WAV and FLAC then hold the very same integers
        soundfile.write(out, np.round(data * 32767).astype(np.int16), rate, format=fmt, subtype="PCM_16")
    return out.getvalue()


@dataclass
class Loopback:
    """The test's HTTP server: routes on 127.0.0.1:port."""

    port: int
    routes: dict[str, bytes]  # path -> body served with 200

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def _handler(server: Loopback) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def _redirect(self, to: str) -> None:
            self.send_response(302)
            self.send_header("Location", to)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            path = self.path
            if path in server.routes:
                body = server.routes[path]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif path == "/slow":
                time.sleep(SLOW_SECONDS)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif path == "/endless":  # no Content-Length: the body runs until the client stops reading
                self.send_response(200)
                self.end_headers()
                try:
                    for _ in range(10_000):
                        self.wfile.write(b"\x00" * 65536)
                except (BrokenPipeError, ConnectionResetError):
                    pass
            elif path == "/declared-big":
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 30))
                self.end_headers()
            elif path.startswith("/to/"):  # /to/<path>: a relative redirect on this host
                self._redirect(path[3:])
            elif path.startswith("/to-localhost/"):  # the same port under another host name
                self._redirect(f"http://localhost:{server.port}{path[len('/to-localhost'):]}")
            elif path == "/loop":
                self._redirect("/loop")
            elif path == "/broken":
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

    return Handler


@contextmanager
def loopback(routes: dict[str, bytes]) -> Iterator[Loopback]:
    state = Loopback(0, routes)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
