"""mx-refit: move freshly trained weights from RL trainers into inference engines over NIXL.

The front door: trainers use :class:`Publisher`, inference workers :class:`Receiver`; both take a
catalog address or any :class:`Catalog`, and a config-built variant (``from_config``).
Framework plugins import from mx-refit only this package root, ``mx_refit.hookspecs`` (with
``mx_refit.hookimpl``), ``mx_refit.types``, ``mx_refit.errors`` and ``mx_refit.config``.

Importing this package is cheap: it pulls in neither torch, nixl, grpc nor any framework. The
classes and functions below the errors and types load on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mx_refit._lazy import lazy_exports
from mx_refit._version import __version__
from mx_refit.errors import (
    ChecksumMismatch,
    ClassificationError,
    CompileTargetError,
    CoverageError,
    FailedPrecondition,
    InvalidArgument,
    MxRefitError,
    NotFound,
    PartiallyUpdated,
    SourcesBusy,
    TransferError,
    Unauthenticated,
    Unavailable,
)
from mx_refit.hookspecs import hookimpl
from mx_refit.types import (
    MemType,
    MeshPosition,
    Mirror,
    PublishedTensor,
    ReadOp,
    RefitStats,
    Role,
    SourceInfo,
    TargetLayout,
    TensorDescriptor,
    VersionInfo,
    VersionState,
)

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.catalog.api import Catalog
    from mx_refit.catalog.server import CatalogServer, start_catalog
    from mx_refit.checks import batches
    from mx_refit.config import WeightSyncConfig, load_config
    from mx_refit.megatron.classify import unsupported_bridge_mappings
    from mx_refit.megatron.parallel import BridgedModel, expected_sources, is_publishing_rank, mesh_position
    from mx_refit.plugins import Hooks
    from mx_refit.publisher import Publisher
    from mx_refit.receive.receiver import Receiver, RefitResult
    from mx_refit.transport import shared_transport

# Front-door names resolved on first access, so `import mx_refit` stays light.
_LAZY = {
    "BridgedModel": "mx_refit.megatron.parallel",
    "Catalog": "mx_refit.catalog.api",
    "CatalogServer": "mx_refit.catalog.server",
    "Hooks": "mx_refit.plugins",
    "Publisher": "mx_refit.publisher",
    "Receiver": "mx_refit.receive.receiver",
    "RefitResult": "mx_refit.receive.receiver",
    "WeightSyncConfig": "mx_refit.config",
    "batches": "mx_refit.checks",
    "expected_sources": "mx_refit.megatron.parallel",
    "is_publishing_rank": "mx_refit.megatron.parallel",
    "load_config": "mx_refit.config",
    "mesh_position": "mx_refit.megatron.parallel",
    "shared_transport": "mx_refit.transport",
    "start_catalog": "mx_refit.catalog.server",
    "unsupported_bridge_mappings": "mx_refit.megatron.classify",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


__all__ = [
    "BridgedModel",
    "Catalog",
    "CatalogServer",
    "ChecksumMismatch",
    "ClassificationError",
    "CompileTargetError",
    "CoverageError",
    "FailedPrecondition",
    "Hooks",
    "InvalidArgument",
    "MemType",
    "MeshPosition",
    "Mirror",
    "MxRefitError",
    "NotFound",
    "PartiallyUpdated",
    "SourcesBusy",
    "PublishedTensor",
    "Publisher",
    "ReadOp",
    "Receiver",
    "RefitResult",
    "RefitStats",
    "Role",
    "SourceInfo",
    "TargetLayout",
    "TensorDescriptor",
    "TransferError",
    "Unauthenticated",
    "Unavailable",
    "VersionInfo",
    "VersionState",
    "WeightSyncConfig",
    "__version__",
    "batches",
    "expected_sources",
    "hookimpl",
    "is_publishing_rank",
    "load_config",
    "mesh_position",
    "shared_transport",
    "start_catalog",
    "unsupported_bridge_mappings",
]
