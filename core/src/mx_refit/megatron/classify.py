"""Classify every parameter of a Megatron-Core model into a published role and shard geometry.

A parameter's role says how its native shard relates to the full Megatron tensor (see
``mx_refit.types.Role``). Detection, strongest first:

1. **Role overrides** (``RoleOverrides``): by parameter-name glob or module class name, from
   plugins (``mx_refit_register_role_overrides(register)``) or config. Overrides always win.
2. **Megatron-Bridge mappings**: when the caller passes the bridge's conversion tasks
   (``bridge_mapping_kinds``), the mapping class decides (``QKVMapping`` -> ``qkv_column``,
   ``GatedMLPMapping`` -> ``gated_mlp_column``, column/row/replicated, experts, vocab).
3. **Megatron-Core attributes**: ``tensor_model_parallel`` / ``partition_dim`` /
   ``partition_stride`` on the parameter, the owning module's class name (Bridge's module-type
   registry when Bridge is importable, plus the TE and local class names), the fused-QKV
   position (``*.linear_qkv``) and the gated-linear-unit config for ``linear_fc1``.

Names are published without wrapper prefixes (``module.`` from DDP / Float16Module), with
pipeline-global layer numbers (from each layer's ``layer_number``) and expert-parallel-global
expert ids (TE grouped ``weight{G}``, sequential ``local_experts.{G}``, legacy stacked 3-D expert
weights split into per-expert views). Tied output layers are skipped (the embedding is published
once). Nothing here copies or gathers: every ``ClassifiedParam.tensor`` is a view of the
parameter's own storage.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mx_refit.errors import ClassificationError
from mx_refit.megatron.parallel import ParallelContext, innermost_module, unwrap_model
from mx_refit.overrides import RoleOverride, RoleOverrides
from mx_refit.types import Role

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "BRIDGE_MAPPINGS_WITH_ROLES",
    "BridgeKind",
    "ClassificationError",
    "ClassifiedParam",
    "RoleOverride",
    "RoleOverrides",
    "classify_model",
    "role_shard_axis",
    "strip_wrapper_prefix",
    "unsupported_bridge_mappings",
]


# Shard axis of every split role (-1: whole tensor on every rank).
_ROLE_AXIS: dict[Role, int] = {
    Role.REPLICATED: -1,
    Role.COLUMN: 0,
    Role.ROW: 1,
    Role.VOCAB_PARALLEL: 0,
    Role.QKV_COLUMN: 0,
    Role.GATED_MLP_COLUMN: 0,
    Role.EXPERT_COLUMN: 0,
    Role.EXPERT_ROW: 1,
}
_EXPERT_ROLES = frozenset({Role.EXPERT_COLUMN, Role.EXPERT_ROW})

# Module classes by parallelism, used when a parameter carries no Megatron TP attributes.
# Mirrors Megatron-Bridge's AutoMapping registry (merged in at runtime when Bridge imports).
_CLASS_KINDS: dict[str, frozenset[str]] = {
    "column": frozenset({
        "ColumnParallelLinear", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear",
        "TEColumnParallelGroupedLinear", "VocabParallelEmbedding", "QuantColumnParallelLinear",
        "InferenceLayerNormColumnParallelLinear", "InferenceColumnParallelLinear",
        "LinearCrossEntropyModule",
    }),
    "row": frozenset({
        "RowParallelLinear", "TERowParallelLinear", "TERowParallelGroupedLinear",
        "QuantRowParallelLinear", "InferenceRowParallelLinear",
    }),
    "replicated": frozenset({
        "TENorm", "FusedLayerNorm", "WrappedTorchNorm", "LayerNorm", "RMSNorm", "L2Norm",
        "TopKRouter", "InferenceTopKRouter", "IdentityOp", "LinearForLastLayer",
    }),
}

_LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)\.")
_LOCAL_EXPERT_RE = re.compile(r"\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT_RE = re.compile(r"\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_STACKED_EXPERT_RE = re.compile(r"\.experts\.(linear_fc[12])\.(weight|bias)$")
_LEGACY_GROUPED_RE = re.compile(r"\.experts\.weight[12]$")


def role_shard_axis(role: Role) -> int:
    """The axis a role splits (``-1`` for replicated)."""
    return _ROLE_AXIS[Role(role)]


def strip_wrapper_prefix(name: str) -> str:
    """``module.module.decoder.x`` -> ``decoder.x`` (DDP / Float16Module wrappers)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class BridgeKind:
    """What Megatron-Bridge says about one (global) parameter: its mapping class and, for
    ``AutoMapping``, the detected parallelism (``column`` / ``row`` / ``replicated``)."""

    mapping: str
    detected: str | None = None


