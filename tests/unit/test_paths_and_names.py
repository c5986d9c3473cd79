"""What a hostile client names: every file opened for it resolves inside its root, file symlinks included
(userinput.py open_confined, the LoRA registry, media sources); NUL and control characters in paths are
INVALID_ARGUMENT, not UNKNOWN; adapter names follow one short rule (requests and --lora-modules); user input echoed
in an error is cut to 200 characters."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from lora_adapters import make_adapter

from lmrpc.server import statuses, userinput
from lmrpc.server.config import LoraConfig, MediaConfig, ModelConfig
from lmrpc.server.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from lmrpc.server.lora.errors import NAME_RULE, AdapterError, AdapterErrorKind, valid_name
from lmrpc.server.lora.registry import LoraRegistry
from lmrpc.server.media import sources
from lmrpc.server.media.sources import SourceError, SourceErrorKind
from lmrpc.server.models.llama import LlamaForCausalLM
from lmrpc.server.models.loader import load_model
from lmrpc.server.userinput import OutsideRoot, clip, has_control, open_confined, read_confined

FIELD = "image_data[0].items[0]"
HUGE = "a" * 100_000


# ---- the shared helpers ------------------------------------------------------------------------------------------


def test_clip_control_and_name_rules() -> None:
    assert clip("short") == "short" and len(clip(HUGE)) == 200 and clip(HUGE).endswith("\u2026")
    assert all(has_control(t) for t in ("a\x00b", "a\nb", "\x7f", "a\x85b", "\r"))
    assert not has_control("täst/ok name.png")
    for good in ("a1", "m1", "my-adapter", "team/sql_v1.2", "/abs/path/under/root", "A" * 128):
        assert valid_name(good), good
    for bad in ("", ".", "..", ".hidden", "a" * 129, HUGE, "a\x00b", "a\nb", "base:adapter", "a b", "é"):
        assert not valid_name(bad), bad
    assert "128" in NAME_RULE


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/ with a file, a dir; outside/ with a secret; links to both from inside root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (root / "d" / "f").write_bytes(b"inside")
    (outside / "secret").write_bytes(b"secret")
    os.symlink(outside / "secret", root / "d" / "out_file")  # a file symlink pointing out
    os.symlink(outside, root / "out_dir")  # a directory symlink pointing out
    os.symlink(root / "d" / "f", root / "in_file")  # stays inside
    os.symlink("d", root / "in_dir")
    return root


def test_open_confined_follows_links_only_inside_the_root(tree: Path) -> None:
    root = os.path.realpath(tree)
    assert read_confined("d/f", root) == b"inside"
    assert read_confined(str(tree / "d" / "f"), root) == b"inside"  # absolute, under the root
    assert read_confined("in_file", root) == b"inside" and read_confined("in_dir/f", root) == b"inside"
    for path in ("d/out_file", "out_dir/secret", "../outside/secret", str(tree.parent / "outside" / "secret")):
        with pytest.raises(OutsideRoot):
            read_confined(path, root)
    with pytest.raises(FileNotFoundError):
        read_confined("d/none", root)
    with pytest.raises(IsADirectoryError):
        read_confined("d", root)
    os.mkfifo(tree / "fifo")  # opening must not wait for a writer
    with pytest.raises(OSError) as info:
        read_confined("fifo", root)
    assert info.value.errno == errno.EINVAL
    os.close(open_confined("in_dir", root, directory=True))
    assert read_confined("d/f", root, limit=2) == b"ins"  # limit + 1 bytes at most


def test_a_part_swapped_for_a_symlink_after_the_check_is_not_followed(tree: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Between resolving and opening, a directory becomes a symlink out of the root: the walk does not follow it."""
    root = os.path.realpath(tree)
    # As if `out_dir` had been a real directory when the path was resolved.
    monkeypatch.setattr(userinput, "resolve_under", lambda r, p: os.path.join(r, p))
    for path in ("out_dir/secret", "d/out_file"):
        with pytest.raises(OutsideRoot):
            read_confined(path, root)
    assert read_confined("d/f", root) == b"inside"


# ---- LoRA adapters -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir: Path) -> LlamaForCausalLM:
    model = load_model(ModelConfig(path=str(tiny_llama_dir), dtype="float32", device="cpu")).model
    assert isinstance(model, LlamaForCausalLM)
    return model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """base/root/a1 (a real adapter); base/root/linked_out: its two files symlinks to base/outside's adapter;
    base/root/linked_in: symlinks to a1's files (inside the root)."""
    base = tmp_path_factory.mktemp("lora-paths")
    root = base / "root"
    make_adapter(tiny_llama_dir, root / "a1", rank=4, seed=1)
    make_adapter(tiny_llama_dir, base / "outside", rank=2, seed=2)
    for name, target in (("linked_out", base / "outside"), ("linked_in", root / "a1")):
        (root / name).mkdir()
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            os.symlink(target / file, root / name / file)
    return root


def _error(call: Callable[..., object], *args: object, **kwargs: object) -> AdapterError:
    with pytest.raises(AdapterError) as err:
        call(*args, **kwargs)
    return err.value


