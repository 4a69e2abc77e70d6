"""The receive planner (pure): a version's descriptors and sidecar plus this worker's target layout
become a :class:`~mx_refit.plan.ReceivePlan` (which bytes to read, how they become HF tensors).

It imports only ``types``, ``errors``, ``plan`` and the byte-range math (``mx_refit.ranges``);
the trainer-side classifier lives in :mod:`mx_refit.megatron`.

Import-light: submodules (and torch) load on first use of a re-exported name.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["MegatronReceivePlan", "plan_receive"]

_LAZY = {"MegatronReceivePlan": "mx_refit.layout.planner", "plan_receive": "mx_refit.layout.planner"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
