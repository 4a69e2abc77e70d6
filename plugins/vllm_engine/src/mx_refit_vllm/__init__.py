"""mx-refit for vLLM: the ``mx`` weight-transfer backend.

Installing this distribution is all a vLLM deployment needs: vLLM runs :func:`register` (a
``vllm.general_plugins`` entry point) in every process, which registers

- the worker engine :class:`~mx_refit_vllm.engine.MxWeightTransferEngine` as backend ``"mx"`` in
  ``WeightTransferEngineFactory`` (select it with ``--weight-transfer-config '{"backend": "mx"}'``);
- the trainer engine :class:`~mx_refit_vllm.trainer.MxTrainerWeightTransferEngine` as ``"mx"`` in
  ``WeightTransferTrainerFactory`` (trainers get it by building an ``MxTrainerInitInfo``).

Importing this package is cheap: torch, vLLM and NIXL are imported only by the submodules that
need them, and registration is lazy (module path + class name).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["BACKEND", "register"]

__version__ = "0.1.0"

BACKEND = "mx"
"""The backend name users put in ``WeightTransferConfig(backend=...)``."""

log = logging.getLogger(__name__)

_WORKER_TARGET = ("mx_refit_vllm.engine", "MxWeightTransferEngine")
_TRAINER_TARGET = ("mx_refit_vllm.trainer", "MxTrainerWeightTransferEngine")
_lock = threading.RLock()


def _register_into(factory: Any, target: tuple[str, str], what: str) -> bool:
    """Register ``target`` lazily under :data:`BACKEND`; ``False`` if the name is taken.

    A name already present is left alone, whoever registered it: vLLM may import this plugin
    several times per process, and a future vLLM might ship its own ``mx`` backend (which then
    wins, with a warning, rather than crashing every process at startup).
    """
    registry = getattr(factory, "_registry", None)
    if isinstance(registry, dict) and BACKEND in registry:
        _warn_if_foreign(registry[BACKEND], target, what)
        return False
    try:
        factory.register_engine(BACKEND, *target)
    except ValueError:
        # Lost a race with another registrant, or a vLLM whose registry is not introspectable.
        return False
    return True


def _warn_if_foreign(loader: Any, target: tuple[str, str], what: str) -> None:
    # Our lazy loader is a closure over the module path; anything else is someone else's engine.
    cells = getattr(loader, "__closure__", None) or ()
    values = {getattr(c, "cell_contents", None) for c in cells}
    if target[0] not in values:
        log.warning(
            "vLLM %s backend %r is already registered by another package; mx-refit's is not used",
            what,
            BACKEND,
        )


def register() -> None:
    """Register the ``mx`` worker and trainer engines with vLLM (idempotent, re-entrant).

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
        worker_factory = getattr(wt_factory, "WeightTransferEngineFactory", None)
        if worker_factory is not None:
            _register_into(worker_factory, _WORKER_TARGET, "weight-transfer")
        trainer_factory = getattr(wt_factory, "WeightTransferTrainerFactory", None)
        if trainer_factory is not None:
            _register_into(trainer_factory, _TRAINER_TARGET, "trainer weight-transfer")


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
