"""Where a media item's encoded bytes come from: the request's own bytes, a base64 `data:` URI, an http(s) URL
(fetched with a time limit, a size limit enforced while streaming, redirects re-checked against the allowed hosts),
or a `file://` URL / plain path confined to --allowed-local-media-path (every part of the path, the file included,
must resolve under it: userinput.open_confined). A URL or path with NUL or another control character is refused.
Each failure is a `SourceError` naming the item's wire field, with the status kind it calls for (see
`SourceErrorKind`); user input it echoes is cut to 200 characters (clip). No decoding here (decode.py)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import enum
import os
import urllib.parse

import httpx2

from lmrpc.server.config import MediaConfig
from lmrpc.server.media.types import MediaError
from lmrpc.server.userinput import OutsideRoot, clip, has_control, read_confined

MAX_REDIRECTS = 5  # redirects one fetch follows, each re-checked against --allowed-media-domains
CHUNK = 64 * 1024  # bytes read at a time from a file


class SourceErrorKind(enum.Enum):
    """Which status a source failure is answered with."""

    INVALID = "INVALID_ARGUMENT"  # the item itself is wrong: bad base64, too large, an HTTP error status
    PERMISSION = "PERMISSION_DENIED"  # a host or path the server's flags do not allow
    UNAVAILABLE = "UNAVAILABLE"  # the URL could not be reached in time (connection refused, timeout, 5xx)


class SourceError(MediaError):
    """A media item whose bytes cannot be had; `kind` says which status (MediaError alone: INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str, kind: SourceErrorKind = SourceErrorKind.INVALID) -> None:
        super().__init__(field, message)
        self.kind = kind


def _shown(url: object) -> str:
    """A URL or path for an error message (user input: cut to 200 characters)."""
    return clip(repr(str(url)))


def check_size(size: int, field: str, config: MediaConfig) -> None:
    if size > config.max_media_bytes:
        raise SourceError(field, f"is {size} bytes; the server takes at most {config.max_media_bytes} per item "
                                 "(--max-media-bytes)")


def is_local(url: str) -> bool:
    """A file:// URL or a plain path (anything without a scheme we fetch or decode)."""
    return urllib.parse.urlsplit(url).scheme.lower() in ("file", "")


