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
    "expected_sources",
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
    """This rank's coordinates in every parallel dimension the classifier and the publishing
    rule need.

    Expert tensors are split by the expert-tensor-parallel group (ETP), which may differ from TP.
    ``dp_rank`` is the data-parallel rank with context parallelism folded in (both hold identical
    dense weights); ``edp_rank`` the expert-data-parallel rank (identical expert weights).
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    dp_rank: int = 0
    edp_rank: int = 0

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
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            edp_rank=ps.get_expert_data_parallel_rank(),
        )

    @property
    def publishes_dense(self) -> bool:
        """First data-parallel replica of its (tp, pp) position: publishes the dense shards."""
        return self.dp_rank == 0

    @property
    def publishes_experts(self) -> bool:
        """First expert-data-parallel replica of its (etp, ep, pp) position: publishes the
        expert shards."""
        return self.edp_rank == 0

    @property
    def publishes(self) -> bool:
        return self.publishes_dense or self.publishes_experts

    def mesh(self) -> MeshPosition:
        return MeshPosition(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            ep_rank=self.ep_rank,
            ep_size=self.ep_size,
            etp_rank=self.etp_rank,
            etp_size=self.etp_size,
        )


def mesh_position() -> MeshPosition:
    """This rank's ``MeshPosition`` (tp, pp, ep, etp) for the Publisher."""
    return ParallelContext.from_parallel_state().mesh()


def is_publishing_rank() -> bool:
    """True on a rank that publishes dense shards, expert shards or both.

    A rank publishes its dense shards when it is the first data-parallel replica of its (tp, pp)
    position, and its expert shards when it is the first expert-data-parallel replica of its
    (etp, ep, pp) position (the collectors drop what a rank does not publish). With expert TP
    different from TP these are different ranks; :func:`expected_sources` counts them.
    """
    return ParallelContext.from_parallel_state().publishes


def expected_sources(
    tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, *, mesh: MeshPosition | None = None
) -> int:
    """How many ranks of a Megatron job publish (``Publisher(expected_sources=...)``).

    The one rule every integration uses: ``pp * max(tp, etp * ep)``. Megatron orders ranks with
    TP (then CP, EP, DP) varying fastest inside each pipeline stage (``tp-cp-ep-dp-pp`` and
    ``tp-cp-ep-pp-dp``), so the first DP replicas of the dense mesh are a stage's first ``tp``
    ranks and the first expert-DP replicas its first ``etp * ep`` ranks: the publishing ranks of
    :func:`is_publishing_rank` are the first ``max(tp, etp * ep)`` of each stage. ``etp`` defaults
    to ``tp`` (Megatron's default); with ``mesh`` the sizes are read from it.
    """
    from mx_refit.errors import InvalidArgument

    if mesh is not None:
        tp, pp, ep, etp = mesh.tp_size, mesh.pp_size, mesh.ep_size, mesh.etp_size or None
    sizes = {"tp": tp, "pp": pp, "ep": ep, "etp": tp if etp is None else etp}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"expected_sources: {name} must be an integer >= 1, got {value!r}")
    return sizes["pp"] * max(sizes["tp"], sizes["etp"] * sizes["ep"])


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
