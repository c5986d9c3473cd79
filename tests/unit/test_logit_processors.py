"""Server-side custom logit processors: the registry, the built-in, plugins from entry points."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

import pytest
import torch

from lmrpc.server import logit_processors
from lmrpc.server.logit_processors import DisallowedTokens, LogitProcessor, ProcessorRegistry


def test_disallowed_tokens_sets_minus_inf() -> None:
    proc = ProcessorRegistry.load().create("disallowed_tokens", {"token_ids": [1, 3, 3, 1000]})
    assert isinstance(proc, LogitProcessor)
    row = torch.zeros(8)
    assert proc(row, []) is None
    assert torch.isinf(row).nonzero().squeeze(1).tolist() == [1, 3]  # 1000 is outside the vocabulary: a no-op
    assert (row[[0, 2, 4, 5, 6, 7]] == 0).all()


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({}, "'token_ids' is required"),
        ({"token_ids": "1,2"}, "'token_ids' is required"),
        ({"token_ids": [1, -2]}, "ints >= 0"),
        ({"token_ids": [1, 2.5]}, "ints >= 0"),
        ({"token_ids": [True]}, "ints >= 0"),
        ({"token_ids": [1], "ids": [2]}, "unknown param(s) ['ids']"),
    ],
)
def test_disallowed_tokens_validates_params(params: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match="disallowed_tokens") as info:
        ProcessorRegistry.load().create("disallowed_tokens", params)
    assert needle in str(info.value)


def test_unknown_name_is_a_key_error_listing_the_registered() -> None:
    with pytest.raises(KeyError, match="disallowed_tokens"):
        ProcessorRegistry.load().create("no_such", {})


class _Boost:
    """A plugin processor: adds `amount` to the logit of the last generated token."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        amount = params.get("amount")
        if not isinstance(amount, (int, float)):
            raise ValueError("boost: 'amount' must be a number")
        self.amount = float(amount)

    def __call__(self, logits: torch.Tensor, output_ids: Sequence[int]) -> torch.Tensor:
        out = logits.clone()
        if output_ids:
            out[output_ids[-1]] += self.amount
        return out


class _FakeEntryPoint:
    def __init__(self, name: str, obj: object, error: Exception | None = None) -> None:
        self.name, self.value, self._obj, self._error = name, f"fake:{name}", obj, error

    def load(self) -> object:
        if self._error is not None:
            raise self._error
        return self._obj


def test_plugins_load_from_the_entry_point_group(monkeypatch: pytest.MonkeyPatch) -> None:
    groups: list[str] = []

    def fake_entry_points(*, group: str) -> list[_FakeEntryPoint]:
        groups.append(group)
        return [
            _FakeEntryPoint("disallowed_tokens", DisallowedTokens),  # our own distribution's entry: no duplicate
            _FakeEntryPoint("boost", _Boost),
            _FakeEntryPoint("broken", None, ImportError("no module named nothing")),
        ]

    monkeypatch.setattr(logit_processors.metadata, "entry_points", fake_entry_points)
    registry = ProcessorRegistry.load()
    assert groups == ["lmrpc.logit_processors"]
    assert registry.names == ("boost", "disallowed_tokens")
    assert "broken" not in registry
    proc = registry.create("boost", {"amount": 2})
    out = proc(torch.zeros(4), [1])
    assert out is not None and out.tolist() == [0.0, 2.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="amount"):
        registry.create("boost", {"amount": "lots"})


def test_registries_are_independent() -> None:
    a, b = ProcessorRegistry(), ProcessorRegistry()
    a.register("boost", _Boost)
    assert "boost" in a and "boost" not in b
    with pytest.raises(ValueError, match="already registered"):
        a.register("boost", _Boost)


def test_real_entry_points_include_only_loadable_processors() -> None:
    registry = ProcessorRegistry.load()
    assert "disallowed_tokens" in registry
    for ep in metadata.entry_points(group="lmrpc.logit_processors"):
        assert ep.name in registry
