"""Lazy package exports (PEP 562), shared by the core's packages.

A package lists ``{name: module}`` and binds the two functions this returns as its module-level
``__getattr__`` and ``__dir__``: the name's module is imported on first use and the value kept,
so ``import mx_refit`` pulls in no torch, gRPC or Megatron until a user touches what needs them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    namespace: dict[str, Any], where: Mapping[str, str], prefix: str = ""
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package whose ``globals()`` is ``namespace``.

    ``where`` maps an exported name to the module defining it (``prefix`` is put before it,
    e.g. the package's own name and a dot for a mapping of submodule names).
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(prefix + module), name)
        namespace[name] = value  # resolve once
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
