"""Where media bytes come from (server/lmrpc/server/media/sources.py): data: URIs, http(s) against a loopback server
started here (limits on time and size, redirects re-checked, hosts allowed), local paths confined to a root."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from media_fixtures import Loopback, closed_port, data_uri, encoded, loopback

from lmrpc.server.config import MediaConfig
from lmrpc.server.media import sources
from lmrpc.server.media.sources import SourceError, SourceErrorKind

FIELD = "image_data[0].items[1]"
PNG = encoded("PNG")


@pytest.fixture(scope="module")
def web() -> Iterator[Loopback]:
    with loopback({"/a.png": PNG}) as server:
        yield server


async def read(url: str, config: MediaConfig | None = None) -> bytes:
    config = config or MediaConfig()
    async with sources.new_client(config) as client:
        return await sources.read_url(url, FIELD, config, client)


async def refused(url: str, config: MediaConfig | None = None) -> SourceError:
    with pytest.raises(SourceError) as err:
        await read(url, config)
    assert err.value.field == FIELD
    return err.value


# ---- data: URIs ---------------------------------------------------------------------------------------------------


async def test_data_uri_gives_the_bytes() -> None:
    assert await read(data_uri(PNG)) == PNG
    assert await read(data_uri(PNG).replace("data:", "DATA:", 1)) == PNG  # the scheme is case-insensitive


@pytest.mark.parametrize(("uri", "says"), [
    ("data:image/png;base64,!!!notbase64", "does not decode"),
    ("data:image/png;base64,QUJDR", "does not decode"),  # a length no padding explains
    ("data:image/png,rawtext", "not base64"),
    ("data:image/png;base64", "without a comma"),
])
async def test_bad_data_uri_is_invalid(uri: str, says: str) -> None:
    err = await refused(uri)
    assert err.kind is SourceErrorKind.INVALID and says in err.message


async def test_data_uri_over_the_size_limit_is_refused() -> None:
    err = await refused(data_uri(PNG), MediaConfig(max_media_bytes=len(PNG) - 1))
    assert err.kind is SourceErrorKind.INVALID and "--max-media-bytes" in err.message


# ---- http(s) ------------------------------------------------------------------------------------------------------


async def test_loopback_url_is_fetched(web: Loopback) -> None:
    assert await read(web.url("/a.png")) == PNG
    assert await read(web.url("/to/a.png")) == PNG  # a redirect on an allowed host is followed


async def test_404_is_invalid_with_the_cause(web: Loopback) -> None:
    err = await refused(web.url("/missing.png"))
    assert err.kind is SourceErrorKind.INVALID and "404" in err.message and "/missing.png" in err.message


async def test_server_error_is_unavailable(web: Loopback) -> None:
    err = await refused(web.url("/broken"))
    assert err.kind is SourceErrorKind.UNAVAILABLE and "500" in err.message


async def test_unreachable_url_is_unavailable_with_the_cause() -> None:
    err = await refused(f"http://127.0.0.1:{closed_port()}/a.png")
    assert err.kind is SourceErrorKind.UNAVAILABLE and "unreachable" in err.message


async def test_slow_url_times_out(web: Loopback) -> None:
    err = await refused(web.url("/slow"), MediaConfig(media_fetch_timeout=0.3))
    assert err.kind is SourceErrorKind.UNAVAILABLE
    assert "--media-fetch-timeout" in err.message or "timed out" in err.message


async def test_body_past_the_limit_stops_the_download(web: Loopback) -> None:
    err = await refused(web.url("/endless"), MediaConfig(max_media_bytes=1 << 20))
    assert err.kind is SourceErrorKind.INVALID and "--max-media-bytes" in err.message
    err = await refused(web.url("/declared-big"), MediaConfig(max_media_bytes=1 << 20))
    assert "1073741824 bytes" in err.message  # refused on the Content-Length, before reading


async def test_host_not_allowed_is_permission_denied(web: Loopback) -> None:
    config = MediaConfig(allowed_media_domains=("example.com",))
    err = await refused(web.url("/a.png"), config)
    assert err.kind is SourceErrorKind.PERMISSION and "127.0.0.1" in err.message
    assert await read(web.url("/a.png"), MediaConfig(allowed_media_domains=("127.0.0.1",))) == PNG
    err = await refused(web.url("/a.png"), MediaConfig(allowed_media_domains=()))  # the flag with no host: none
    assert err.kind is SourceErrorKind.PERMISSION


async def test_redirect_to_a_host_not_allowed_is_refused(web: Loopback) -> None:
    config = MediaConfig(allowed_media_domains=("127.0.0.1",))
    err = await refused(web.url("/to-localhost/a.png"), config)
    assert err.kind is SourceErrorKind.PERMISSION and "'localhost'" in err.message
    # without the flag the same redirect is followed
    assert await read(web.url("/to-localhost/a.png")) == PNG


async def test_redirect_loop_ends(web: Loopback) -> None:
    err = await refused(web.url("/loop"))
    assert err.kind is SourceErrorKind.INVALID and "redirected more than" in err.message


async def test_other_schemes_and_hostless_urls_are_refused() -> None:
    err = await refused("ftp://example.com/a.png")
    assert "ftp" in err.message
    err = await refused("http:///a.png")
    assert err.kind is SourceErrorKind.INVALID and "names no host" in err.message


# ---- local paths --------------------------------------------------------------------------------------------------


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    return tmp_path / "media"


async def test_path_under_the_root_is_read(root: Path) -> None:
    config = MediaConfig(allowed_local_media_path=str(root))
    assert await read(str(root / "a.png"), config) == PNG
    assert await read((root / "a.png").as_uri(), config) == PNG  # file:// URL
    assert await read("a.png", config) == PNG  # relative: to the root


async def test_path_outside_the_root_is_permission_denied(root: Path) -> None:
    config = MediaConfig(allowed_local_media_path=str(root))
    for url in (str(root.parent / "secret.png"), str(root / ".." / "secret.png"), "../secret.png",
                (root.parent / "secret.png").as_uri()):
        err = await refused(url, config)
        assert err.kind is SourceErrorKind.PERMISSION, url


async def test_symlink_escaping_the_root_is_permission_denied(root: Path) -> None:
    os.symlink(root.parent / "secret.png", root / "link.png")
    err = await refused(str(root / "link.png"), MediaConfig(allowed_local_media_path=str(root)))
    assert err.kind is SourceErrorKind.PERMISSION
    os.symlink(root / "a.png", root / "inside.png")  # a link that stays inside is read
    assert await read(str(root / "inside.png"), MediaConfig(allowed_local_media_path=str(root))) == PNG


async def test_odd_paths_are_invalid_not_errors(root: Path) -> None:
    config = MediaConfig(allowed_local_media_path=str(root))
    os.symlink(root / "loop", root / "loop")
    for url in ("a\x00.png", str(root / "loop")):
        err = await refused(url, config)
        assert err.kind in (SourceErrorKind.INVALID, SourceErrorKind.PERMISSION), url


async def test_no_root_configured_reads_no_file(root: Path) -> None:
    err = await refused(str(root / "a.png"))
    assert err.kind is SourceErrorKind.PERMISSION and "--allowed-local-media-path" in err.message


async def test_missing_or_oversized_local_file_is_invalid(root: Path) -> None:
    err = await refused(str(root / "none.png"), MediaConfig(allowed_local_media_path=str(root)))
    assert err.kind is SourceErrorKind.INVALID and "no such file" in err.message
    err = await refused(str(root / "a.png"), MediaConfig(allowed_local_media_path=str(root),
                                                         max_media_bytes=len(PNG) - 1))
    assert err.kind is SourceErrorKind.INVALID and "--max-media-bytes" in err.message


def test_config_checks_its_flags(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="allowed_media_domains"):
        MediaConfig(allowed_media_domains=("http://example.com",))
    with pytest.raises(ValueError, match="allowed_local_media_path"):
        MediaConfig(allowed_local_media_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="media_fetch_timeout"):
        MediaConfig(media_fetch_timeout=0)
    with pytest.raises(ValueError, match="max_media_items"):
        MediaConfig(max_media_items=0)


def test_media_flags_become_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmrpc.server.__main__ import parse_args, server_config

    media = server_config(parse_args(["--allowed-media-domains", "a.example", "b.example",
                                      "--allowed-local-media-path", str(tmp_path), "--max-media-items", "3"])).media
    assert media.allowed_media_domains == ("a.example", "b.example") and media.max_media_items == 3
    assert media.allowed_local_media_path == str(tmp_path)
    assert server_config(parse_args([])).media == MediaConfig()  # defaults: any host, no local files
    assert server_config(parse_args(["--allowed-media-domains"])).media.allowed_media_domains == ()
    with pytest.raises(SystemExit) as exit_:
        server_config(parse_args(["--max-audio-seconds", "0"]))
    assert exit_.value.code == 2 and "--max-audio-seconds" in capsys.readouterr().err
