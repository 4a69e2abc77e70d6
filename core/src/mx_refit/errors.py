"""One error family for every layer.

The catalog servicer maps these to gRPC status codes in one place and the client maps the codes
back, so callers see the same exceptions whether the catalog is embedded or remote.
"""

from __future__ import annotations

__all__ = [
    "ChecksumMismatch",
    "ClassificationError",
    "CompileTargetError",
    "CoverageError",
    "FailedPrecondition",
    "InvalidArgument",
    "MissingExtra",
    "LeaseLost",
    "MxRefitError",
    "NotFound",
    "PartiallyUpdated",
    "SourcesBusy",
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


class SourcesBusy(MxRefitError):
    """A lease named sources that already serve their cap of concurrent readers (fan-out):
    nothing was leased; discover again (new replicas may be ready) and choose again."""


class Unauthenticated(MxRefitError):
    """Missing or wrong catalog token."""


class Unavailable(MxRefitError, ConnectionError):
    """The catalog cannot be reached (after the retry budget)."""


class TransferError(MxRefitError):
    """A NIXL transfer failed or timed out; the message names the source.

    ``failed_sources``: every source whose read failed (``source_id`` is the first);
    ``completed_sources``: sources of the same read whose batch was confirmed complete before
    it failed (their bytes are in the arena). ``missing``: after a failover found no other
    holder, the ``(tensor, byte range)`` pairs nobody alive holds.
    """

    def __init__(
        self,
        message: str,
        *,
        source_id: str | None = None,
        failed_sources: tuple[str, ...] = (),
        completed_sources: frozenset[str] = frozenset(),
        missing: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.failed_sources = tuple(failed_sources) or ((source_id,) if source_id is not None else ())
        self.source_id = source_id if source_id is not None else (self.failed_sources or (None,))[0]
        self.completed_sources = frozenset(completed_sources)
        self.missing = tuple(missing)


class ChecksumMismatch(TransferError):
    """Bytes received from a source do not match the checksum it published for them (a bit
    flipped in the source's memory, on the wire or in the arena). Names the tensor, the block
    and the source; nothing was loaded."""

    def __init__(self, message: str, *, source_id: str, tensor: str, block: int) -> None:
        super().__init__(message, source_id=source_id)
        self.tensor = tensor
        self.block = block


class ClassificationError(MxRefitError, ValueError):
    """A parameter cannot be classified (or published in place), or a role override is
    malformed; the message names it."""


class LeaseLost(MxRefitError):
    """A refit's lease was not held continuously, so the pulled bytes cannot be trusted (the
    publisher may have mutated them). Nothing reached the engine. ``cause`` says why: the TTL ran
    out, heartbeats could not reach the catalog, or the catalog lost the lease (a restart)."""

    def __init__(self, message: str, *, lease_id: str, cause: str) -> None:
        super().__init__(message)
        self.lease_id = lease_id
        self.cause = cause


class PartiallyUpdated(MxRefitError):
    """A ``receive_mode: direct`` refit failed after its first bytes were written into the
    engine's parameters: they now hold part of ``version`` and part of the previous weights.
    The engine must not serve or report either version as loaded; refit again (the message names
    the model and the version, ``__cause__`` is the failure)."""

    def __init__(self, message: str, *, model: str = "", version: int | None = None) -> None:
        super().__init__(message)
        self.model = model
        self.version = version


class CoverageError(MxRefitError):
    """A plan would leave needed bytes uncovered; lists the tensors and ranges."""

    def __init__(self, message: str, *, gaps: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.gaps = gaps or []


# Top-level module -> the extra of the ``mx-refit`` distribution that installs it.
EXTRA_OF_MODULE = {
    "torch": "transport",
    "nixl": "transport",
    "nixl_cu12": "transport",
    "nixl_cu13": "transport",
    "megatron": "megatron",
    "transformers": "megatron",
    "safetensors": "megatron",
    "hydra": "recipes",
    "omegaconf": "recipes",
    "prometheus_client": "metrics",
    "redis": "redis",
}


class CompileTargetError(MxRefitError, ValueError):
    """A version's compiled form (compile target, its metadata, the runtime it was compiled for)
    is not one this receiver can load; names the tensor, the offered target and the wanted one.
    The receiver keeps its previous weights."""


class MissingExtra(MxRefitError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""

    def __init__(self, module: str, extra: str, purpose: str = "") -> None:
        need = f" (needed {purpose})" if purpose else ""
        super().__init__(f"{module} is not installed{need}; install `mx-refit[{extra}]`", name=module)
        self.extra = extra


def missing_extra(exc: ImportError, purpose: str = "") -> MissingExtra | None:
    """The :class:`MissingExtra` for an ImportError of an optional dependency, else None."""
    if isinstance(exc, MissingExtra):
        return exc
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    return MissingExtra(top, extra, purpose) if extra else None


def require(*modules: str, purpose: str = "") -> None:
    """Raise :class:`MissingExtra` unless every module can be found (imports nothing)."""
    import importlib.util

    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingExtra(module, EXTRA_OF_MODULE.get(module.split(".")[0], "transport"), purpose)
