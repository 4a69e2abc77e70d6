"""mx-refit for vLLM: the ``mx`` weight-transfer backend.

Installing this distribution is all a vLLM deployment needs: vLLM runs :func:`register` (a
``vllm.general_plugins`` entry point) in every process, which registers

- the worker engine :class:`~mx_refit_vllm.engine.MxWeightTransferEngine` as backend ``"mx"`` in
  ``WeightTransferEngineFactory`` (select it with ``--weight-transfer-config '{"backend": "mx"}'``);
- the trainer engine :class:`~mx_refit_vllm.trainer.MxTrainerWeightTransferEngine` as ``"mx"`` in
  ``WeightTransferTrainerFactory`` (trainers get it by building an ``MxTrainerInitInfo``);
- both again under the alias ``"mx_refit"`` (:data:`ALIAS`), a name only mx-refit claims, for
  deployments where another package (Dynamo's development branch) registers its own ``mx``.

Importing this package is cheap: torch, vLLM and NIXL are imported only by the submodules that
need them, and registration is lazy (module path + class name).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["ALIAS", "BACKEND", "SUPPORTED_VLLM", "register"]

__version__ = "0.1.0"

BACKEND = "mx"
"""The backend name users put in ``WeightTransferConfig(backend=...)``."""

ALIAS = "mx_refit"
"""The same engines under a name nobody else claims (``mx`` is first come, first served)."""

SUPPORTED_VLLM = ">=0.33,<0.34"
"""The vLLM releases whose weight-transfer API the engines are written against."""

log = logging.getLogger(__name__)

_WORKER_TARGET = ("mx_refit_vllm.engine", "MxWeightTransferEngine")
_TRAINER_TARGET = ("mx_refit_vllm.trainer", "MxTrainerWeightTransferEngine")
_lock = threading.RLock()


def _register_into(factory: Any, target: tuple[str, str], what: str, name: str = BACKEND) -> bool:
    """Register ``target`` lazily under ``name``; ``False`` if the name is taken.

    A name already present is left alone, whoever registered it: vLLM may import this plugin
    several times per process, and a future vLLM might ship its own ``mx`` backend (which then
    wins, with a warning, rather than crashing every process at startup).
    """
    registry = getattr(factory, "_registry", None)
    if isinstance(registry, dict) and name in registry:
        _warn_if_foreign(registry[name], target, what, name)
        return False
    try:
        factory.register_engine(name, *target)
    except ValueError:
        # Lost a race with another registrant, or a vLLM whose registry is not introspectable.
        return False
    return True


def _warn_if_foreign(loader: Any, target: tuple[str, str], what: str, name: str) -> None:
    # Our lazy loader is a closure over the module path; anything else is someone else's engine.
    cells = getattr(loader, "__closure__", None) or ()
    values = {getattr(c, "cell_contents", None) for c in cells}
    if target[0] not in values:
        other = ALIAS if name == BACKEND else BACKEND
        log.warning(
            "vLLM %s backend %r is already registered by another package; mx-refit's is not used "
            "under that name (select it as %r)",
            what,
            name,
            other,
        )


def register() -> None:
    """Register the worker and trainer engines with vLLM as ``mx`` and as ``mx_refit``
    (idempotent, re-entrant).

    Safe in every process vLLM starts and safe to call any number of times. A vLLM without the
    weight-transfer factory (older than the ``WeightTransferEngine`` API) is tolerated: nothing is
    registered and a debug message says why.
    """
    with _lock:
        try:
            from vllm.distributed.weight_transfer import factory as wt_factory
        except ImportError as exc:  # vLLM absent or too old: the plugin stays inert
            log.debug(
                "mx-refit: vLLM weight-transfer factory unavailable (%s); backend %r not registered",
                exc,
                BACKEND,
            )
            return
        for factory_name, target, what in (
            ("WeightTransferEngineFactory", _WORKER_TARGET, "weight-transfer"),
            ("WeightTransferTrainerFactory", _TRAINER_TARGET, "trainer weight-transfer"),
        ):
            factory = getattr(wt_factory, factory_name, None)
            if factory is not None:
                for name in (BACKEND, ALIAS):
                    _register_into(factory, target, what, name)


def __getattr__(name: str) -> Any:
    # Lazy re-exports so `import mx_refit_vllm` stays free of torch/vLLM.
    lazy = {
        "MxInitInfo": "mx_refit_vllm.infos",
        "MxUpdateInfo": "mx_refit_vllm.infos",
        "MxWeightTransferEngine": "mx_refit_vllm.engine",
        "MxTrainerInitInfo": "mx_refit_vllm.trainer",
        "MxTrainerWeightTransferEngine": "mx_refit_vllm.trainer",
    }
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
