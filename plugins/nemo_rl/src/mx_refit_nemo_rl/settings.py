"""The engine's keyword arguments: NeMo RL's ``refit_cfg`` dump, validated.

NeMo RL builds the engine with ``cls(bucket_size=..., **engine_kwargs)``
(``utils/checkpoint_engines/base.py:101-113``), where ``engine_kwargs`` is the recipe's
``policy.generation.refit_cfg["mx_refit_nemo_rl:MxCheckpointEngine"]`` block dumped through
``VllmCheckpointEnginePluginConfig`` minus ``update_weights_bucket_memory_ratio``
(``weight_sync/checkpoint_engine_config.py:50-57``). The shipped recipes fill that block from the
recipe's ``weight_sync`` node, so the block is ``{release_after_refit, weight_sync}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mx_refit.errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.config import WeightSyncConfig

__all__ = [
    "ARENA_DEVICES",
    "ENGINE_CLASS_PATH",
    "PLUGIN_NAMESPACE",
    "VLLM_WORKER_CLASS_PATH",
    "EngineSettings",
    "parse_engine_kwargs",
    "resolve_arena_device",
]

ENGINE_CLASS_PATH = "mx_refit_nemo_rl.engine:MxCheckpointEngine"
VLLM_WORKER_CLASS_PATH = "mx_refit_nemo_rl.vllm_worker.MxVllmWorker"
PLUGIN_NAMESPACE = "nemo_rl"
_WHERE = f"policy.generation.refit_cfg[{ENGINE_CLASS_PATH!r}]"

# Keys of the plugin namespace (weight_sync.nemo_rl): the recipe's selection tables. The engine
# itself needs none of them; they are checked so a typo does not pass silently.
_NAMESPACE_KEYS = {
    "engine_by_method", "worker_cls_by_method", "colocated_by_method", "release_after_refit", "arena_device",
}

# weight_sync.nemo_rl.arena_device: where each vLLM worker's receive arena lives. "worker": the
# worker's own device (its GPU on a GPU worker, so same-node sources can use GPU paths); "gpu":
# the same, refused on a worker that has no GPU; "cpu": pinned host memory (the model's size per
# worker in RAM, for GPUs too full to hold a second copy).
ARENA_DEVICES = ("worker", "gpu", "cpu")


@dataclass
class EngineSettings:
    bucket_size: int
    release_after_refit: bool
    config: WeightSyncConfig
    arena_device: str = "worker"


def parse_engine_kwargs(bucket_size: Any, kwargs: Mapping[str, Any]) -> EngineSettings:
    """Validate NeMo RL's constructor arguments; errors name the recipe field and the value."""
    from mx_refit.config import check_count, check_flag, load_config

    check_count(bucket_size, "bucket_size", minimum=1, setting=True)
    extra = dict(kwargs)
    release = check_flag(extra.pop("release_after_refit", False), f"{_WHERE}.release_after_refit", setting=True)
    weight_sync = extra.pop("weight_sync", None)
    if extra:
        raise InvalidArgument(
            f"{_WHERE}: unknown keys {sorted(extra)}; mx-refit settings go in weight_sync "
            "(the recipes interpolate it: weight_sync: ${weight_sync})"
        )
    if weight_sync is None:
        weight_sync = {}
    if not isinstance(weight_sync, Mapping):
        raise InvalidArgument(f"{_WHERE}.weight_sync: {weight_sync!r} (expected a mapping)")
    cfg = load_config({"weight_sync": dict(weight_sync)})
    unknown = set(cfg.plugin_settings.get(PLUGIN_NAMESPACE, {})) - _NAMESPACE_KEYS
    if unknown:
        raise InvalidArgument(
            f"weight_sync.{PLUGIN_NAMESPACE}: unknown keys {sorted(unknown)} (known: {sorted(_NAMESPACE_KEYS)})"
        )
    arena = cfg.plugin_settings.get(PLUGIN_NAMESPACE, {}).get("arena_device", "worker")
    if arena not in ARENA_DEVICES:
        raise InvalidArgument(
            f"weight_sync.{PLUGIN_NAMESPACE}.arena_device: {arena!r} (expected one of {list(ARENA_DEVICES)})"
        )
    return EngineSettings(bucket_size=bucket_size, release_after_refit=release, config=cfg, arena_device=arena)


def resolve_arena_device(setting: str, worker_device: Any) -> str:
    """The receive arena's device for ``weight_sync.nemo_rl.arena_device`` on a vLLM worker whose
    model lives on ``worker_device`` (a ``torch.device`` or its string; ``None`` when unknown)."""
    if setting == "cpu":
        return "cpu"
    device = str(worker_device) if worker_device is not None else None
    if device is None:
        raise InvalidArgument(
            f"weight_sync.{PLUGIN_NAMESPACE}.arena_device: {setting!r}, but this vLLM worker's device is "
            "unknown (no worker.device nor vllm_config.device_config.device); set it to 'cpu'"
        )
    if setting == "gpu" and not device.startswith("cuda"):
        raise InvalidArgument(
            f"weight_sync.{PLUGIN_NAMESPACE}.arena_device: 'gpu', but this vLLM worker runs on {device!r}; "
            "use 'worker' or 'cpu'"
        )
    if device == "cuda":  # no index: the device this process is bound to
        import torch

        device = f"cuda:{torch.cuda.current_device()}"
    return device
