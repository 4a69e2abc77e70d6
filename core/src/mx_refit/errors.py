"""One error family for every layer.

The catalog servicer maps these to gRPC status codes in one place and the client maps the codes
back, so callers see the same exceptions whether the catalog is embedded or remote.
"""

from __future__ import annotations

__all__ = [
    "ClassificationError",
    "CoverageError",
    "FailedPrecondition",
    "InvalidArgument",
    "MxRefitError",
    "NotFound",
    "TransferError",
    "Unauthenticated",
    "Unavailable",
]


class MxRefitError(Exception):
    """Base class of every error mx-refit raises on purpose."""


class InvalidArgument(MxRefitError, ValueError):
    """A request field is malformed; the message names the field and the value."""


class NotFound(MxRefitError, LookupError):
    """An unknown model, version, source or lease."""


class FailedPrecondition(MxRefitError):
    """The request is well formed but the state does not allow it (e.g. version not READY)."""


class Unauthenticated(MxRefitError):
    """Missing or wrong catalog token."""


class Unavailable(MxRefitError, ConnectionError):
    """The catalog cannot be reached (after the retry budget)."""


class TransferError(MxRefitError):
    """A NIXL transfer failed or timed out; the message names the source."""

    def __init__(self, message: str, *, source_id: str | None = None) -> None:
        super().__init__(message)
        self.source_id = source_id


class ClassificationError(MxRefitError, ValueError):
    """A parameter cannot be classified (or published in place), or a role override is
    malformed; the message names it."""


class CoverageError(MxRefitError):
    """A plan would leave needed bytes uncovered; lists the tensors and ranges."""

    def __init__(self, message: str, *, gaps: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.gaps = gaps or []
