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
    Unavailable,
)

__all__ = ["MAX_DETAILS_BYTES", "RETRYABLE", "STORE_OUTAGE_PREFIX", "error_for", "fit_details", "is_store_outage",
           "status_for", "unreachable"]

# gRPC carries a status message in the grpc-message header, percent-encoded, and a client drops
# a reply whose headers exceed 8 KiB (grpc.max_metadata_size) with a random other status: keep
# the encoded message to half of that.
MAX_DETAILS_BYTES = 4096

_CODES: tuple[tuple[type[MxRefitError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (SourcesBusy, grpc.StatusCode.ABORTED),
    # The catalog's store is down or restarting: transient, so clients retry (never INTERNAL).
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
)
_ERRORS = {code: error for error, code in _CODES}

# Transient transport failures the client retries (with backoff) before giving up.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# How the catalog's store words its outages (mx_refit.catalog.store.redis_store): a catalog that
# answers UNAVAILABLE with it is up, its store is not, and clients retry until their timeout.
STORE_OUTAGE_PREFIX = "catalog store "


def is_store_outage(code: grpc.StatusCode, details: str) -> bool:
    """Whether a status says the catalog answered but its store is down (not that the catalog is)."""
    return code is grpc.StatusCode.UNAVAILABLE and details.startswith(STORE_OUTAGE_PREFIX)


def status_for(exc: MxRefitError) -> grpc.StatusCode:
    """The status code a servicer reports for a domain error (INTERNAL for anything else)."""
    for error, code in _CODES:
        if isinstance(exc, error):
            return code
    return grpc.StatusCode.INTERNAL


def _encoded_size(text: str) -> int:
    """Bytes of ``text`` in the grpc-message header (percent-encoding of all but printable ASCII)."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode())


def fit_details(message: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """``message`` cut to fit a status header of ``limit`` encoded bytes, saying that it was."""
    if _encoded_size(message) <= limit:
        return message
    note = f" ... [truncated to fit gRPC's status header: {len(message)} characters in all]"
    keep, budget = [], limit - _encoded_size(note)
    for char in message:
        budget -= _encoded_size(char)
        if budget < 0:
            break
        keep.append(char)
    return "".join(keep) + note


def error_for(code: grpc.StatusCode, details: str, method: str) -> MxRefitError:
    """The domain error a client raises for a non-OK, non-retryable status."""
    error = _ERRORS.get(code)
    if error is not None:
        return error(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        # gRPC's own message-size check: the request or reply is too large for the channel.
        return InvalidArgument(f"{method}: message too large ({details})")
    return MxRefitError(f"{method}: catalog call failed with {code.name}: {details}")


def unreachable(address: str, method: str, last: grpc.RpcError, attempts: int, elapsed_s: float) -> Unavailable:
    """The error for a catalog that never answered: why (refused, no answer in time), then the
    address, the call and gRPC's own words."""
    code, details = last.code(), last.details() or ""
    if "connection refused" in details.lower():
        why = "connection refused (nothing listens there: is `mx-refit serve` running, on this port?)"
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        why = f"no connection within {elapsed_s:.1f} s (a wrong address, or a firewall?)"
    else:
        why = details or code.name
    return Unavailable(
        f"catalog at {address} is unreachable: {why}; {attempts} attempt(s) of {method} in {elapsed_s:.1f} s "
        f"({code.name}: {details})"
    )
