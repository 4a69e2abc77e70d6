"""The backend-name rule: ``mx_refit`` always means mx-refit; ``mx`` means whoever registered it.

vLLM's ``WeightTransferEngineFactory`` keeps one engine per name and refuses a second
registration of it (``ValueError: ... is already registered``). mx-refit-vllm registers ``mx``;
Dynamo's development branch registers its own ModelExpress engine as ``mx`` too, with other
init infos (``mx_server_url``, ``model_name``, ...). Which one a process gets depends on plugin
load order, so mx-refit never relies on ``mx`` when both may be installed:

- this package's ``vllm.general_plugins`` entry point registers mx-refit's worker and trainer
  engines under the alias :data:`ALIAS` (``"mx_refit"``), a name nobody else claims; start
  workers with ``--weight-transfer-config '{"backend": "mx_refit"}'`` wherever Dynamo's MX branch
  is installed;
- when ``mx`` is already held by another package, mx-refit-vllm leaves it alone and
  :func:`register` logs a warning naming the holder and the alias (never a silent first-wins);
- when mx-refit registered ``mx`` first, the other package's registration fails loudly in
  vLLM's own registry;
- :func:`backend_owner` says who holds a name, and :class:`~mx_refit_dynamo.DynamoRefitClient`
  turns a worker that refuses mx-refit's init info into an error that names the alias.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["ALIAS", "backend_owner", "register"]

ALIAS = "mx_refit"
"""The backend name that always selects mx-refit's engines."""

log = logging.getLogger(__name__)
_lock = threading.Lock()
_TARGETS = {
    "WeightTransferEngineFactory": ("mx_refit_vllm.engine", "MxWeightTransferEngine"),
    "WeightTransferTrainerFactory": ("mx_refit_vllm.trainer", "MxTrainerWeightTransferEngine"),
}


def register() -> None:
    """Register mx-refit's engines as :data:`ALIAS` (idempotent; a ``vllm.general_plugins``
    entry point, so vLLM runs it in every process), and warn when ``mx`` is someone else's."""
    with _lock:
        try:
            from vllm.distributed.weight_transfer import factory as wt_factory
        except ImportError as exc:
            log.debug("mx-refit-dynamo: no vLLM weight-transfer factory (%s); nothing registered", exc)
            return
        import mx_refit_vllm  # type: ignore[import-not-found]

        mx_refit_vllm.register()  # claims "mx" when it is free; leaves it alone otherwise
        for factory_name, target in _TARGETS.items():
            factory = getattr(wt_factory, factory_name, None)
            if factory is None:
                continue
            if ALIAS not in getattr(factory, "_registry", {}):
                try:
                    factory.register_engine(ALIAS, *target)
                except ValueError:  # lost a race with another thread of this process
                    pass
            owner = backend_owner("mx", factory_name)
            if owner not in ("mx-refit", None):
                log.warning(
                    "vLLM %s: backend 'mx' belongs to %s, not mx-refit; select mx-refit with backend %r",
                    factory_name,
                    owner,
                    ALIAS,
                )


def backend_owner(name: str = "mx", factory: str = "WeightTransferEngineFactory") -> str | None:
    """``"mx-refit"`` when ``name`` resolves to mx-refit's engine, the holder's module when it
    resolves to another package's, ``None`` when nobody registered it."""
    from vllm.distributed.weight_transfer import factory as wt_factory

    registry: dict[str, Any] = getattr(getattr(wt_factory, factory), "_registry", {})
    loader = registry.get(name)
    if loader is None:
        return None
    # vLLM's lazy loaders close over (module path, class name); an eager one over the class.
    cells = [c.cell_contents for c in (getattr(loader, "__closure__", None) or ())]
    modules = {v for v in cells if isinstance(v, str) and "." in v}
    modules |= {v.__module__ for v in cells if isinstance(v, type)}
    if not modules:
        modules = {loader().__module__}
    if any(m.startswith("mx_refit_vllm") for m in modules):
        return "mx-refit"
    return sorted(modules)[0]