@dataclass
class ClassifiedParam:
    """One publishable native shard: a view of a parameter plus its layout."""

    name: str  # published: unwrapped, PP-global layer, EP-global expert id
    raw_name: str  # as the model's named_parameters() yields it
    tensor: torch.Tensor  # shares the parameter's storage
    role: Role
    shard_axis: int
    shard_offset: int
    global_shape: tuple[int, ...]
    extras: dict[str, Any] = field(default_factory=dict)
    module_class: str = ""
    decided_by: str = ""  # "override" | "bridge" | "megatron"
    mapping: str | None = None  # the Bridge mapping class, when known


# ----------------------------------------------------------------------------- detection


def _module_kinds() -> dict[str, frozenset[str]]:
    """Class-name registry: ours, extended by Bridge's AutoMapping registry when importable."""
    kinds = dict(_CLASS_KINDS)
    try:
        from mx_refit.megatron._bridge_import import import_bridge

        import_bridge()
        from megatron.bridge.models.conversion.param_mapping import AutoMapping
    except ImportError:
        return kinds
    for kind, names in AutoMapping._MODULE_TYPE_REGISTRY.items():  # noqa: SLF001 (public via register_module_type)
        if kind in kinds:
            kinds[kind] = kinds[kind] | frozenset(names)
    return kinds


def _is_vocab(module_class: str, module_path: str) -> bool:
    # The word embedding and the model-level output projection carry the (padded) vocabulary.
    return module_class == "VocabParallelEmbedding" or module_path == "output_layer"


def _is_gated_fc1(param: Any, module: Any) -> bool:
    if getattr(param, "partition_stride", 1) == 2:  # megatron builds SwiGLU fc1 with stride 2
        return True
    return bool(getattr(getattr(module, "config", None), "gated_linear_unit", False))


# Megatron-Bridge mapping classes (by name) that ``_role_from_bridge`` gives a role without
# parallelism detection; AutoMapping and its subclasses are decided by their detected kind.
BRIDGE_MAPPINGS_WITH_ROLES = frozenset({
    "QKVMapping", "GatedMLPMapping", "FusedGatedExpertMapping", "ReplicatedMapping", "DirectMapping",
    "ColumnParallelMapping", "RowParallelMapping",
})


def unsupported_bridge_mappings(tasks: Any) -> dict[str, list[str]]:
    """``{mapping class: [Megatron parameter names]}`` of Bridge conversion tasks that the
    classifier has no role for (Bridge 0.7's GDN, Mamba and QKVG mappings, a new model's own).

    Every task counts, those of other pipeline stages included, so every rank that holds the
    same task list reaches the same answer without touching a parameter. Pure: no collective,
    no export. Role overrides are not consulted (a caller that registered some may still
    classify such a model).
    """
    unsupported: dict[str, list[str]] = {}
    for task in tasks or ():
        mapping = getattr(task, "mapping", None)
        if mapping is None:
            continue
        name = type(mapping).__name__
        if name in BRIDGE_MAPPINGS_WITH_ROLES or hasattr(mapping, "_detect_parallelism_type"):
            continue
        param = getattr(task, "global_param_name", None) or getattr(mapping, "megatron_param", "?")
        unsupported.setdefault(name, []).append(strip_wrapper_prefix(str(param)))
    return unsupported


