"""What the `lmrpc` commands share for reading flags and writing results: escapes, @FILE arguments, JSON lines."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any, TextIO


def unescape(text: str) -> str:
    """Interpret backslash escapes (\\n, \\t, \\u00e9, ...) and keep every other character as it is."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def file_or_text(value: str) -> str:
    """An argument's text, or with a leading @ the text of the file it names."""
    return Path(value[1:]).read_text() if value.startswith("@") else value


def jsonable(value: Any) -> Any:
    """Dataclasses as dicts, enums by name, bytes as hex: what json.dumps takes."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


def print_json(value: Any, out: TextIO) -> None:
    """One JSON object on one line."""
    out.write(json.dumps(jsonable(value), ensure_ascii=False) + "\n")
    out.flush()