def test_adapter_files_symlinked_out_of_the_root_are_permission_denied(tiny_model: LlamaForCausalLM,
                                                                       adapters: Path) -> None:
    registry = LoraRegistry(LoraConfig(lora_root=str(adapters)), tiny_model)
    for err in (_error(registry.resolve, "linked_out"), _error(registry.load, "x", "linked_out", confined=True),
                _error(registry.load, "y", str(adapters / "linked_out"), confined=True)):
        assert err.kind is AdapterErrorKind.PERMISSION and "--lora-root" in err.message
    assert registry.names() == []
    assert registry.resolve("linked_in").rank == 4  # the same layout with links that stay inside loads
    # An operator's --lora-modules may name any directory: not confined.
    assert registry.load("start", str(adapters / "linked_out"), confined=False, pinned=True).rank == 2


def test_nul_and_control_characters_in_a_path_are_invalid(tiny_model: LlamaForCausalLM, adapters: Path) -> None:
    registry = LoraRegistry(LoraConfig(lora_root=str(adapters)), tiny_model)
    for path in ("a1\x00", "a\x00/../a1", "a1\n", "a1\x1b[31m"):
        for err in (_error(registry.resolve, path), _error(registry.load, "n", path, confined=True)):
            assert err.kind is AdapterErrorKind.INVALID and "control characters" in err.message, repr(path)
    assert statuses.adapter_error(err, "lora_path[0]").code is grpc.StatusCode.INVALID_ARGUMENT
    err = _error(registry.resolve, "a/" * 50_000)  # no NUL, but past PATH_MAX: refused before resolving
    assert err.kind is AdapterErrorKind.INVALID and len(err.message) < 400


def test_adapter_names_follow_the_rule(tiny_model: LlamaForCausalLM, adapters: Path) -> None:
    registry = LoraRegistry(LoraConfig(lora_root=str(adapters)), tiny_model)
    for name in (HUGE, "a\x00b", "sql\nadapter", "base:sql", ".hidden", ""):
        err = _error(registry.load, name, "a1", confined=True)
        assert err.kind is AdapterErrorKind.INVALID and err.field == "name", repr(name[:20])
        assert NAME_RULE in err.message and len(err.message) < 400  # the name echoed is clipped
    assert registry.names() == []
    assert registry.load("team/sql-v1.2", "a1", confined=True).name == "team/sql-v1.2"
    # A request's adapter longer than any path is INVALID, loaded or not; an unknown one NOT_FOUND, echoed clipped.
    err = _error(LoraRegistry(LoraConfig(), tiny_model).resolve, HUGE)
    assert err.kind is AdapterErrorKind.INVALID and len(err.message) < 400
    err = _error(LoraRegistry(LoraConfig(), tiny_model).resolve, "x" * 4000)
    assert err.kind is AdapterErrorKind.NOT_FOUND and len(err.message) < 400
    assert _error(registry.unload, HUGE).kind is AdapterErrorKind.NOT_FOUND


def test_lora_modules_names_follow_the_rule_at_start(tmp_path: Path) -> None:
    for bad in ("a\nb", "x" * 129, ".a", "a:b"):
        with pytest.raises(ValueError, match="lora_modules names must be 1-128 characters"):
            LoraConfig(lora_modules=((bad, str(tmp_path)),))
    with pytest.raises(ValueError, match="distinct"):
        LoraConfig(lora_modules=(("a", str(tmp_path)), ("a", str(tmp_path))))
    assert LoraConfig(lora_modules=(("sql-v1", str(tmp_path)),)).lora_modules[0][0] == "sql-v1"


# ---- media files ---------------------------------------------------------------------------------------------------


async def _refused(url: str, config: MediaConfig) -> SourceError:
    with pytest.raises(SourceError) as err:
        await sources.read_url(url, FIELD, config, None)
    assert err.value.field == FIELD
    return err.value


async def test_media_file_symlinked_out_of_the_root_is_permission_denied(tree: Path) -> None:
    config = MediaConfig(allowed_local_media_path=str(tree))
    for url in ("d/out_file", str(tree / "d" / "out_file"), (tree / "d" / "out_file").as_uri(), "out_dir/secret"):
        assert (await _refused(url, config)).kind is SourceErrorKind.PERMISSION, url
    assert await sources.read_url("in_file", FIELD, config, None) == b"inside"
    assert await sources.read_url((tree / "in_dir" / "f").as_uri(), FIELD, config, None) == b"inside"
    os.mkfifo(tree / "fifo")  # refused at once, no thread left waiting for a writer
    assert (await _refused("fifo", config)).kind is SourceErrorKind.INVALID


async def test_control_characters_in_a_media_path_or_url_are_invalid(tree: Path) -> None:
    config = MediaConfig(allowed_local_media_path=str(tree))
    for url in ("d/f\x00", "d/f\n", (tree / "d").as_uri() + "/f%00", (tree / "d").as_uri() + "/f%0A",
                "http://example.com/a\n.png", "http://exa\x00mple.com/", "data:image/png\x00;base64,AAAA"):
        err = await _refused(url, config)
        assert err.kind is SourceErrorKind.INVALID and "control characters" in err.message, repr(url)
    # base64 wrapped in lines is still read (its whitespace is dropped)
    assert await sources.read_url("data:;base64,aW5z\naWRl", FIELD, config, None) == b"inside"


async def test_media_errors_echo_at_most_200_characters_of_the_url(tree: Path) -> None:
    config = MediaConfig(allowed_local_media_path=str(tree))
    for url in ("d/" + HUGE, "../" + HUGE, "gopher://" + HUGE):
        err = await _refused(url, config)
        assert HUGE[:300] not in err.message and len(err.message) < 400, err.message[:100]
