"""Routed experts returned with outputs (GenerateRequest.return_routed_experts, MoE models): which rows of a step a
request still needs, and what its next output carries.

The executor hands over each chunk's chosen experts (`RoutedRows`, [positions, moe layers, top_k] int32); here a
request keeps the positions from its `routed_experts_from` on, each once (a recompute after preemption routes the
same, so its repeats are dropped), and each output carries the positions gathered since the previous one. The last
sampled token has none: no step computed its position.
"""

from __future__ import annotations

from lmrpc.server.engine.executor import RoutedRows
from lmrpc.server.engine.live import LiveRequest
from lmrpc.server.engine.types import RoutedExperts


def record(live: LiveRequest, chunk: RoutedRows) -> None:
    """Keep the rows of `chunk` that `live` has not had yet."""
    start = live.request.routed_experts_from
    assert start is not None
    nxt = max(live.routed_next, start)
    skip = max(nxt - chunk.first_position, 0)
    if skip >= chunk.experts.shape[0]:
        return
    if not live.pending_routed:
        live.pending_routed_start = chunk.first_position + skip
    rows = chunk.experts[skip:].numpy().astype("<i4", copy=False)  # [k, moe layers, top_k]
    live.pending_routed.append(rows.tobytes())
    live.routed_next = chunk.first_position + chunk.experts.shape[0]


def take(live: LiveRequest) -> RoutedExperts | None:
    """The positions gathered since the previous output, or None."""
    if not live.pending_routed:
        return None
    data = b"".join(live.pending_routed)
    start = live.pending_routed_start
    live.pending_routed = []
    return RoutedExperts(start, live.routed_next - start, data)
