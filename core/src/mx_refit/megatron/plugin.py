"""Built-in Megatron plugin: publishes Megatron-Core ranks' native shards and plans receives
for versions they published.

Kept import-light: the classifier, the planner (and torch) load only when a Megatron model is
published or a Megatron version is planned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mx_refit.hookspecs import hookimpl
from mx_refit.megatron.parallel import BridgedModel

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.overrides import RoleOverrides
    from mx_refit.plan import ReceivePlan
    from mx_refit.types import MeshPosition, PublishedTensor, TargetLayout, VersionInfo

# The sidecar entry every Megatron publish carries (see mx_refit.megatron.sidecar).
MEGATRON_CONFIG_KEY = "megatron.config"


def _conversion_tasks(model: BridgedModel) -> list[Any]:
    """Bridge's conversion tasks, computed once per model and kept on its public field:
    computing them is a PP collective and the model's structure does not change between steps."""
    if model.conversion_tasks is None:
        from mx_refit.megatron.sidecar import conversion_tasks

        model.conversion_tasks = conversion_tasks(model.bridge, model.model_chunks)
    return model.conversion_tasks


def _megatron_chunks(model: Any) -> list[Any] | None:
    """The model chunks when ``model`` is a Megatron-Core module (or a list of them)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if chunks and all(type(c).__module__.startswith("megatron.") for c in chunks):
        return chunks
    return None


@hookimpl
def mx_refit_collect_tensors(
    model: Any, mesh: "MeshPosition", overrides: "RoleOverrides"
) -> "list[PublishedTensor] | None":
    """A ``BridgedModel`` is classified with Megatron-Bridge's mappings; a bare Megatron-Core
    model with its own parallel attributes."""
    if isinstance(model, BridgedModel):
        from mx_refit.megatron.collect import collect_megatron_tensors

        return collect_megatron_tensors(model.model_chunks, overrides, tasks=_conversion_tasks(model))
    chunks = _megatron_chunks(model)
    if chunks is None:
        return None
    from mx_refit.megatron.collect import collect_megatron_tensors

    return collect_megatron_tensors(chunks, overrides)


@hookimpl
def mx_refit_build_sidecar(model: Any, mesh: "MeshPosition") -> dict[str, Any] | None:
    """Transformer config and the Megatron->HF name map, from Megatron-Bridge's conversion tasks."""
    if not isinstance(model, BridgedModel):
        return None
    from mx_refit.megatron.sidecar import build_sidecar

    return build_sidecar(model.bridge, model.model_chunks, model.hf_config, tasks=_conversion_tasks(model))


@hookimpl
def mx_refit_plan_receive(version: "VersionInfo", target: "TargetLayout") -> "ReceivePlan | None":
    """Plan any Megatron TP/PP/EP source layout into the worker's target layout."""
    if MEGATRON_CONFIG_KEY not in version.sidecar:
        return None
    from mx_refit.layout.planner import plan_receive
    from mx_refit.transport.base import row_slice_costs

    # Sliced windows are costed for the path that will read them (device copies or NIXL).
    return plan_receive(version, target, row_slice_options=row_slice_costs(version.sources))
