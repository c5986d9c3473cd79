"""Why an adapter cannot be used (no torch: validation.py maps these to statuses)."""

from __future__ import annotations

import enum


class AdapterErrorKind(enum.Enum):
    """What went wrong, so that validation.py can choose the status."""

    NOT_FOUND = "not_found"  # no such loaded adapter, or no adapter at that path
    PERMISSION = "permission"  # a path outside --lora-root, or loading by path is not enabled
    INVALID = "invalid"  # the adapter does not fit the model or the server's limits
    UNAVAILABLE = "unavailable"  # the server serves no adapters (flags, or a model without adapter support)
    EXISTS = "exists"  # a load under a name already loaded
    EXHAUSTED = "exhausted"  # --max-loaded-loras adapters are loaded and none may be evicted (in use, or pinned)


class AdapterError(Exception):
    """An adapter that cannot be used; `kind` decides the status code."""

    def __init__(self, kind: AdapterErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
