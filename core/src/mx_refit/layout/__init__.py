"""Megatron layout engine: classify native shards, plan receives, translate to HF tensors.

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
