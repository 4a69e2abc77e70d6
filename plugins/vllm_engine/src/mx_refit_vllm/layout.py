"""What a vLLM worker needs: its target layout, and which received tensors its model accepts.

vLLM 0.33's weight loaders take *full* HF tensors and narrow them to the rank's slice themselves
(``parameter.py``: ``load_column_parallel_weight`` & co. narrow at ``tp_rank * shard_size``
unconditionally). A worker therefore asks for this rank's windows only where
:mod:`mx_refit_vllm.params` can place them into the parameters itself (``full_tensors=False``
with ``whole_prefixes`` naming the modules it cannot), and whole HF tensors otherwise.
Expert parallelism is announced only when vLLM places experts linearly without EPLB
redundancy, the one placement a planner can predict; otherwise every expert is pulled and
vLLM's MoE loader keeps its own.

:func:`check_names` runs before any weight is touched: vLLM's ``load_weights`` raises (KeyError,
shape asserts) in the middle of a load when handed a tensor the model does not have, which
would leave a half-loaded model. Checking first turns that into a clean refusal.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from mx_refit.errors import InvalidArgument
from mx_refit.types import TargetLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["NameCheck", "check_names", "compile_form", "target_layout", "worker_coordinates"]


# HF tensors that vLLM models drop on purpose (recomputed or unused at inference).
_IGNORED = re.compile(r"(^|\.)(rotary_emb\.inv_freq|rotary_emb\.cos_cached|rotary_emb\.sin_cached)$")
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.")


def worker_coordinates(parallel_config: Any) -> dict[str, int]:
    """This worker's TP/PP/DP/EP coordinates, read from vLLM's initialised process groups.

    Falls back to the parallel config (single rank per axis) when the groups are not initialised,
    which is only legitimate for a TP=PP=1 worker.
    """
    tp_size = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    coords = {
        "tp_rank": 0,
        "tp_size": tp_size,
        "pp_rank": 0,
        "pp_size": pp_size,
        "dp_index": int(getattr(parallel_config, "data_parallel_index", 0) or 0),
        "ep_rank": 0,
        "ep_size": 1,
    }
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        if tp_size * pp_size > 1:
            raise RuntimeError(
                f"vLLM's model-parallel groups are not initialised, but the parallel config says "
                f"TP={tp_size} x PP={pp_size}; the mx engine must be created inside a vLLM worker"
            )
        return coords
    tp = ps.get_tp_group()
    pp = ps.get_pp_group()
    coords.update(
        tp_rank=tp.rank_in_group, tp_size=tp.world_size, pp_rank=pp.rank_in_group, pp_size=pp.world_size
    )
    if (
        getattr(parallel_config, "enable_expert_parallel", False)
        and not getattr(parallel_config, "enable_eplb", False)
        and getattr(parallel_config, "expert_placement_strategy", "linear") == "linear"
        and getattr(ps, "_EP", None) is not None
    ):
        ep = ps.get_ep_group()
        coords.update(ep_rank=ep.rank_in_group, ep_size=ep.world_size)
    return coords


def compile_form(quant_config: Any) -> tuple[tuple[str, ...], dict[str, str]]:
    """The compile targets (and required metadata) an engine with ``quant_config`` loads as is.

    A block-FP8 checkpoint engine (``Fp8Config`` with ``is_checkpoint_fp8_serialized`` and
    ``weight_block_size`` [128, 128]) loads ``weight`` + ``weight_scale_inv`` with no requantisation:
    it asks for ``fp8_block``. An FP8 engine of another form (per-tensor scales, other blocks) asks
    for a form no publisher offers, so discovery refuses instead of casting BF16 bytes into FP8
    parameters. Anything else (no quantisation, vLLM's online FP8 configs, which quantise BF16
    themselves at load) keeps ``hf_raw``."""
    if quant_config is None or type(quant_config).__name__ != "Fp8Config":
        return ("hf_raw",), {}
    if not getattr(quant_config, "is_checkpoint_fp8_serialized", False):
        return ("hf_raw",), {}
    block = list(getattr(quant_config, "weight_block_size", None) or [])
    if len(block) == 2:
        return ("fp8_block",), {"block_size": f"{block[0]},{block[1]}"}
    return ("fp8_tensor",), {}


def target_layout(
    parallel_config: Any, quant_config: Any = None, whole_prefixes: tuple[str, ...] | None = None
) -> TargetLayout:
    """The :class:`~mx_refit.types.TargetLayout` of this vLLM worker, in the compile form its
    quantisation loads (see :func:`compile_form`).

    ``whole_prefixes=None``, or a compile form other than ``hf_raw``: whole HF tensors (vLLM's
    loaders narrow them). A tuple: this rank's windows only (``full_tensors=False``), except
    for HF names under those prefixes (modules :class:`~mx_refit_vllm.params.ParamMap` cannot
    place), which arrive whole.
    """
    c = worker_coordinates(parallel_config)
    targets, required = compile_form(quant_config)
    full = whole_prefixes is None or targets != ("hf_raw",)  # FP8 forms: whole tensors
    return TargetLayout(
        tp_rank=c["tp_rank"],
        tp_size=c["tp_size"],
        ep_rank=c["ep_rank"],
        ep_size=c["ep_size"],
        full_tensors=full,
        whole_prefixes=() if full or whole_prefixes is None else whole_prefixes,
        compile_targets=targets,
        required_metadata=required,  # type: ignore[arg-type]  # a dict is kept sorted as pairs
    )


class NameCheck:
    """Resolves HF tensor names against a vLLM model the way its ``load_weights`` will.

    A name is accepted when, after the model's ``hf_to_vllm_mapper`` (if any), it names a
    parameter or buffer directly, through the model's ``packed_modules_mapping`` (``q_proj`` ->
    ``qkv_proj``, ``gate_proj`` -> ``gate_up_proj``), as an expert of a fused-MoE module, as a
    tied ``lm_head``, or as a layer this pipeline stage does not hold. Shapes are checked where
    the mapping is one to one: every dimension must match the local parameter except the one
    vLLM shards, which may be up to ``tp_size`` times larger (vocab padding makes it smaller).
    """

    def __init__(self, model: torch.nn.Module, tp_size: int = 1) -> None:
        self.model = model
        self.tp_size = tp_size
        self.tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self.tensors.update(dict(model.named_buffers(remove_duplicate=False)))
        self.modules = dict(model.named_modules(remove_duplicate=False))
        packed = getattr(model, "packed_modules_mapping", None) or {}
        self.packed: list[tuple[str, str]] = [
            (sub, fused) for fused, subs in packed.items() for sub in subs if sub != fused
        ]
        self.mapper = getattr(model, "hf_to_vllm_mapper", None)
        config = getattr(getattr(model, "config", None), "tie_word_embeddings", None)
        self.tied = bool(config)

    def _mapped(self, name: str) -> str | None:
        if self.mapper is None:
            return name
        map_name = getattr(self.mapper, "map_name", None) or getattr(self.mapper, "_map_name", None)
        return map_name(name) if map_name is not None else name

    def _pp_missing(self, name: str) -> bool:
        try:
            from vllm.model_executor.models.utils import is_pp_missing_parameter
        except ImportError:  # pragma: no cover - vLLM without the helper
            return False
        try:
            return bool(is_pp_missing_parameter(name, self.model))
        except Exception:  # a model that does not follow vLLM's PP conventions
            return False

    def problem(self, name: str, shape: Sequence[int]) -> str | None:
        """``None`` if the model accepts ``name`` with ``shape``, else why not."""
        mapped = self._mapped(name)
        if mapped is None or _IGNORED.search(name):
            return None  # the model's mapper drops it on purpose
        if mapped in self.tensors:
            return self._shape_problem(mapped, shape, packed=False)
        for sub, fused in self.packed:
            token = f".{sub}."
            if token in f".{mapped}":
                candidate = f".{mapped}".replace(token, f".{fused}.", 1)[1:]
                if candidate in self.tensors:
                    return self._shape_problem(candidate, shape, packed=True)
        expert = _EXPERT.match(mapped)
        if expert and expert["prefix"] in self.modules:
            module = self.modules[expert["prefix"]]
            total = getattr(module, "global_num_experts", None) or getattr(module, "num_experts", None)
            if total is not None and int(expert["index"]) >= int(total):
                return f"expert {expert['index']} >= the model's {total} experts"
            return None
        if self.tied and mapped.startswith("lm_head."):
            return None
        if self._pp_missing(mapped):
            return None
        return "the model has no such parameter or buffer"

    def _sharded_dims(self, target: str, param: torch.Tensor) -> set[int]:
        owner = self.modules.get(target.rpartition(".")[0])
        return _sharded_dims_of(owner, param)

    def _shape_problem(self, target: str, shape: Sequence[int], *, packed: bool) -> str | None:
        param = self.tensors[target]
        if param.is_meta or not param.is_floating_point():
            return None  # quantized / placeholder storage: the loader knows its own layout
        got = tuple(int(d) for d in shape)
        have = tuple(int(d) for d in param.shape)
        if len(got) != len(have):
            return f"shape {got} does not fit {target} {have}"
        sharded = self._sharded_dims(target, param)
        for dim, (g, h) in enumerate(zip(got, have, strict=True)):
            if dim in sharded:
                if packed and dim == getattr(param, "output_dim", None):
                    continue  # one of several stacked shards: only its own extent is known
                if not 0 < g <= h * self.tp_size:
                    return f"shape {got} does not fit {target} {have} (dim {dim}, TP={self.tp_size})"
            elif g != h:
                return f"shape {got} does not fit {target} {have} (dim {dim})"
        return None


def _sharded_dims_of(module: Any, param: Any) -> set[int]:
    """The parameter dims vLLM's TP loader narrows for this layer kind."""
    output_dim: Any = getattr(param, "output_dim", None)
    input_dim: Any = getattr(param, "input_dim", None)
    try:
        from vllm.model_executor.layers.linear import (
            ColumnParallelLinear,
            ReplicatedLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    except ImportError:  # pragma: no cover - layer classes moved: fall back to lenient checks
        return {output_dim, input_dim} - {None}
    if isinstance(module, RowParallelLinear):
        return {input_dim} - {None}
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return {output_dim} - {None}
    if isinstance(module, ReplicatedLinear):
        return set()
    return {output_dim, input_dim} - {None}


def check_names(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], *, tp_size: int, what: str
) -> None:
    """Raise :class:`InvalidArgument` listing every tensor ``model`` would not accept."""
    check_shapes(model, ((name, tuple(tensor.shape)) for name, tensor in tensors), tp_size=tp_size, what=what)


def check_shapes(
    model: torch.nn.Module, shapes: Iterable[tuple[str, tuple[int, ...]]], *, tp_size: int, what: str
) -> None:
    """:func:`check_names` from ``(name, shape)`` pairs (before any byte has arrived)."""
    check = NameCheck(model, tp_size)
    problems = []
    for name, shape in shapes:
        why = check.problem(name, shape)
        if why is not None:
            problems.append(f"{name}: {why}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        raise InvalidArgument(
            f"{what} carries {len(problems)} tensor(s) that {type(model).__name__} does not have "
            f"(wrong model name?): {shown}"
        )
