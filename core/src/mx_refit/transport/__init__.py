"""Transport layer: NIXL agents, registrations and batched READs (see docs/design.md, "Transport").

Importing this package is cheap: neither nixl nor torch is imported until a transport is created
(``NixlTransport`` is resolved lazily on first attribute access).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mx_refit.ranges import (
    DEFAULT_DESCRIPTOR_OVERHEAD_S,
    DEFAULT_LOCAL_COPY_BANDWIDTH,
    DEFAULT_TRANSFER_BANDWIDTH,
    Range,
    RowSlicePlan,
    coalesce,
    plan_row_slice,
    total_bytes,
)

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.transport.nixl import NixlTransport, TransferStats

__all__ = [
    "DEFAULT_DESCRIPTOR_OVERHEAD_S",
    "DEFAULT_LOCAL_COPY_BANDWIDTH",
    "DEFAULT_TRANSFER_BANDWIDTH",
    "NixlTransport",
    "Range",
    "RowSlicePlan",
    "TransferStats",
    "coalesce",
    "plan_row_slice",
    "total_bytes",
]

_LAZY = {"NixlTransport", "TransferStats"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from mx_refit.transport import nixl

        return getattr(nixl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
