"""Where each HF tensor's rank-local slice lands in a vLLM model's parameters, read from vLLM.

vLLM 0.33's weight loaders take *full* HF tensors and narrow them to the rank's slice. To pull
only this rank's bytes, the worker must know, for every HF tensor, which window of it the rank
holds and where that window sits in the (possibly fused) parameter. That knowledge is read here
from vLLM itself, never from a table per model:

* the HF -> parameter name: the model's ``hf_to_vllm_mapper`` and ``packed_modules_mapping``
  (``q_proj`` -> ``qkv_proj`` shard ``q``; ``gate_proj`` -> ``gate_up_proj`` shard 0), the same
  data vLLM's ``load_weights`` stacks with;
* the window and the place in the parameter: the layer's own partition metadata, exactly as
  its ``weight_loader`` computes them: ``QKVParallelLinear`` (``num_heads``, ``num_kv_heads``,
  ``head_size``, ``num_kv_head_replicas``, ``tp_rank``), ``MergedColumnParallelLinear``
  (``output_sizes``), ``ColumnParallelLinear`` (``output_size_per_partition``),
  ``RowParallelLinear`` (``input_size_per_partition``), ``VocabParallelEmbedding`` /
  ``ParallelLMHead`` (``shard_indices``; padding rows are zeroed as vLLM does), and parameters
  without ``output_dim``/``input_dim`` (norms, row-layer biases) whole;
* the windows the core planner yields for ``TargetLayout(full_tensors=False)`` follow the same
  conventions (:func:`planner_vocab_window` repeats its vocabulary rule); a layer whose vLLM
  metadata disagrees with them is *unproven*.

Fused-MoE experts (``w13_weight``/``w2_weight`` stacks) are placed by :mod:`mx_refit_vllm.moe`
from the module's own expert mapping, expert map and ``weight_loader`` rules.

A module is placeable only when writing the bytes into its parameters is all vLLM's loader
would do: no quantization method other than the unquantized ones, and no post-load repacking
already applied (vLLM's CPU GEMM dispatch packs weights into ``cpu_linear``). Everything else
(quantized layers or experts, added vocabulary, unknown layer classes) is unproven: the
worker asks for those tensors whole (``TargetLayout.whole_prefixes``) and vLLM's own
``load_weights`` loads them, with one warning naming each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mx_refit_vllm.moe import ExpertIndex, is_fused_moe, moe_problem

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ParamMap", "Placement", "planner_vocab_window"]

log = logging.getLogger(__name__)

VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE, the core planner's vocabulary rule
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}
_PLACEABLE_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


def planner_vocab_window(
    vocab: int, tp_size: int, tp_rank: int, padding: int = VLLM_VOCAB_PADDING
) -> tuple[int, int]:
    """The vocabulary rows the core planner sends a TP rank (``mx_refit.layout.bands``)."""
    padded = -(-vocab // padding) * padding
    per = -(-padded // tp_size)
    lo = min(tp_rank * per, vocab)
    return lo, min(lo + per, vocab)


@dataclass(frozen=True)
class Placement:
    """One HF tensor's rank-local window and where it lands.

    ``src``: ``(dim, lo, hi)`` of the HF tensor this rank receives (``None``: whole).
    ``dst``: ``(dim, offset, length)`` of the parameter it fills (``None``: the whole parameter).
    ``zero_rows_from``: rows of the parameter from here on are vocabulary padding (zeroed).
    ``expert``: the row of a stacked fused-MoE parameter (``src``/``dst`` are then within it).
    """

    hf_name: str
    param_name: str
    param: Any  # the live torch.nn.Parameter, captured before any layerwise reload
    src: tuple[int, int, int] | None
    dst: tuple[int, int, int] | None
    zero_rows_from: int | None = None
    expert: int | None = None

    def window_shape(self) -> tuple[int, ...]:
        """The shape of the tensor the planner sends for this placement."""
        shape = list(self.param.shape if self.expert is None else self.param.shape[1:])
        if self.dst is not None:
            dim, _, length = self.dst
            shape[dim] = length
        if self.zero_rows_from is not None:
            shape[0] = self.zero_rows_from
        return tuple(shape)

    def place(self, tensor: torch.Tensor) -> None:
        """Copy the received window into the parameter (and zero the vocabulary padding)."""
        data = self.param.data if self.expert is None else self.param.data[self.expert]
        if self.zero_rows_from is not None:
            data[: self.zero_rows_from].copy_(tensor)
            data[self.zero_rows_from :].zero_()
            return
        if self.dst is not None:
            dim, offset, length = self.dst
            data = data.narrow(dim, offset, length)
        data.copy_(tensor)

    def write_rows(self, first: int, rows: torch.Tensor) -> None:
        """Copy rows ``first ..`` (dim 0) of the window into the parameter: ``receive_mode:
        direct`` places a window too large for its buffer in pieces (the vocabulary padding is
        zeroed with the last piece)."""
        data = self.param.data if self.expert is None else self.param.data[self.expert]
        end = first + rows.shape[0]
        if self.zero_rows_from is not None:
            data[first:end].copy_(rows)
            if end == self.zero_rows_from:
                data[self.zero_rows_from :].zero_()
            return
        if self.dst is not None:
            dim, offset, length = self.dst
            data = data.narrow(dim, offset, length)
        data.narrow(0, first, rows.shape[0]).copy_(rows)


class ParamMap:
    """HF name -> :class:`Placement` for one vLLM worker's model (see module docs)."""

    def __init__(self, model: torch.nn.Module, tp_rank: int, tp_size: int, ep_size: int = 1) -> None:
        self.model = model
        self.tp_rank, self.tp_size, self.ep_size = tp_rank, tp_size, ep_size
        self.params: dict[str, Any] = dict(model.named_parameters(remove_duplicate=False))
        self.modules: dict[str, Any] = dict(model.named_modules(remove_duplicate=False))
        packed = getattr(model, "packed_modules_mapping", None) or {}
        self.packed: list[tuple[str, str, int]] = [
            (sub, fused, i) for fused, subs in packed.items() for i, sub in enumerate(subs) if sub != fused
        ]
        self.mapper = getattr(model, "hf_to_vllm_mapper", None)
        self.tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        # Module prefix -> why its parameters cannot be placed (checked once per module).
        self.unproven: dict[str, str] = {}
        for prefix, module in self.modules.items():
            why = self._module_problem(module)
            if why is not None and any(True for _ in module.parameters(recurse=False)):
                self.unproven[prefix] = why
        # Fused-MoE layer name (the HF prefix of its experts) -> (module prefix, expert index).
        self.moe: dict[str, tuple[str, ExpertIndex]] = {
            m.layer_name: (prefix, ExpertIndex(m))
            for prefix, m in self.modules.items()
            if is_fused_moe(m) and prefix not in self.unproven
            and isinstance(getattr(m, "layer_name", None), str)
        }

    # -- which modules are placeable -------------------------------------------------------
    def _module_problem(self, module: Any) -> str | None:
        from vllm.model_executor.layers.linear import (
            ColumnParallelLinear,
            ReplicatedLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        if is_fused_moe(module):
            return moe_problem(module, self.tp_size, self.ep_size)
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in _PLACEABLE_METHODS:
            return f"{type(method).__name__} (post-load processing the planner cannot reproduce)"
        linear = getattr(module, "cpu_linear", None)
        if linear is not None and getattr(linear, "__name__", "") != "linear":
            return "weights repacked after loading (vLLM's CPU GEMM dispatch)"
        if isinstance(module, VocabParallelEmbedding):
            idx = module.shard_indices
            if idx.num_added_elements_padded or module.padding_size != VLLM_VOCAB_PADDING:
                return "added vocabulary or a non-default vocabulary padding"
            lo, hi = planner_vocab_window(module.org_vocab_size, self.tp_size, self.tp_rank)
            if (idx.org_vocab_start_index, idx.org_vocab_end_index) != (lo, hi):
                have = f"{idx.org_vocab_start_index}:{idx.org_vocab_end_index}"
                return f"vocabulary shard {have} != the planner's {lo}:{hi}"
            return None
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
            tp = getattr(module, "tp_size", self.tp_size)
            if tp not in (1, self.tp_size):
                return f"layer TP size {tp} != worker TP size {self.tp_size}"
            return None
        has_dims = any(
            getattr(p, "output_dim", None) is not None or getattr(p, "input_dim", None) is not None
            for p in module.parameters(recurse=False)
        )
        if has_dims or method is not None:
            return f"{type(module).__name__}: a layer kind whose sharding this worker does not derive"
        return None  # plain parameters (norms): replicated, loaded whole

    # -- name resolution -------------------------------------------------------------------
    @property
    def renames(self) -> bool:
        """Whether the model's ``hf_to_vllm_mapper`` renames more than stacked sub-modules."""
        m = self.mapper
        if m is None:
            return False
        kinds = ("orig_to_new_renaming", "orig_to_new_regex", "orig_to_new_substr", "orig_to_new_prefix",
                 "orig_to_new_suffix")
        known = hasattr(m, "orig_to_new_stacked")
        return not known or any(getattr(m, kind, None) for kind in kinds)

    def _mapped(self, name: str) -> tuple[str, Any] | None:
        """vLLM's own mapping of an HF name: ``(name, stacked shard id or None)``, or ``None``
        (the model drops it)."""
        if self.mapper is None:
            return name, None
        with_shard = getattr(self.mapper, "_map_name_with_shard", None)
        if with_shard is not None:
            return with_shard(name)  # type: ignore[no-any-return]
        map_name = getattr(self.mapper, "map_name", None) or getattr(self.mapper, "_map_name", None)
        mapped = map_name(name) if map_name is not None else name
        return None if mapped is None else (mapped, None)

    def resolve(self, hf_name: str) -> tuple[str, int | None] | None:
        """``(vLLM parameter name, packed shard index or None)`` for an HF name, or ``None``."""
        got = self._mapped(hf_name)
        if got is None:
            return None
        mapped, shard_id = got
        if mapped in self.params:
            if shard_id is None:
                return mapped, None
            index = _QKV_SHARDS.get(shard_id) if isinstance(shard_id, str) else shard_id
            return (mapped, index) if isinstance(index, int) else None
        for sub, fused, index in self.packed:
            token = f".{sub}."
            if token in f".{mapped}":
                candidate = f".{mapped}".replace(token, f".{fused}.", 1)[1:]
                if candidate in self.params:
                    return candidate, index
        return None

    def owner(self, param_name: str) -> tuple[str, Any]:
        prefix = param_name.rpartition(".")[0]
        return prefix, self.modules.get(prefix)

    def whole_prefixes(self) -> tuple[str, ...]:
        """HF-name prefixes of every unproven module (received whole, loaded by vLLM): the
        module's own name and, for a fused module, its packed sub-modules' names."""
        prefixes = set()
        for prefix in self.unproven:
            if not prefix:
                continue
            prefixes.add(f"{prefix}.")
            layer = getattr(self.modules.get(prefix), "layer_name", None)
            if is_fused_moe(self.modules.get(prefix)) and isinstance(layer, str):
                prefixes.add(f"{layer}.")  # HF expert names hang off the layer, not the module
            parent, _, leaf = prefix.rpartition(".")
            for sub, fused, _ in self.packed:
                if leaf == fused:
                    prefixes.add(f"{parent}.{sub}." if parent else f"{sub}.")
        return tuple(sorted(prefixes))

    # -- the placement -----------------------------------------------------------------------
    def placement(self, hf_name: str) -> Placement | None:
        """Where ``hf_name``'s rank-local window lands, or ``None`` (vLLM's loader handles it:
        unproven module, tied or dropped name, a name the model does not have)."""
        if self.tied and hf_name.startswith("lm_head."):
            return None  # vLLM skips it: the embedding is the head
        if self.moe:
            expert = self._expert_placement(hf_name)
            if expert is not None:
                return expert
        resolved = self.resolve(hf_name)
        if resolved is None:
            return None
        param_name, shard = resolved
        prefix, module = self.owner(param_name)
        if prefix in self.unproven or module is None:
            return None
        param = self.params[param_name]
        return self._place(hf_name, param_name, param, module, shard)

    def _expert_placement(self, hf_name: str) -> Placement | None:
        """A fused-MoE expert tensor's placement (this rank's experts only), or ``None``."""
        cut = hf_name.find(".")
        while cut > 0:
            hit = self.moe.get(hf_name[:cut])
            if hit is not None:
                prefix, index = hit
                found = index.find(hf_name)
                if found is None:
                    return None
                attr, local, src, dst = found
                param_name = f"{prefix}.{attr}"
                return Placement(hf_name, param_name, self.params[param_name], src, dst, expert=local)
            cut = hf_name.find(".", cut + 1)
        return None

    def _place(
        self, hf_name: str, param_name: str, param: Any, module: Any, shard: int | None
    ) -> Placement | None:
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            QKVParallelLinear,
            ReplicatedLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        out_dim = getattr(param, "output_dim", None)
        in_dim = getattr(param, "input_dim", None)
        rank = self.tp_rank
        if isinstance(module, VocabParallelEmbedding) and out_dim is not None:
            idx = module.shard_indices
            n = idx.org_vocab_end_index - idx.org_vocab_start_index
            src = (0, idx.org_vocab_start_index, idx.org_vocab_end_index)
            return Placement(hf_name, param_name, param, src, (0, 0, n), zero_rows_from=n)
        if isinstance(module, QKVParallelLinear) and out_dim is not None:
            if shard is None:
                return None  # a fused checkpoint tensor: vLLM's loader splits it
            sizes = [module.num_heads * module.head_size, module.num_kv_heads * module.head_size,
                     module.num_kv_heads * module.v_head_size]
            offset = sum(sizes[:shard])
            shard_rank = rank if shard == 0 else rank // module.num_kv_head_replicas
            lo = shard_rank * sizes[shard]
            return Placement(hf_name, param_name, param, (out_dim, lo, lo + sizes[shard]),
                             (out_dim, offset, sizes[shard]))
        if isinstance(module, MergedColumnParallelLinear) and out_dim is not None:
            if shard is None:
                return None
            tp = module.tp_size
            sizes = [s // tp for s in module.output_sizes]
            offset = sum(sizes[:shard])
            lo = module.tp_rank * sizes[shard]
            return Placement(hf_name, param_name, param, (out_dim, lo, lo + sizes[shard]),
                             (out_dim, offset, sizes[shard]))
        if shard is not None:
            return None  # packed into a layer kind not derived here
        if isinstance(module, ReplicatedLinear):  # e.g. a MoE router (GateLinear): every rank whole
            return Placement(hf_name, param_name, param, None, None)
        if isinstance(module, RowParallelLinear) and in_dim is not None:
            n = module.input_size_per_partition
            lo = module.tp_rank * n
            return Placement(hf_name, param_name, param, (in_dim, lo, lo + n), None)
        if out_dim is not None and hasattr(module, "output_size_per_partition"):
            n = module.output_size_per_partition
            lo = getattr(module, "tp_rank", rank) * n
            return Placement(hf_name, param_name, param, (out_dim, lo, lo + n), None)
        if out_dim is None and in_dim is None:
            return Placement(hf_name, param_name, param, None, None)  # replicated: whole
        return None

    # -- loading -----------------------------------------------------------------------------
    def row_writers(self, tensors: list[tuple[str, tuple[int, ...], str]]) -> dict[str, Any]:
        """``receive_mode: direct``: a row writer (:meth:`Placement.write_rows`) for every
        tensor that is a placeable rank window of exactly its shape; the rest go whole to
        :meth:`place` and vLLM's loader."""
        writers = {}
        for name, shape, _ in tensors:
            where = self.placement(name)
            if where is not None and tuple(shape) == where.window_shape() and len(shape) > 0:
                writers[name] = where.write_rows
        return writers

    def place(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Copy every received rank-local window into its parameter.

        Returns ``(bytes placed, the rest)``: tensors with no placement, or whose shape is not
        the rank window (whole tensors from a source whose plan ignores the layout), for
        vLLM's ``load_weights``. A dtype differing from the parameter's is cast by the copy, as
        vLLM's loaders do.
        """
        placed: list[tuple[Placement, torch.Tensor]] = []
        rest: list[tuple[str, torch.Tensor]] = []
        for name, tensor in tensors:
            where = self.placement(name)
            if where is None or tuple(tensor.shape) != where.window_shape():
                rest.append((name, tensor))
                continue
            placed.append((where, tensor))
        moved = 0
        for where, tensor in placed:
            where.place(tensor)
            moved += tensor.numel() * tensor.element_size()
        return moved, rest
