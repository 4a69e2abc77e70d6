"""The one mapping between :mod:`mx_refit.errors` and gRPC status codes (both directions).

The servicer uses :func:`status_for` to turn a domain error into a status; the client uses
:func:`error_for` to turn a status back into the same domain error, so callers see one error
family whether the catalog is embedded or remote.
"""

from __future__ import annotations

import grpc

from mx_refit.errors import (
    FailedPrecondition,
    InvalidArgument,
    MxRefitError,
    NotFound,
    SourcesBusy,
    Unauthenticated,
)

__all__ = ["RETRYABLE", "error_for", "status_for"]

_CODES: tuple[tuple[type[MxRefitError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (SourcesBusy, grpc.StatusCode.ABORTED),
)
_ERRORS = {code: error for error, code in _CODES}

# Transient transport failures the client retries (with backoff) before giving up.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def status_for(exc: MxRefitError) -> grpc.StatusCode:
    """The status code a servicer reports for a domain error (INTERNAL for anything else)."""
    for error, code in _CODES:
        if isinstance(exc, error):
            return code
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode, details: str, method: str) -> MxRefitError:
    """The domain error a client raises for a non-OK, non-retryable status."""
    error = _ERRORS.get(code)
    if error is not None:
        return error(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        # gRPC's own message-size check: the request or reply is too large for the channel.
        return InvalidArgument(f"{method}: message too large ({details})")
    return MxRefitError(f"{method}: catalog call failed with {code.name}: {details}")
