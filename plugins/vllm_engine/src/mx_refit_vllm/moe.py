"""Fused-MoE experts: where each HF expert tensor's rank window lands in vLLM's ``w13``/``w2``.

vLLM 0.33 keeps a MoE layer's experts in two stacked parameters of its ``RoutedExperts``
(``FusedMoE``) module: ``w13_weight`` ``[local experts, 2 * intermediate / tp, hidden]`` (gate
rows, then up rows) and ``w2_weight`` ``[local experts, hidden, intermediate / tp]``. Everything
here is read from that module, never from a table per model:

* HF name -> (parameter, global expert id, shard ``w1``/``w2``/``w3``): the module's own
  ``get_expert_mapping()`` (what ``make_expert_params_mapping`` builds for the model's
  ``load_weights``), matched and renamed exactly as ``RoutedExperts.load_weights`` does;
* the expert's row in the stack: ``_map_global_expert_id_to_local_expert_id`` (the expert map;
  ``-1``: another EP rank's expert);
* the window, as ``weight_loader`` narrows it: ``w1``/``w3`` on dim 0 (gate into the first half
  of the expert's rows, up into the second), ``w2`` on dim 1, ``moe_config.tp_rank`` times the
  per-rank size; under vLLM's expert parallelism the MoE TP size is 1, so local experts whole.

The core planner yields the same windows for ``TargetLayout(full_tensors=False)`` (expert fc1
rows and fc2 columns split by TP; whole local experts under EP). Anything the loader would do
beyond narrowing and copying makes the module *unproven* (pulled whole, loaded by vLLM):
quantized experts, weights converted for a kernel after loading, padding, transposed or
biased experts, EPLB redundant or fused shared experts, an EP layout not announced to the
planner.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_fused_moe", "moe_problem", "ExpertIndex"]

_PLACEABLE_MOE_METHODS = frozenset({"UnquantizedFusedMoEMethod"})
# Unquantized backends whose post-load conversion keeps the loaded layout (no shuffle, no pack).
_IDENTITY_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})


def is_fused_moe(module: Any) -> bool:
    """A vLLM fused-MoE expert module (``RoutedExperts``/``FusedMoE``): stacked ``w13``/``w2``."""
    return all(hasattr(module, a) for a in ("w13_weight", "w2_weight", "moe_config", "get_expert_mapping"))


def moe_problem(module: Any, tp_size: int, ep_size: int) -> str | None:
    """Why this fused-MoE module's experts cannot be placed rank-exactly, or ``None``."""
    method = getattr(module, "quant_method", None)
    name = type(method).__name__
    if name not in _PLACEABLE_MOE_METHODS:
        return f"fused MoE with {name} (expert loading the planner cannot reproduce)"
    backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
    if getattr(method, "moe_kernel", None) is not None and backend not in _IDENTITY_BACKENDS:
        return f"fused MoE experts converted after loading for the {backend} kernel"
    cfg = module.moe_config
    par = cfg.moe_parallel_config
    if cfg.num_experts != cfg.num_logical_experts or module.expert_map_manager.num_fused_shared_experts:
        return "fused MoE with redundant (EPLB) or fused shared experts"
    if not cfg.is_act_and_mul or cfg.has_bias:
        return "fused MoE without gated activation or with expert biases"
    if getattr(cfg, "tp_shard_with_padding", False) or (
        cfg.intermediate_size_per_partition != cfg.intermediate_size_per_partition_unpadded
        or cfg.hidden_dim != cfg.hidden_dim_unpadded
    ):
        return "fused MoE with padded experts"
    if any(getattr(p, "is_transposed", False) for p in (module.w13_weight, module.w2_weight)):
        return "fused MoE with transposed expert weights"
    if par.use_ep:
        if par.tp_size != 1 or par.ep_size != ep_size:
            return f"fused MoE expert parallel {par.ep_size} (tp {par.tp_size}) != the planner's EP {ep_size}"
        per = cfg.num_local_experts
        first = par.ep_rank * per
        if per * par.ep_size != cfg.num_experts or any(  # the planner's EP: contiguous blocks
            module._map_global_expert_id_to_local_expert_id(first + e) != e for e in range(per)
        ):
            return f"fused MoE expert map of EP rank {par.ep_rank} is not the contiguous block of {per}"
    elif par.tp_size != tp_size or ep_size != 1:
        return f"fused MoE TP size {par.tp_size} != worker TP size {tp_size} (EP {ep_size})"
    if tuple(module.w13_weight.shape[1:]) != (2 * cfg.intermediate_size_per_partition, cfg.hidden_dim):
        return f"w13_weight shape {tuple(module.w13_weight.shape)} is not [E, 2 * intermediate, hidden]"
    return None


class ExpertIndex:
    """HF expert tensor name -> ``(parameter attribute, local expert, shard id, src, dst)`` for
    one fused-MoE module, from its own expert mapping."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.layer = f"{module.layer_name}."
        self.by_expert: dict[str, list[tuple[str, str, int, str]]] = {}
        for entry in module.get_expert_mapping():  # (param_name, weight_name, expert_id, shard_id)
            key = entry[1].partition("experts.")[2].partition(".")[0]
            self.by_expert.setdefault(key, []).append(entry)

    def find(self, hf_name: str) -> tuple[str, int, tuple[int, int, int], tuple[int, int, int] | None] | None:
        """``(attribute, local expert, src window, dst)`` as ``RoutedExperts.load_weights`` +
        ``weight_loader`` would place ``hf_name``; ``None`` when it is not a per-expert
        weight of this module or not this rank's expert."""
        if not hf_name.startswith(self.layer) or hf_name.count("experts.") != 1:
            return None
        key = hf_name.partition("experts.")[2].partition(".")[0]
        for param_name, weight_name, expert_id, shard_id in self.by_expert.get(key, ()):
            if weight_name not in hf_name:
                continue
            attr = hf_name.replace(weight_name, param_name).removeprefix(self.layer)
            if attr not in ("w13_weight", "w2_weight"):
                return None  # scales, biases: not placed here
            local = self.module._map_global_expert_id_to_local_expert_id(expert_id)
            if local < 0:
                return None  # another EP rank's expert
            cfg = self.module.moe_config
            per = cfg.intermediate_size_per_partition
            lo = cfg.tp_rank * per
            if shard_id == "w2":
                return attr, local, (1, lo, lo + per), None
            return attr, local, (0, lo, lo + per), (0, 0 if shard_id == "w1" else per, per)
        return None
