"""Final-layer hidden states returned with outputs (GenerateRequest.return_hidden_states): which rows of a step a
request still needs, and what its next output carries.

The executor hands over normalized rows per chunk (`HiddenRows`); here ALL keeps each position once (a recompute
after preemption gives the same bits again, so its repeats are dropped) and LAST keeps only the newest row, sent with
the final output. The last sampled token never has one: no step computed its position.
"""

from __future__ import annotations

from lmrpc.server.engine.executor import HiddenRows
from lmrpc.server.engine.live import LiveRequest
from lmrpc.server.engine.types import HiddenStatesMode


def record(live: LiveRequest, chunk: HiddenRows) -> None:
    """Keep the rows of `chunk` that `live` has not had yet."""
    rows = chunk.rows.numpy().astype("<f4", copy=False)  # [k, hidden]
    if live.request.hidden_states is HiddenStatesMode.LAST:
        live.pending_hidden = [rows[-1].tobytes()]
        return
    skip = max(live.hidden_next - chunk.first_position, 0)
    if skip >= len(rows):
        return
    live.pending_hidden.extend(r.tobytes() for r in rows[skip:])
    live.hidden_next = chunk.first_position + len(rows)


def take(live: LiveRequest, finishing: bool) -> tuple[bytes, ...]:
    """The rows the next output carries: every new one (ALL), or the newest only with the final output (LAST)."""
    if live.request.hidden_states is HiddenStatesMode.LAST and not finishing:
        return ()
    rows, live.pending_hidden = tuple(live.pending_hidden), []
    return rows