def _role_from_bridge(kind: BridgeKind, *, ndim: int, is_expert: bool, module_class: str,
                      module_path: str, name: str) -> Role:
    mapping, detected = kind.mapping, kind.detected
    if mapping in ("QKVMapping",):
        return Role.QKV_COLUMN
    if mapping in ("GatedMLPMapping", "FusedGatedExpertMapping"):
        return Role.EXPERT_COLUMN if is_expert else Role.GATED_MLP_COLUMN
    if mapping in ("ReplicatedMapping", "DirectMapping"):
        return Role.REPLICATED
    if mapping == "ColumnParallelMapping" or detected == "column":
        if is_expert:
            return Role.EXPERT_COLUMN
        return Role.VOCAB_PARALLEL if _is_vocab(module_class, module_path) else Role.COLUMN
    if mapping == "RowParallelMapping" or detected == "row":
        if ndim < 2:
            return Role.REPLICATED  # a row-parallel layer's bias is added after the all-reduce
        return Role.EXPERT_ROW if is_expert else Role.ROW
    if detected == "replicated":
        return Role.REPLICATED
    raise ClassificationError(
        f"{name}: Megatron-Bridge mapping {mapping!r} has no mx-refit role; register a role "
        "override (pattern or module class) for it"
    )


def _role_from_megatron(param: Any, module: Any, *, leaf: str, is_expert: bool, module_class: str,
                        module_path: str, kinds: Mapping[str, frozenset[str]], name: str) -> Role:
    if "LayerNormColumnParallelLinear" in module_class and leaf.startswith("layer_norm_"):
        return Role.REPLICATED  # TE fuses the preceding norm into the column-parallel linear
    if is_expert and module_path.endswith(("linear_fc1", "linear_fc2")):
        # An expert's fc1 is its fused [gate; up] (column), its fc2 the down projection (row).
        if module_path.endswith("linear_fc1"):
            return Role.EXPERT_COLUMN
        return Role.EXPERT_ROW if param.dim() >= 2 else Role.REPLICATED
    if hasattr(param, "tensor_model_parallel"):
        kind = "replicated"
        if param.tensor_model_parallel:
            kind = {0: "column", 1: "row"}.get(getattr(param, "partition_dim", -1), "")
            if not kind:
                raise ClassificationError(
                    f"{name}: tensor_model_parallel=True with partition_dim="
                    f"{getattr(param, 'partition_dim', None)!r}; register a role override"
                )
    elif module_class in kinds["column"]:
        kind = "column"
    elif module_class in kinds["row"]:
        kind = "row" if param.dim() >= 2 else "replicated"
    elif module_class in kinds["replicated"] or "Norm" in module_class:
        kind = "replicated"
    else:
        raise ClassificationError(
            f"{name}: module class {module_class!r} carries no tensor-parallel attributes and is "
            "not a known Megatron class; register a role override for it"
        )
    if kind == "replicated":
        return Role.REPLICATED
    if kind == "row":
        return Role.EXPERT_ROW if is_expert else Role.ROW
    if module_path.endswith("linear_qkv"):
        return Role.QKV_COLUMN
    if module_path.endswith("linear_fc1") and _is_gated_fc1(param, module):
        return Role.EXPERT_COLUMN if is_expert else Role.GATED_MLP_COLUMN
    if is_expert:
        return Role.EXPERT_COLUMN
    return Role.VOCAB_PARALLEL if _is_vocab(module_class, module_path) else Role.COLUMN


# ----------------------------------------------------------------------------- naming


