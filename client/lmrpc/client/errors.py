"""LmrpcError: a failed RPC with its status code and the google.rpc.BadRequest field violations decoded."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


@dataclass(frozen=True)
class FieldViolation:
    """One invalid request field, as reported by the server."""

    field: str  # path of the field, e.g. "sampling_params[0].top_p"
    description: str  # what is wrong and the allowed range


class LmrpcError(Exception):
    """An RPC to the lmrpc server failed."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 field_violations: list[FieldViolation] | None = None) -> None:
        self.code = code  # the gRPC status code, e.g. grpc.StatusCode.INVALID_ARGUMENT
        self.message = message  # the status message
        self.field_violations = field_violations or []  # decoded google.rpc.BadRequest details
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.code.name}: {self.message}"
        for v in self.field_violations:
            text += f"\n  {v.field}: {v.description}"
        return text

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> LmrpcError:
        """Decode a grpc.RpcError (sync) or grpc.aio.AioRpcError: both expose code(), details() and
        trailing_metadata() synchronously."""
        code: grpc.StatusCode = error.code()
        message: str = error.details() or ""
        return cls(code, message, _field_violations(error))


def _field_violations(error: grpc.RpcError) -> list[FieldViolation]:
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # details disagree with the status line: ignore the details, keep code and message
        return []
    if status is None:
        return []
    violations: list[FieldViolation] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            violations += [FieldViolation(v.field, v.description) for v in bad_request.field_violations]
    return violations
