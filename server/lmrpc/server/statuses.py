"""The one mapping of user errors to gRPC statuses. Request rules (validation.py, openai/validation.py, the SMG
worker's) collect typed violations; `to_status` turns them into a status with google.rpc.BadRequest field violations
(INVALID_ARGUMENT; NOT_FOUND for an unknown model or LoRA adapter; PERMISSION_DENIED for an adapter path outside
--lora-root, or a media URL or path the --allowed-media-domains/--allowed-local-media-path flags do not allow;
UNAVAILABLE for a media URL that cannot be reached; ALREADY_EXISTS for an adapter name taken; RESOURCE_EXHAUSTED for
LoadLoraAdapter while no adapter may be evicted) or a google.rpc.PreconditionFailure (FAILED_PRECONDITION), bounded
to fit gRPC's 8 KiB of trailers. A full server answers RESOURCE_EXHAUSTED with RetryInfo."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from lmrpc.server.lora.errors import AdapterError, AdapterErrorKind
from lmrpc.server.media.prepare import MediaRefused
from lmrpc.server.media.sources import SourceError, SourceErrorKind
from lmrpc.server.media.types import MediaError
from lmrpc.server.userinput import clip

_SOURCE_CODES = {
    SourceErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    SourceErrorKind.PERMISSION: grpc.StatusCode.PERMISSION_DENIED,
    SourceErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
_ADAPTER_CODES = {
    AdapterErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    AdapterErrorKind.PERMISSION: grpc.StatusCode.PERMISSION_DENIED,
    AdapterErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    AdapterErrorKind.UNAVAILABLE: grpc.StatusCode.FAILED_PRECONDITION,
    AdapterErrorKind.EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    AdapterErrorKind.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

@dataclass(frozen=True)
class Violation:
    field: str  # the request field, e.g. "sampling_params[0].top_p"
    description: str  # what is wrong and the allowed range


class RequestError(Exception):
    """A request the server refuses; carries the status code and the violations."""

    def __init__(self, code: grpc.StatusCode, violations: list[Violation]) -> None:
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in violations))
        self.code = code
        self.violations = violations


# Bounds on what an error may carry back: grpc-message and the BadRequest details travel as trailers, and gRPC
# clients refuse trailers over 8 KiB by default (a larger error reaches them as RESOURCE_EXHAUSTED, with the real
# status and every field lost). The first MAX_VIOLATIONS violations are sent, then one saying how many more; a
# field name or description is cut to its bound, and the violations' UTF-8 to MAX_ERROR_BYTES in all (the message
# is percent-encoded, at most 3 bytes per byte: ~3.6 KiB; the details are base64: ~1.7 KiB).
MAX_VIOLATIONS = 20
MAX_FIELD_CHARS = 100
MAX_DESCRIPTION_CHARS = 200
MAX_ERROR_BYTES = 1200


def bounded(violations: Sequence[Violation]) -> list[Violation]:
    """The violations an error carries: at most MAX_VIOLATIONS, each field and description clipped, their UTF-8
    within MAX_ERROR_BYTES (the first is always sent), and a last one counting the rest."""
    out: list[Violation] = []
    size = 0
    for v in violations:
        cut = Violation(clip(v.field, MAX_FIELD_CHARS), clip(v.description, MAX_DESCRIPTION_CHARS))
        size += len(cut.field.encode()) + len(cut.description.encode()) + 4
        if out and (len(out) == MAX_VIOLATIONS or size > MAX_ERROR_BYTES):
            break
        out.append(cut)
    if len(out) < len(violations):
        out.append(Violation("(more)", f"and {len(violations) - len(out)} more violations not listed"))
    return out


def to_status(error: RequestError) -> grpc.Status:
    """The error as a status whose message and details stay far below gRPC's 8 KiB trailer limit (bounded)."""
    from grpc_status import rpc_status

    violations = bounded(error.violations)
    detail = any_pb2.Any()
    if error.code is grpc.StatusCode.FAILED_PRECONDITION:
        detail.Pack(error_details_pb2.PreconditionFailure(violations=[
            error_details_pb2.PreconditionFailure.Violation(type=v.field, description=v.description)
            for v in violations
        ]))
    else:
        detail.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in violations
        ]))
    code: int = error.code.value[0]  # grpc.StatusCode values are (number, name)
    message = "; ".join(f"{v.field}: {v.description}" for v in violations)
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=[detail]))


def resource_exhausted_status(limit: int) -> grpc.Status:
    """The server is full: RESOURCE_EXHAUSTED with a google.rpc.RetryInfo telling the client when to retry."""
    from grpc_status import rpc_status

    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1)))
    return rpc_status.to_status(status_pb2.Status(
        code=code_pb2.RESOURCE_EXHAUSTED, message=f"server is at capacity ({limit} outputs running or queued)",
        details=[detail]))


def client_share_exhausted_status(cap: int, queued: int) -> grpc.Status:
    """This client has its share of the queue (--max-queued-per-client): RESOURCE_EXHAUSTED with RetryInfo."""
    from grpc_status import rpc_status

    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1)))
    return rpc_status.to_status(status_pb2.Status(
        code=code_pb2.RESOURCE_EXHAUSTED,
        message=f"this client has {queued} outputs queued and may queue at most {cap} while the server is busy "
                "(--max-queued-per-client)",
        details=[detail]))


class Collector:
    """Gathers the violations of one request, so that the caller hears of all of them at once."""

    def __init__(self) -> None:
        self.violations: list[Violation] = []

    def check(self, ok: bool, field: str, description: str) -> None:
        if not ok:
            self.violations.append(Violation(field, description))

    def raise_if_any(self, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        if self.violations:
            raise RequestError(code, self.violations)


def invalid(field: str, description: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, [Violation(field, description)])



def adapter_error(exc: AdapterError, field: str) -> RequestError:
    """A LoRA adapter that cannot be used, as the status its kind calls for (see the module doc)."""
    return RequestError(_ADAPTER_CODES[exc.kind], [Violation(field, exc.message)])


def media_error(exc: MediaError | MediaRefused) -> RequestError:
    """A media item that cannot be used: INVALID_ARGUMENT naming it, or the status its source failure calls for
    (PERMISSION_DENIED for a host or path the flags do not allow, UNAVAILABLE for an unreachable URL); items refused
    before any was read (media/prepare.py): INVALID_ARGUMENT naming each."""
    if isinstance(exc, MediaRefused):
        return RequestError(grpc.StatusCode.INVALID_ARGUMENT, [Violation(e.field, e.message) for e in exc.errors])
    code = _SOURCE_CODES[exc.kind] if isinstance(exc, SourceError) else grpc.StatusCode.INVALID_ARGUMENT
    return RequestError(code, [Violation(exc.field, exc.message)])