def read_data_uri(url: str, field: str, config: MediaConfig) -> bytes:
    """data:[<mediatype>][;base64],<data> -> the bytes (base64 only: media is binary)."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise SourceError(field, "is a data: URI without a comma before its data")
    if not header.lower().endswith(";base64"):
        raise SourceError(field, "is a data: URI that is not base64 (write data:<type>;base64,<data>)")
    # base64 is 4 characters per 3 bytes: refuse an oversized payload before decoding it
    check_size(len(payload) // 4 * 3, field, config)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:  # (ValueError: non-ASCII text)
        raise SourceError(field, f"is a data: URI whose base64 does not decode: {clip(str(exc))}") from exc
    check_size(len(data), field, config)
    return data


def decode_base64(text: str, field: str, config: MediaConfig) -> bytes:
    """Plain base64 text (ChatComplete's input_audio.data) -> bytes."""
    return read_data_uri(f"data:;base64,{text}", field, config)


def local_path(url: str, field: str, config: MediaConfig) -> tuple[str, str]:
    """(the path a file:// URL or plain path names, the real --allowed-local-media-path it must resolve under);
    PERMISSION_DENIED without that flag or for a file:// URL naming another host."""
    root = config.allowed_local_media_path
    if root is None:
        raise SourceError(field, "names a local file; this server reads none (start it with "
                                 "--allowed-local-media-path DIR)", SourceErrorKind.PERMISSION)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() == "file":
        if parts.netloc not in ("", "localhost"):
            raise SourceError(field, f"file:// URL names host {_shown(parts.netloc)}; only local files are read",
                              SourceErrorKind.PERMISSION)
        raw = urllib.parse.unquote(parts.path)
    else:
        raw = url
    if has_control(raw):  # (%00 or %0A in a file:// URL too)
        raise SourceError(field, "a path must not contain NUL or control characters")
    return raw, os.path.realpath(root)


def read_local(url: str, field: str, config: MediaConfig) -> bytes:
    """A confined local file's bytes, read up to the size limit (blocking: call it off the event loop). The path is
    resolved (symlinks and .. on both sides) and must lie under the root, and the file is opened along that
    resolved path one part at a time without following symlinks, so what is read is what was checked."""
    raw, root = local_path(url, field, config)
    shown = _shown(url)
    try:
        data = read_confined(raw, root, config.max_media_bytes)
    except OutsideRoot as exc:
        raise SourceError(field, f"{shown} is outside the server's --allowed-local-media-path",
                          SourceErrorKind.PERMISSION) from exc
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise SourceError(field, f"{shown}: no such file") from exc
    except IsADirectoryError as exc:
        raise SourceError(field, f"{shown} is a directory") from exc
    except OSError as exc:  # not a regular file (a FIFO, a device), no permission, a name too long
        raise SourceError(field, f"{shown} cannot be read: {exc.strerror or exc}") from exc
    if len(data) > config.max_media_bytes:
        raise SourceError(field, f"{shown} is larger than {config.max_media_bytes} bytes (--max-media-bytes)")
    return data


def check_host(url: httpx2.URL, field: str, config: MediaConfig) -> None:
    """An http(s) URL whose host --allowed-media-domains lets the server fetch."""
    if url.scheme not in ("http", "https"):
        raise SourceError(field, f"URL scheme {_shown(url.scheme)} is not fetched (http, https, data: or a local path)",
                          SourceErrorKind.PERMISSION if url.scheme else SourceErrorKind.INVALID)
    allowed = config.allowed_media_domains
    host = url.host.lower().rstrip(".")
    if not host:
        raise SourceError(field, f"URL {_shown(url)} names no host")
    if allowed is not None and host not in {d.lower().rstrip(".") for d in allowed}:
        raise SourceError(field, f"host {_shown(host)} is not among the server's --allowed-media-domains",
                          SourceErrorKind.PERMISSION)


async def fetch(url: str, field: str, config: MediaConfig, client: httpx2.AsyncClient) -> bytes:
    """An http(s) URL's body, within --media-fetch-timeout (all redirects included) and --max-media-bytes (the
    download stops once past it)."""
    try:
        return await asyncio.wait_for(_fetch(url, field, config, client), config.media_fetch_timeout)
    except asyncio.TimeoutError as exc:
        raise SourceError(field, f"fetching {_shown(url)} took longer than {config.media_fetch_timeout:g} s "
                                 "(--media-fetch-timeout)", SourceErrorKind.UNAVAILABLE) from exc


async def _fetch(url: str, field: str, config: MediaConfig, client: httpx2.AsyncClient) -> bytes:
    try:
        current = httpx2.URL(url)
    except httpx2.InvalidURL as exc:
        raise SourceError(field, f"is not a valid URL: {clip(str(exc))}") from exc
    for _ in range(MAX_REDIRECTS + 1):
        check_host(current, field, config)
        try:
            async with client.stream("GET", current, follow_redirects=False) as response:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise SourceError(field, f"{_shown(current)} answered {response.status_code} without a "
                                                 "Location")
                    current = current.join(location)
                    continue
                if response.status_code >= 400:
                    kind = SourceErrorKind.UNAVAILABLE if response.status_code >= 500 else SourceErrorKind.INVALID
                    raise SourceError(field, f"fetching {_shown(current)} answered {response.status_code} "
                                             f"{clip(response.reason_phrase)}", kind)
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit():
                    check_size(int(declared), field, config)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > config.max_media_bytes:
                        raise SourceError(field, f"{_shown(current)} is larger than {config.max_media_bytes} bytes "
                                                 "(--max-media-bytes)")
                return bytes(body)
        except httpx2.TimeoutException as exc:
            raise SourceError(field, f"fetching {_shown(current)} timed out: {clip(str(exc)) or type(exc).__name__}",
                              SourceErrorKind.UNAVAILABLE) from exc
        except httpx2.TransportError as exc:  # connection refused, DNS, TLS, a reset
            raise SourceError(field, f"{_shown(current)} is unreachable: {clip(str(exc)) or type(exc).__name__}",
                              SourceErrorKind.UNAVAILABLE) from exc
        except httpx2.InvalidURL as exc:
            raise SourceError(field, f"redirected to an invalid URL: {clip(str(exc))}") from exc
    raise SourceError(field, f"{_shown(url)} redirected more than {MAX_REDIRECTS} times")


async def read_url(url: str, field: str, config: MediaConfig, client: httpx2.AsyncClient | None) -> bytes:
    """Any url a MediaItem may carry -> its encoded bytes (`client`: for http(s) URLs; new_client's)."""
    # A data: URI's base64 may be wrapped in lines (its whitespace is dropped; any other control character fails
    # to decode), so only its header is checked here.
    if has_control(url.partition(",")[0] if url[:5].lower() == "data:" else url):
        raise SourceError(field, "a URL or path must not contain NUL or control characters")
    if url[:5].lower() == "data:":
        return read_data_uri(url, field, config)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        assert client is not None, "the caller makes a client for requests with http(s) URLs"
        return await fetch(url, field, config, client)
    if is_local(url):
        return await asyncio.to_thread(read_local, url, field, config)
    raise SourceError(field, f"URL scheme {_shown(scheme)} is not read (http, https, data:, file:// or a path)")


def new_client(config: MediaConfig) -> httpx2.AsyncClient:
    """The HTTP client of one request's fetches (redirects followed by hand, so each is checked). Bodies are asked
    for uncompressed: the size limit then counts what was sent (a compressed body is still counted as it inflates)."""
    return httpx2.AsyncClient(follow_redirects=False, timeout=httpx2.Timeout(config.media_fetch_timeout),
                              headers={"accept-encoding": "identity"})
