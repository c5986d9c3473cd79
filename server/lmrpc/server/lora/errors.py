"""Why an adapter cannot be used (no torch: validation.py maps these to statuses), and the rule for adapter names."""

from __future__ import annotations

import enum
import re

from lmrpc.server.userinput import clip

# Adapter names (LoadLoraAdapter, --lora-modules, a lora_path loaded under its own text): short printable
# identifiers, so that they fit in logs, metric labels and errors. '/' is allowed because a path under --lora-root
# becomes the adapter's name; ':' is not (an OpenAI model "served:adapter" splits there).
MAX_NAME_CHARS = 128
NAME_PATTERN = re.compile(rf"[A-Za-z0-9_/-][A-Za-z0-9._/-]{{0,{MAX_NAME_CHARS - 1}}}")
NAME_RULE = f"1-{MAX_NAME_CHARS} characters of A-Z a-z 0-9 . _ - /, not starting with '.'"


class AdapterErrorKind(enum.Enum):
    """What went wrong, so that validation.py can choose the status."""

    NOT_FOUND = "not_found"  # no such loaded adapter, or no adapter at that path
    PERMISSION = "permission"  # a path outside --lora-root, or loading by path is not enabled
    INVALID = "invalid"  # the adapter does not fit the model or the server's limits, or a bad name or path
    UNAVAILABLE = "unavailable"  # the server serves no adapters (flags, or a model without adapter support)
    EXISTS = "exists"  # a load under a name already loaded
    EXHAUSTED = "exhausted"  # --max-loaded-loras adapters are loaded and none may be evicted (in use, or pinned)


class AdapterError(Exception):
    """An adapter that cannot be used; `kind` decides the status code. `field`: "name" when the adapter's name is
    at fault rather than its path (LoadLoraAdapter has both), else None (the caller's field)."""

    def __init__(self, kind: AdapterErrorKind, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = field


def valid_name(name: str) -> bool:
    """`name` follows NAME_RULE."""
    return NAME_PATTERN.fullmatch(name) is not None


def check_name(name: str) -> None:
    """An adapter name that breaks NAME_RULE is INVALID (field "name")."""
    if not valid_name(name):
        raise AdapterError(AdapterErrorKind.INVALID, f"adapter name {clip(repr(name))} must be {NAME_RULE}",
                           field="name")
