"""How many tokens one engine step computes when --max-batched-tokens is not given: a budget sized to the model.

A step runs every one of its rows through the whole model, and every running decode waits for it, as does the
first token of every prompt in it. On a CPU a step of 512 prompt tokens takes ~0.4 s on SmolLM2-135M but ~5 s at
1.7B (2 cores, ~150 G multiply-adds a second), so with one budget for all sizes eight 64-token prompts arriving
together at 1.7B all got their first token after ~5 s. The budget is the power of two at or below STEP_MACS divided
by the model's multiply-adds per token, within [MIN_STEP_TOKENS, MAX_STEP_TOKENS]: 512 for SmolLM2-135M, 256 at
360M, 128 at 1.7B.

What it may cost is throughput in a burst: prompts started in turn finish in turn, so the last steps run fewer
rows, and each step reads the weights once more. Measured (`bench/budgets.py`, AMD EPYC Zen 4, 1.7B Q4_K_M, 64-token
prompts arriving together, medians of per-round ratios to 512, two runs of 3 and 4 rounds): with 128, TTFT p50
0.77-0.79x at 8 streams and 0.67-0.84x at 32; tok/s 0.98x at 8 and 0.96-1.03x at 32, within the host's noise (in
bench/served.py runs lmrpc's 32-stream tok/s sat up to ~5% lower than with 512: not settled).

GPUs keep MAX_STEP_TOKENS (a step of 512 tokens is milliseconds there). This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

STEP_MACS = 1 << 37  # multiply-adds a step aims at (~1 s on 2 cores)
MIN_STEP_TOKENS = 128  # fewer rows would leave many-row products short of their rate
MAX_STEP_TOKENS = 512  # the budget of small models and of GPUs


class _Shape(Protocol):
    in_features: int
    out_features: int


def step_token_budget(macs_per_token: int, gpu: bool) -> int:
    """Tokens per step for a model of `macs_per_token` multiply-adds a token (0: unknown, the largest budget)."""
    if gpu or macs_per_token <= 0:
        return MAX_STEP_TOKENS
    fits = max(1, STEP_MACS // macs_per_token)
    return max(MIN_STEP_TOKENS, min(MAX_STEP_TOKENS, 1 << (fits.bit_length() - 1)))


def macs_per_token(model: object) -> int:
    """Multiply-adds of one token through the model's products: each of its linear layers (the output head
    included; an MoE's experts each count, an overestimate that only lowers the budget) in_features x
    out_features. 0 (unknown) for a model that does not list them (the HF fallback)."""
    listed: Callable[[], Iterable[_Shape]] | None = getattr(model, "linear_layers", None)
    if listed is None:
        return 0
    return sum(layer.in_features * layer.out_features for layer in listed())
