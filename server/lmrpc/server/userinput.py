"""Strings users send that the server echoes, or uses as paths: `clip` for input echoed in an error or a log line,
`has_control` for what no name, path or URL may hold, and `open_confined` / `read_confined`, which open a file only
if every component of its path, the file included, resolves inside an allowed root (LoRA adapters, local media)."""

from __future__ import annotations

import errno
import os
import stat

MAX_ECHO_CHARS = 200  # user input echoed in an error message or a log line is cut to this (see clip)
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux: a longer path names nothing, and resolving one costs a syscall per part


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` cut to at most `limit` characters, marked where it was cut (user input echoed in an error)."""
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def has_control(text: str) -> bool:
    """NUL, newline or another C0/C1 control character (or DEL): never part of a name, a path or a URL we accept
    (the OS refuses NUL with an unhelpful ValueError; the rest would forge log lines)."""
    return any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in text)


class OutsideRoot(Exception):
    """A path that resolves outside its root, or one of whose parts became a symlink while it was opened."""


def resolve_under(root: str, path: str) -> str:
    """The real path `path` names (absolute, or relative to `root`; every symlink and '..' resolved, the last part
    too), if it lies under `root` (a real path itself); else OutsideRoot. `path` holds no NUL (has_control)."""
    real = os.path.realpath(os.path.join(root, path))  # an absolute path replaces the root
    if os.path.commonpath([real, root]) != root:
        raise OutsideRoot(path)
    return real


def open_confined(path: str, root: str | None, *, directory: bool = False) -> int:
    """A read-only fd of the regular file (or with `directory`, the directory) `path` names. With a root (a real
    path), the path must resolve under it (OutsideRoot), and is then opened one part at a time from the root with
    O_NOFOLLOW: a part swapped for a symlink after it was resolved fails (OutsideRoot) instead of being followed, so
    the file opened is the file checked. root None: `path` as given (an operator's own flag). Anything else that is
    no regular file (a FIFO would block the reader forever) raises OSError(EINVAL); a missing one FileNotFoundError.
    """
    # O_NONBLOCK: opening a FIFO must not wait for a writer. No O_DIRECTORY: with O_NOFOLLOW it turns a symlink
    # into ENOTDIR, where ELOOP says "a symlink"; each part's type is checked with fstat instead.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
    if root is None:
        fd = os.open(path, flags)
    else:
        real = resolve_under(root, path)
        parts = [] if real == root else os.path.relpath(real, root).split(os.sep)
        fd = os.open(root, flags | os.O_DIRECTORY)
        for i, part in enumerate(parts):
            try:
                child = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # a symlink where the resolved path had none: it was swapped
                    raise OutsideRoot(path) from exc
                raise
            finally:
                os.close(fd)  # the parent: done with it either way
            fd = child
            if i < len(parts) - 1 and not stat.S_ISDIR(os.fstat(fd).st_mode):
                os.close(fd)
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        raise OSError(errno.EINVAL, "not a directory" if directory else "not a regular file", path)
    return fd


def read_confined(path: str, root: str | None, limit: int | None = None) -> bytes:
    """The bytes of the regular file open_confined opens (at most `limit` + 1 of them, so that a caller sees it is
    over its limit without reading it all)."""
    with os.fdopen(open_confined(path, root), "rb") as f:
        return f.read() if limit is None else f.read(limit + 1)
