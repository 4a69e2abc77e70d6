"""Transport layer: NIXL agents, registrations and batched READs (see docs/design.md, "Transport").

Importing this package is cheap: neither nixl nor torch is imported until a transport is created
(``NixlTransport`` is resolved lazily on first attribute access).

:func:`shared_transport` is the documented process-wide factory: every Publisher and Receiver
handed its result shares one agent (one set of registrations, one connection per peer).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
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
    from mx_refit.transport.routing import RoutingTransport

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
    "shared_transport",
    "total_bytes",
]

_LAZY = {"NixlTransport", "TransferStats"}

_shared: "tuple[int, RoutingTransport] | None" = None  # (pid that made it, transport)
_shared_lock = threading.Lock()


def shared_transport() -> "RoutingTransport":
    """This process's shared transport, created on first call (one NIXL agent per process, made
    when a NIXL path is first needed, plus the CUDA IPC path for same-node CUDA sources; see
    :class:`~mx_refit.transport.routing.RoutingTransport`).

    Hand it to every ``Publisher``/``Receiver`` of the process (``transport=shared_transport()``):
    they then share registrations and peer connections, and none of them closes it; it is closed
    at interpreter exit. A forked child gets its own. This factory is also the seam where other
    data paths (CUDA IPC between processes of one node) plug in behind the same interface.
    """
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid():
            from mx_refit.transport.routing import RoutingTransport

            transport = RoutingTransport("auto", name=f"mx-shared-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            _shared = (os.getpid(), transport)
            atexit.register(_close_shared, transport)
        return _shared[1]


def _close_shared(transport: "RoutingTransport") -> None:
    try:
        transport.close()
    except Exception:  # noqa: BLE001  # interpreter exit: report, never raise
        logging.getLogger(__name__).debug("closing the shared transport at exit failed", exc_info=True)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from mx_refit.transport import nixl

        return getattr(nixl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