def _global_layer_name(name: str, raw_name: str, modules: Mapping[str, Any], ctx: ParallelContext) -> str:
    match = _LAYER_RE.search(name)
    if match is None:
        return name
    local = int(match.group(2))
    raw_prefix = raw_name[: len(raw_name) - len(name)] + name[: match.end() - 1]
    layer = modules.get(raw_prefix)
    layer_number = getattr(layer, "layer_number", None)
    if isinstance(layer_number, int) and layer_number >= 1:
        global_index = layer_number - 1  # Megatron numbers layers from 1, globally across stages
    elif ctx.pp_size == 1:
        global_index = local
    else:
        raise ClassificationError(
            f"{raw_name}: layer module {raw_prefix!r} has no layer_number; cannot make the layer "
            f"index pipeline-global (pp_size={ctx.pp_size})"
        )
    start, end = match.start(2), match.end(2)
    return f"{name[:start]}{global_index}{name[end:]}"


def _expert_offset(raw_name: str, modules: Mapping[str, Any], ctx: ParallelContext, config: Any) -> int:
    """Global id of this rank's local expert 0."""
    moe_path = raw_name[: raw_name.index(".experts.")]
    moe = modules.get(moe_path)
    indices = getattr(moe, "local_expert_indices", None)
    if indices:
        return int(indices[0])
    experts = modules.get(moe_path + ".experts")
    per_rank = getattr(experts, "num_local_experts", None)
    if per_rank is None:
        total = getattr(config, "num_moe_experts", None)
        if not total:
            raise ClassificationError(f"{raw_name}: cannot tell how many experts each EP rank holds")
        per_rank = total // ctx.ep_size
    return ctx.ep_rank * int(per_rank)


# ----------------------------------------------------------------------------- driver


def _expand_experts(name: str, raw_name: str, param: Any, modules: Mapping[str, Any],
                    ctx: ParallelContext, config: Any) -> list[tuple[str, Any, int | None]]:
    """(published name, tensor view, global expert id or None) for one parameter."""
    if ".experts." not in name or ".adapter." in name:
        return [(name, param.detach(), None)]
    if _LEGACY_GROUPED_RE.search(name):
        raise ClassificationError(
            f"{raw_name}: legacy GroupedMLP weights interleave experts along the columns of a "
            "transposed matrix, so no expert is contiguous; publish with TEGroupedMLP or SequentialMLP"
        )
    offset = _expert_offset(raw_name, modules, ctx, config)
    match = _LOCAL_EXPERT_RE.search(name)
    if match:
        global_id = offset + int(match.group(1))
        published = f"{name[:match.start(1)]}{global_id}{name[match.end(1):]}"
        return [(published, param.detach(), global_id)]
    match = _GROUPED_EXPERT_RE.search(name)
    if match:
        global_id = offset + int(match.group(3))
        return [(f"{name[:match.start(3)]}{global_id}", param.detach(), global_id)]
    match = _STACKED_EXPERT_RE.search(name)
    if match and param.dim() == 3:
        # Legacy stacked experts [E_local, out, in]: each expert is a contiguous slice of dim 0;
        # publish it under the grouped name with its global id, as a view (no copy).
        return [(f"{name}{offset + e}", param.detach()[e], offset + e) for e in range(param.shape[0])]
    raise ClassificationError(
        f"{raw_name}: expert parameter with an unrecognised layout {tuple(param.shape)}; "
        "register a role override"
    )


