"""The rollout side's coordinates, read from vLLM's initialised process groups.

Uses only ``vllm.distributed.parallel_state`` functions that NeMo RL's own vLLM backend calls at
its pinned vLLM 0.25.1 (``get_pp_group``, ``vllm_backend.py:49``) and that vLLM 0.33 still has
(``model_parallel_is_initialized``, ``get_tp_group``, ``get_pp_group``, ``get_ep_group``).
"""

from __future__ import annotations

from typing import Any

from mx_refit.types import TargetLayout

__all__ = ["target_layout", "worker_device"]


def worker_device(worker: Any) -> Any:
    """The device a vLLM worker's model lives on: ``worker.device`` (set by vLLM's GPU and CPU
    workers in ``init_device``), else its ``vllm_config.device_config`` (``None`` if neither)."""
    device = getattr(worker, "device", None)
    if device is not None:
        return device
    config = getattr(getattr(worker, "vllm_config", None), "device_config", None)
    if config is None:
        return None
    return getattr(config, "device", None) or getattr(config, "device_type", None)


def target_layout(*, full_tensors: bool = True) -> TargetLayout:
    """This vLLM worker's layout: TP coordinates, and EP ones only where vLLM places experts
    linearly without EPLB (the one placement a planner can predict); else every expert is pulled
    and vLLM's MoE loader keeps its own."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return TargetLayout(full_tensors=full_tensors)
    tp = ps.get_tp_group()
    layout: dict[str, Any] = {"tp_rank": tp.rank_in_group, "tp_size": tp.world_size}
    parallel = _parallel_config()
    if (
        parallel is not None
        and getattr(parallel, "enable_expert_parallel", False)
        and not getattr(parallel, "enable_eplb", False)
        and getattr(parallel, "expert_placement_strategy", "linear") == "linear"
        and getattr(ps, "_EP", None) is not None
    ):
        ep = ps.get_ep_group()
        layout.update(ep_rank=ep.rank_in_group, ep_size=ep.world_size)
    return TargetLayout(full_tensors=full_tensors, **layout)


def _parallel_config() -> Any:
    try:
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config().parallel_config
    except Exception:  # outside a vLLM config context: no EP information
        return None
