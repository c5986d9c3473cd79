"""What the tests read from a refused call's status: its BadRequest field violations."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


def violations(err: grpc.aio.AioRpcError) -> dict[str, str]:
    """field -> description of every BadRequest field violation in err's status details."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    out = {}
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad)
        out.update({v.field: v.description for v in bad.field_violations})
    return out
