"""When native shards are not the whole story: consume NeMo RL's HF export stream instead.

``MegatronPolicyWorkerImpl._iter_params_with_optional_kv_scales`` (``megatron_policy_worker.py:
2328-2401``) yields more than the Megatron parameters when:

- an EAGLE draft model is attached: ``draft.*`` weights (``:2360-2367``);
- vLLM runs an FP8 KV cache: per-layer KV/Q scale tensors (``:2369-2401``);
- training keeps FP8 parameters: the tasks come from Bridge's ``build_export_fp8_tasks``
  (``:2273-2276``), FP8 data plus ``*_scale_inv`` pairs the native-shard classifier does not know.

and when the live shards are not what the rollout should load, or cannot be classified:

- ModelOpt quantisation (``policy.quant_cfg``): NeMo RL's quantisation worker folds the
  quantizers into the weights during its export, so the raw shards are the wrong weights;
- a Megatron-Bridge mapping type the classifier has no role for (Bridge 0.7's GDN, Mamba and
  QKVG mappings of Qwen3-Next and Nemotron-H, or a new model bridge's own).

Every condition derives from the worker's config or its cached conversion tasks, and the engine
unions the answer over the policy ranks, so every rank reaches the same decision before any of
them touches the export generator, and they all consume the stream together (the export runs
TP/PP/EP collectives). Rank 0 stages the exported tensors in buffers kept across refits and
publishes them as whole HF tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["HfStage", "fallback_reasons"]


def _fp8_kv_cache(worker: Any) -> bool:
    cfg = getattr(worker, "cfg", None) or {}
    generation = cfg.get("generation") if hasattr(cfg, "get") else None
    if not generation or generation.get("backend") != "vllm":
        return False
    dtype = (generation.get("vllm_cfg") or {}).get("kv_cache_dtype") or ""
    return str(dtype).startswith("fp8")


def _quant_cfg(worker: Any) -> Any:
    cfg = getattr(worker, "cfg", None) or {}
    return cfg.get("quant_cfg") if hasattr(cfg, "get") else None


def fallback_reasons(worker: Any, kv_scales: dict[str, float] | None, tasks: Any = None) -> list[str]:
    """Why this refit must go through the HF export stream (empty: native shards cover it).

    ``tasks``: the worker's Bridge conversion tasks, checked for mapping types without a role.
    """
    import mx_refit

    reasons = []
    quant = _quant_cfg(worker)
    if quant:
        reasons.append(
            f"ModelOpt quantisation is on (policy.quant_cfg={quant!r}): NeMo RL's export folds the "
            "quantizers into the weights, the live shards are not what vLLM should load"
        )
    for mapping, params in sorted(mx_refit.unsupported_bridge_mappings(tasks).items()):
        reasons.append(
            f"Megatron-Bridge mapping {mapping} has no mx-refit role ({len(params)} parameters, e.g. "
            f"{params[0]}): the native-shard classifier and planner do not know its layout"
        )
    if getattr(worker, "draft_model", None) is not None:
        reasons.append("an EAGLE draft model is attached (draft.* weights)")
    if kv_scales or _fp8_kv_cache(worker):
        reasons.append("vLLM uses an FP8 KV cache (KV/Q scale tensors)")
    is_fp8_export = getattr(worker, "_is_fp8_export", None)
    if callable(is_fp8_export) and is_fp8_export():
        reasons.append("FP8 parameters are exported with Bridge's build_export_fp8_tasks")
    return reasons


class HfStage:
    """Rank 0's copy of the exported HF tensors, in buffers reused while names, shapes and dtypes
    stay the same (so republishing registers nothing new)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def fill(self, stream: Iterable[tuple[str, torch.Tensor]], *, keep: bool) -> tuple[int, int]:
        """Consume ``stream`` to the end; with ``keep``, copy every tensor into its buffer.

        Returns ``(tensors, bytes)`` seen. A name that repeats is an error: HF names are unique.
        """
        import torch

        seen: set[str] = set()
        nbytes = 0
        for name, tensor in stream:
            if name in seen:
                raise ValueError(f"the HF export yielded {name!r} twice")
            seen.add(name)
            nbytes += tensor.numel() * tensor.element_size()
            if not keep:
                continue
            buffer = self.buffers.get(name)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or (
                buffer.device != tensor.device
            ):
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
                self.buffers[name] = buffer
            buffer.copy_(tensor.detach())
        if keep:
            for stale in set(self.buffers) - seen:
                del self.buffers[stale]
        return len(seen), nbytes
