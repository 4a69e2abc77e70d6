"""The mx-refit weight catalog: which sources hold which tensors of which model version.

Re-exports only, resolved lazily: ``import mx_refit.catalog`` imports neither grpc nor
protobuf; they load when the server, servicer or client is first touched.

* :class:`CatalogService` — the transport-agnostic state machine (embeddable, thread-safe).
* :class:`CatalogServer`, :func:`start_catalog`, :func:`start_embedded`, :func:`serve_forever` —
  serve it over gRPC.
* :class:`CatalogClient` — the typed remote client (same methods, same errors).
* :class:`Catalog` — the protocol both the service and the client satisfy;
  :class:`LeasingCatalog` adds finding and leasing a version in one call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mx_refit._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.catalog.api import (
        DEFAULT_TTL_S,
        Catalog,
        LeasedVersion,
        LeasingCatalog,
        ReadProgress,
        VersionSummary,
    )
    from mx_refit.catalog.client import CatalogClient
    from mx_refit.catalog.connect import as_catalog
    from mx_refit.catalog.server import CatalogServer, serve_forever, start_catalog, start_embedded
    from mx_refit.catalog.service import CatalogService, ReapReport
    from mx_refit.catalog.validation import CatalogLimits

__all__ = [
    "DEFAULT_TTL_S",
    "Catalog",
    "CatalogClient",
    "CatalogLimits",
    "CatalogServer",
    "CatalogService",
    "LeasedVersion",
    "LeasingCatalog",
    "ReadProgress",
    "ReapReport",
    "VersionSummary",
    "as_catalog",
    "serve_forever",
    "start_catalog",
    "start_embedded",
]

_WHERE = {
    "DEFAULT_TTL_S": "api",
    "Catalog": "api",
    "LeasedVersion": "api",
    "LeasingCatalog": "api",
    "ReadProgress": "api",
    "VersionSummary": "api",
    "CatalogLimits": "validation",
    "CatalogService": "service",
    "ReapReport": "service",
    "CatalogServer": "server",
    "serve_forever": "server",
    "start_embedded": "server",
    "start_catalog": "server",
    "as_catalog": "connect",
    "CatalogClient": "client",
}


__getattr__, __dir__ = lazy_exports(globals(), _WHERE, prefix=f"{__name__}.")
