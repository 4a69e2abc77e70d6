"""mx-refit for Dynamo: refit Dynamo-served vLLM workers through mx-refit's ``mx`` backend.

Two ways in:

- :class:`DynamoRefitClient` (trainer side, standard library only) drives each worker's
  ``mx`` weight-transfer engine through Dynamo 1.6.1's ``/engine/<route>`` routes, and is a
  vLLM ``VLLMWeightSyncClient``, so ``MxTrainerWeightTransferEngine`` drives Dynamo unchanged;
- :class:`MxRefitWorkerExtension` (worker side) adds ``update_weights_via_mx`` to vLLM workers
  for deployments built around a worker extension; it composes with Dynamo's own extensions.

Importing this package is cheap (no torch, vLLM or Dynamo): names resolve on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ALIAS",
    "CycleReport",
    "DynamoRefitClient",
    "DynamoRefitError",
    "DynamoWorker",
    "MxRefitWorkerExtension",
    "backend_owner",
    "fetch_workers",
    "map_mx_config",
    "parse_workers",
]

__version__ = "0.1.0"

_WHERE = {
    "ALIAS": "backend",
    "backend_owner": "backend",
    "CycleReport": "client",
    "DynamoRefitClient": "client",
    "DynamoRefitError": "client",
    "DynamoWorker": "discovery",
    "fetch_workers": "discovery",
    "parse_workers": "discovery",
    "MxRefitWorkerExtension": "extension",
    "map_mx_config": "mx_config",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