def classify_model(
    model: Any,
    *,
    overrides: RoleOverrides | None = None,
    bridge_kinds: Mapping[str, BridgeKind] | None = None,
    ctx: ParallelContext | None = None,
) -> list[ClassifiedParam]:
    """Classify every parameter of ``model`` (a module or a list of virtual-pipeline chunks).

    ``bridge_kinds`` maps published names to Bridge mapping kinds (see
    ``mx_refit.megatron.sidecar.bridge_mapping_kinds``); parameters it does not cover fall back to
    Megatron-Core attributes. ``ctx`` defaults to ``ParallelContext.from_parallel_state()``.
    """
    ctx = ctx or ParallelContext.from_parallel_state()
    overrides = overrides or RoleOverrides()
    bridge_kinds = bridge_kinds or {}
    kinds = _module_kinds()
    results: list[ClassifiedParam] = []
    seen: dict[str, str] = {}
    for chunk in unwrap_model(model):
        inner = innermost_module(chunk)
        config = getattr(inner, "config", None)
        tied = bool(getattr(inner, "share_embeddings_and_output_weights", False))
        modules = dict(chunk.named_modules())
        for raw_name, param in chunk.named_parameters():
            name = strip_wrapper_prefix(raw_name)
            if tied and name.startswith("output_layer."):
                continue  # the tied output layer is the embedding, published once
            raw_module_path, _, leaf = raw_name.rpartition(".")
            module = modules.get(raw_module_path)
            module_class = type(module).__name__
            module_path = strip_wrapper_prefix(raw_module_path)
            name = _global_layer_name(name, raw_name, modules, ctx)
            for published, tensor, expert_id in _expand_experts(name, raw_name, param, modules, ctx, config):
                if published in seen:
                    raise ClassificationError(
                        f"{raw_name}: published name {published!r} already used by {seen[published]!r}"
                    )
                seen[published] = raw_name
                results.append(_classify_one(
                    published, raw_name, tensor, param, module, module_class, module_path, leaf,
                    expert_id, overrides, bridge_kinds, kinds, ctx,
                ))
    return results


def _classify_one(name: str, raw_name: str, tensor: Any, param: Any, module: Any, module_class: str,
                  module_path: str, leaf: str, expert_id: int | None, overrides: RoleOverrides,
                  bridge_kinds: Mapping[str, BridgeKind], kinds: Mapping[str, frozenset[str]],
                  ctx: ParallelContext) -> ClassifiedParam:
    is_expert = expert_id is not None
    bridge_kind = bridge_kinds.get(name)
    override = overrides.lookup(name, module_class)
    shard_axis: int | None = None
    if override is not None:
        role, decided_by, shard_axis = override.role, "override", override.shard_axis
    elif bridge_kind is not None:
        role = _role_from_bridge(bridge_kind, ndim=tensor.dim(), is_expert=is_expert,
                                 module_class=module_class, module_path=module_path, name=name)
        decided_by = "bridge"
    else:
        role = _role_from_megatron(param, module, leaf=leaf, is_expert=is_expert,
                                   module_class=module_class, module_path=module_path,
                                   kinds=kinds, name=name)
        decided_by = "megatron"
    if shard_axis is None:
        shard_axis = _ROLE_AXIS[role]
    if shard_axis >= tensor.dim():
        # A 1-D tensor of a dim-1 role (e.g. an override on a bias) cannot be split on dim 1.
        raise ClassificationError(
            f"{name}: role {role.value!r} splits axis {shard_axis} but the tensor is "
            f"{tensor.dim()}-D {tuple(tensor.shape)}"
        )
    extras: dict[str, Any] = {}
    if is_expert:
        extras["expert_id"] = expert_id
    global_shape = tuple(int(s) for s in tensor.shape)
    offset = 0
    if shard_axis >= 0:
        rank, size = (ctx.etp_rank, ctx.etp_size) if is_expert else (ctx.tp_rank, ctx.tp_size)
        local = global_shape[shard_axis]
        global_shape = global_shape[:shard_axis] + (local * size,) + global_shape[shard_axis + 1:]
        offset = rank * local
        extras.update(tp_rank=rank, tp_size=size)
    return ClassifiedParam(
        name=name, raw_name=raw_name, tensor=tensor, role=role, shard_axis=shard_axis,
        shard_offset=offset, global_shape=global_shape, extras=extras, module_class=module_class,
        decided_by=decided_by, mapping=bridge_kind.mapping if bridge_kind else None,
    )
