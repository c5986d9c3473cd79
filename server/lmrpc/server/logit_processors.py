"""Custom logit processors, safe by design: named classes registered on the server, never code from clients.

A request names a processor and passes `custom_params` (JSON-like). The server builds a `ProcessorRegistry` once:
the built-in processors plus third-party ones from the Python entry-point group "lmrpc.logit_processors" (an entry
point names a class). `registry.create(name, params)` validates the params (the class raises ValueError naming the
param and its allowed values) and returns a processor bound to them, called once per step on its sequence's row:

    processor(logits_row, output_ids) -> None   # edits logits_row [vocab] float32 in place
    processor(logits_row, output_ids) -> Tensor # or returns the replacement row
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "lmrpc.logit_processors"


@runtime_checkable
class LogitProcessor(Protocol):
    """A processor bound to one request's params."""

    def __call__(self, logits: torch.Tensor, output_ids: Sequence[int]) -> torch.Tensor | None:
        """logits [vocab] float32 of one sequence (edit in place or return a new row); output_ids: generated ids."""
        ...


class LogitProcessorFactory(Protocol):
    """What a registered processor class looks like: constructed from the request's custom_params."""

    def __call__(self, params: Mapping[str, Any]) -> LogitProcessor: ...


class DisallowedTokens:
    """Forbid a list of token ids: custom_params {"token_ids": [int, ...]}; those ids get -inf."""

    name: ClassVar[str] = "disallowed_tokens"

    def __init__(self, params: Mapping[str, Any]) -> None:
        unknown = sorted(set(params) - {"token_ids"})
        if unknown:
            raise ValueError(f"disallowed_tokens: unknown param(s) {unknown}; allowed: ['token_ids']")
        ids = params.get("token_ids")
        if not isinstance(ids, (list, tuple)):
            raise ValueError("disallowed_tokens: 'token_ids' is required and must be a list of token ids (ints >= 0)")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError("disallowed_tokens: 'token_ids' must contain only token ids (ints >= 0)")
        self.token_ids: tuple[int, ...] = tuple(sorted(set(ids)))  # ids to forbid
        self._index: torch.Tensor | None = None  # the ids as a tensor on the row's device, built on first call

    def __call__(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None:
        if self._index is None or self._index.device != logits.device:
            # Ids beyond the vocabulary can never be sampled, so forbidding them is a no-op.
            in_vocab = [t for t in self.token_ids if t < logits.shape[0]]
            self._index = torch.tensor(in_vocab, dtype=torch.int64, device=logits.device)
        logits[self._index] = float("-inf")


BUILTIN_PROCESSORS: Mapping[str, LogitProcessorFactory] = {DisallowedTokens.name: DisallowedTokens}


class ProcessorRegistry:
    """Processor classes by name. Build once (`ProcessorRegistry.load()`), then `create` per request."""

    def __init__(self, factories: Mapping[str, LogitProcessorFactory] | None = None) -> None:
        self._factories: dict[str, LogitProcessorFactory] = dict(BUILTIN_PROCESSORS if factories is None else factories)

    @classmethod
    def load(cls, group: str = ENTRY_POINT_GROUP) -> ProcessorRegistry:
        """The built-ins plus every class published under the entry-point group."""
        registry = cls()
        for entry in metadata.entry_points(group=group):
            if entry.name in registry._factories:
                continue  # a built-in published by our own distribution, or a duplicate name: first one wins
            try:
                factory = entry.load()
            except (ImportError, AttributeError) as exc:
                logger.warning("logit processor %r (%s) failed to load: %s", entry.name, entry.value, exc)
                continue
            if not callable(factory):
                logger.warning("logit processor %r (%s) is not a class or callable; skipped", entry.name, entry.value)
                continue
            registry.register(entry.name, factory)
        return registry

    def register(self, name: str, factory: LogitProcessorFactory) -> None:
        if name in self._factories:
            raise ValueError(f"logit processor {name!r} is already registered")
        self._factories[name] = factory

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._factories))

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def create(self, name: str, params: Mapping[str, Any]) -> LogitProcessor:
        """A processor bound to params. KeyError: unknown name; ValueError: invalid params (message names them)."""
        factory = self._factories.get(name)
        if factory is None:
            raise KeyError(f"unknown logit processor {name!r}; registered: {list(self.names)}")
        return factory(params)
