"""Turn the Megatron-Core model on this rank into what the Publisher publishes.

``collect_megatron_tensors`` yields one ``PublishedTensor`` per native shard, IN PLACE: each
tensor is a view of the parameter's own storage (asserted), never a copy and never gathered.
Padded vocabularies are published padded; the sidecar records both vocabulary sizes so the
receiver trims.

``collect_for_publish`` is the one-call trainer-side entry point: classify with the bridge's
mappings and build the sidecar from the same conversion tasks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mx_refit.megatron.classify import (
    BridgeKind,
    ClassificationError,
    ClassifiedParam,
    RoleOverrides,
    classify_model,
)
from mx_refit.megatron.parallel import ParallelContext, unwrap_model
from mx_refit.megatron.sidecar import bridge_mapping_kinds, build_sidecar, conversion_tasks
from mx_refit.types import PublishedTensor

__all__ = ["collect_for_publish", "collect_megatron_tensors", "publishing_share", "to_published"]


def _assert_in_place(item: ClassifiedParam, params: Mapping[str, Any]) -> None:
    param = params[item.raw_name]
    tensor = item.tensor
    if tensor.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
        raise ClassificationError(f"{item.name}: published tensor does not share the parameter's storage")
    if not tensor.is_contiguous():
        raise ClassificationError(
            f"{item.name}: parameter {item.raw_name} is not contiguous {tuple(tensor.stride())}; "
            "it cannot be registered in place"
        )
    if tensor.dim() == param.dim() and tensor.data_ptr() != param.data_ptr():
        raise ClassificationError(f"{item.name}: published view does not start at the parameter's data")


def to_published(items: Iterable[ClassifiedParam], model: Any) -> list[PublishedTensor]:
    """``ClassifiedParam`` -> ``PublishedTensor``, checking every tensor is the live parameter."""
    params: dict[str, Any] = {}
    for chunk in unwrap_model(model):
        params.update(chunk.named_parameters())
    out: list[PublishedTensor] = []
    for item in items:
        _assert_in_place(item, params)
        out.append(PublishedTensor(
            name=item.name,
            tensor=item.tensor,
            role=item.role,
            global_shape=item.global_shape,
            shard_axis=item.shard_axis,
            shard_offset=item.shard_offset,
            extras=dict(item.extras),
        ))
    return out


def collect_megatron_tensors(
    model: Any,
    overrides: RoleOverrides | Sequence[Mapping[str, Any]] | None = None,
    *,
    bridge: Any | None = None,
    tasks: Sequence[Any] | None = None,
    ctx: ParallelContext | None = None,
) -> list[PublishedTensor]:
    """This rank's native shards of ``model`` (a module or a list of chunks), in place.

    Keeps only what this rank publishes (:func:`publishing_share`). ``overrides`` is a
    ``RoleOverrides`` registry or a config list of override dicts. With
    ``bridge`` (an ``AutoBridge``) or precomputed ``tasks``, roles come from Megatron-Bridge's
    mappings (computing tasks is a PP collective: call on every rank together); otherwise from
    Megatron-Core's parallel attributes.
    """
    if overrides is not None and not isinstance(overrides, RoleOverrides):
        overrides = RoleOverrides.from_config(overrides)
    kinds: dict[str, BridgeKind] = {}
    if tasks is None and bridge is not None:
        tasks = conversion_tasks(bridge, model)
    if tasks is not None:
        kinds = bridge_mapping_kinds(tasks)
    ctx = ctx or ParallelContext.from_parallel_state()
    items = classify_model(model, overrides=overrides, bridge_kinds=kinds, ctx=ctx)
    return to_published(publishing_share(items, ctx), model)


def publishing_share(items: Sequence[ClassifiedParam], ctx: ParallelContext) -> list[ClassifiedParam]:
    """What this rank publishes (see ``is_publishing_rank``): its dense shards when it is the
    first data-parallel replica of its (tp, pp) position, its expert shards when it is the first
    expert-data-parallel replica of its (etp, ep, pp) position; nothing otherwise."""
    if ctx.publishes_dense and ctx.publishes_experts:
        return list(items)
    return [
        item for item in items
        if (ctx.publishes_experts if "expert_id" in item.extras else ctx.publishes_dense)
    ]


def collect_for_publish(
    bridge: Any,
    model: Any,
    overrides: RoleOverrides | Sequence[Mapping[str, Any]] | None = None,
    *,
    hf_config: Any | None = None,
) -> tuple[list[PublishedTensor], dict[str, Any]]:
    """``(tensors, sidecar)`` for ``Publisher.publish(version, tensors, sidecar=sidecar)``.

    Computes Bridge's conversion tasks once (a PP collective) for both.
    """
    tasks = conversion_tasks(bridge, model)
    tensors = collect_megatron_tensors(model, overrides, tasks=tasks)
    sidecar = build_sidecar(bridge, model, hf_config, tasks=tasks)
    return tensors, sidecar
