"""Public runtime helpers for Megatron-Core trainer ranks: where this rank sits in the mesh,
whether it publishes, and the model handle the built-in Megatron plugin recognises.

Import-light: megatron (and torch) load inside the functions, so ``mx_refit.BridgedModel`` and
friends can be re-exported from the package root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mx_refit.types import MeshPosition

__all__ = [
    "BridgedModel",
    "ParallelContext",
    "innermost_module",
    "is_publishing_rank",
    "mesh_position",
    "unwrap_model",
]


@dataclass
class BridgedModel:
    """A Megatron-Core model and the Megatron-Bridge ``AutoBridge`` that maps it to HF names.

    Publish it with ``Publisher.publish(version, model=bridged)``: the built-in Megatron plugin
    classifies its tensors with Bridge's mappings and builds the sidecar receivers plan from.

    :param bridge: The ``megatron.bridge.AutoBridge`` (or a bridge exposing the same methods).
    :param model_chunks: The model chunks on this rank (one per virtual pipeline stage).
    :param hf_config: The HF ``PretrainedConfig`` of the checkpoint.
    :param conversion_tasks: Bridge's conversion tasks for ``model_chunks``, when the caller
        already has them (NeMo RL caches them). Computing them is a pipeline-parallel
        collective, so when ``None`` the plugin computes them once, on first publish, on every
        rank together, and stores them here.
    """

    bridge: Any
    model_chunks: list[Any]
    hf_config: Any
    conversion_tasks: list[Any] | None = None

    @property
    def model(self) -> list[Any]:
        """The model chunks (alias of ``model_chunks``)."""
        return self.model_chunks


@dataclass(frozen=True)
class ParallelContext:
    """This rank's coordinates in every parallel dimension the classifier needs.

    Expert tensors are split by the expert-tensor-parallel group (ETP), which may differ from TP.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def from_parallel_state(cls) -> ParallelContext:
        """Read ``megatron.core.parallel_state``; a single-rank context when it is not initialised."""
        try:
            from megatron.core import parallel_state as ps
        except ImportError:
            return cls()
        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
        )

    def mesh(self) -> MeshPosition:
        return MeshPosition(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            ep_rank=self.ep_rank,
            ep_size=self.ep_size,
        )


def mesh_position() -> MeshPosition:
    """This rank's ``MeshPosition`` (tp, pp, ep) for the Publisher."""
    return ParallelContext.from_parallel_state().mesh()


def is_publishing_rank() -> bool:
    """True on the one rank per (tp, pp, ep) position that should publish.

    Data-parallel replicas beyond the expert-parallel dimension hold identical shards and would
    reuse a mesh position; only expert-data-parallel rank 0 publishes.
    """
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return True
    if not ps.model_parallel_is_initialized():
        return True
    return ps.get_expert_data_parallel_rank() == 0


def innermost_module(module: Any) -> Any:
    """Strip DDP / Float16Module wrappers (each exposes the wrapped model as ``.module``)."""
    import torch

    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def unwrap_model(model: Any) -> list[Any]:
    """Normalise a model / list of model chunks to a list (wrappers are kept: names carry them)."""
    if isinstance(model, (list, tuple)):
        return list(model)
    return [model]
