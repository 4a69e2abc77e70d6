"""What a Publisher or Receiver was handed -> the :class:`~mx_refit.catalog.api.Catalog` it talks to.

grpc loads only when an address has to be dialled; an in-process service needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

from mx_refit.catalog.api import Catalog
from mx_refit.errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.catalog.client import CatalogClient

__all__ = ["as_catalog"]


@overload
def as_catalog(catalog: str, *, token: str | None = None) -> "CatalogClient": ...
@overload
def as_catalog(catalog: Catalog, *, token: str | None = None) -> Catalog: ...
def as_catalog(catalog: str | Catalog, *, token: str | None = None) -> Catalog:
    """The catalog a publisher or receiver talks to.

    :param catalog: An address ``"host:port"`` (a gRPC :class:`~mx_refit.catalog.client.CatalogClient`
        is made for it, with ``token``), or any object satisfying :class:`Catalog`: a
        ``CatalogClient``, an in-process :class:`~mx_refit.catalog.service.CatalogService`, a
        framework's own adapter. Such an object is used as given (``token`` is its business).
    """
    if isinstance(catalog, str):
        from mx_refit.catalog.client import CatalogClient

        return CatalogClient(catalog, token=token)
    if isinstance(catalog, Catalog):
        return catalog
    missing = sorted(
        name for name in dir(Catalog) if not name.startswith("_") and not callable(getattr(catalog, name, None))
    )
    hint = "; for a started server pass its .address" if hasattr(catalog, "address") else ""
    raise InvalidArgument(
        f"catalog: a {type(catalog).__module__}.{type(catalog).__qualname__} is neither an address "
        f"'host:port' nor a Catalog (it lacks {missing}){hint}"
    )
