"""mx-refit for NeMo RL: refit GRPO's vLLM workers from native Megatron shards over NIXL.

Selected from a NeMo RL recipe, with no NeMo RL patches::

    policy.generation.refit_transport: "mx_refit_nemo_rl.engine:MxCheckpointEngine"
    policy.generation.vllm_kwargs.worker_cls: mx_refit_nemo_rl.vllm_worker.MxVllmWorker

(the shipped recipes do both through ``weight_sync.method: mx``). Importing this package loads
neither torch, NIXL, vLLM nor Megatron; ``MxCheckpointEngine`` resolves on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mx_refit_nemo_rl.settings import ENGINE_CLASS_PATH, VLLM_WORKER_CLASS_PATH

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit_nemo_rl.engine import MxCheckpointEngine

__version__ = "0.1.0"
__all__ = ["ENGINE_CLASS_PATH", "VLLM_WORKER_CLASS_PATH", "MxCheckpointEngine", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "MxCheckpointEngine":
        from mx_refit_nemo_rl.engine import MxCheckpointEngine

        return MxCheckpointEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
