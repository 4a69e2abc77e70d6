"""Reproduction of ``nemo_rl/utils/checkpoint_engines/base.py`` at NVIDIA-NeMo/RL 7ea279a.

- ``CheckpointEngine`` (``:40-92``): an ABC; abstract ``prepare``, keyword-only
  ``init_policy_process_group`` / ``init_rollout_process_group``, ``async send_weights(weights)``,
  ``receive_weight_batches()`` (an async generator of ``[(name, tensor)]`` batches); ``finalize``
  has a no-op default; class attribute ``cleanup_after_load = True``.
- ``create_checkpoint_engine`` (``:95-103``): ``"nixl"`` is an alias; otherwise
  ``"module:Class"`` is imported and called as ``cls(bucket_size=bucket_size_bytes,
  **engine_kwargs)``. No type check of the class.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any


class CheckpointEngine(ABC):
    cleanup_after_load: bool = True

    @abstractmethod
    def prepare(self) -> Any: ...

    @abstractmethod
    def init_policy_process_group(
        self, *, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None: ...

    @abstractmethod
    def init_rollout_process_group(
        self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None: ...

    def finalize(self) -> None:
        return None

    @abstractmethod
    async def send_weights(self, weights: Any) -> None: ...

    @abstractmethod
    def receive_weight_batches(self) -> Any: ...


def create_checkpoint_engine(
    backend: str, *, bucket_size_bytes: int, engine_kwargs: dict[str, Any]
) -> CheckpointEngine:
    if backend == "nixl":
        backend = "nemo_rl.utils.checkpoint_engines.nixl:NIXLCheckpointEngine"
    module_name, class_name = backend.split(":", 1)
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    return engine_cls(bucket_size=bucket_size_bytes, **engine_kwargs)
