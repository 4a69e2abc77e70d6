"""mx-refit: move freshly trained weights from RL trainers into inference engines over NIXL.

Importing this package is cheap: it pulls in neither torch, nixl, grpc nor any framework.
"""

from __future__ import annotations

import pluggy

from mx_refit.errors import (
    CoverageError,
    FailedPrecondition,
    InvalidArgument,
    MxRefitError,
    NotFound,
    TransferError,
    Unauthenticated,
    Unavailable,
)
from mx_refit.types import (
    MemType,
    MeshPosition,
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

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("mx_refit")
"""Marker for plugin hook implementations: ``@mx_refit.hookimpl``."""

__all__ = [
    "CoverageError",
    "FailedPrecondition",
    "InvalidArgument",
    "MemType",
    "MeshPosition",
    "MxRefitError",
    "NotFound",
    "PublishedTensor",
    "ReadOp",
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
    "__version__",
    "hookimpl",
]
