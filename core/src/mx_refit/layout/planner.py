"""Plan a receive of Megatron-published native shards into a worker's HF target layout.

``plan_receive(version, target)`` turns a READY version's descriptors (each source rank's native
TP/PP/EP shards) plus the Megatron sidecar (transformer config and Megatron->HF name map) into a
:class:`MegatronReceivePlan` (the :class:`mx_refit.plan.ReceivePlan` contract):

* ``reads``: contiguous byte ranges, one source each, exactly the needed bytes whenever the
  layout allows a contiguous read (everything but a row-parallel column sub-block, where the
  transport's per-row-vs-hull cost model decides);
* an arena layout in which every HF tensor (or this worker's window of it) is contiguous, so
  ``materialize`` yields views of the arena; only staged row-parallel blocks are placed with one
  strided copy;
* a coverage gate: any needed byte no source provides raises one :class:`CoverageError` that lists
  every missing tensor and range; a partial plan is never returned.

Receiver windows (``full_tensors=False``) follow vLLM's TP sharding: q/k/v/gate/up and vocabulary
rows on dim 0 (k/v replicated per KV head when there are fewer KV heads than ranks), o_proj/
down_proj columns on dim 1, norms/router/biases of row layers whole. With target EP > 1 a worker
receives only its experts (linear placement) and receives them whole, as vLLM's expert-parallel
MoE sets expert TP to 1; with EP == 1 experts are TP-sliced like a dense MLP.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from mx_refit.errors import CoverageError, InvalidArgument
from mx_refit.layout.bands import (
    Window,
    gated_bands,
    identity_bands,
    kv_rows_window,
    qkv_bands,
    split_window,
    vocab_window,
)
from mx_refit.layout.templates import Template, columns_template, rows_template
from mx_refit.layout.translate import place_column_blocks
from mx_refit.types import DTYPE_SIZES, ReadOp, Role, TargetLayout, TensorDescriptor, VersionInfo

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "CONFIG_KEY",
    "HF_MAP_KEY",
    "MegatronConfig",
    "MegatronReceivePlan",
    "TensorSpec",
    "describe_plan",
    "plan_receive",
]

CONFIG_KEY = "megatron.config"
HF_MAP_KEY = "megatron.hf_map"
REGION_ALIGN = 16  # region alignment: dtype-safe views; small enough that packed sources stay adjacent
STICKY_BYTES = 64 << 20  # replica stickiness: long same-source runs coalesce into few descriptors

_EXPERT_ROLES = (Role.EXPERT_COLUMN, Role.EXPERT_ROW)
_VOCAB_SUFFIXES = ("word_embeddings.weight", "output_layer.weight")
_IDENTITY, _QKV, _GATED = 1, 3, 2  # transform kinds = number of HF outputs
_NAME = attrgetter("name")
_EXPECTED_OUTPUTS = {Role.QKV_COLUMN: _QKV, Role.GATED_MLP_COLUMN: _GATED, Role.EXPERT_COLUMN: _GATED}


@dataclass(frozen=True)
class MegatronConfig:
    """The parts of the ``megatron.config`` sidecar the planner needs."""

    num_layers: int
    num_heads: int
    num_groups: int
    head_dim: int
    num_moe_experts: int = 0
    vocab_size: int | None = None
    padded_vocab_size: int | None = None
    tie_word_embeddings: bool = False

    @classmethod
    def from_sidecar(cls, sidecar: Mapping[str, Any]) -> "MegatronConfig":
        raw = sidecar.get(CONFIG_KEY)
        if not isinstance(raw, Mapping):
            raise InvalidArgument(f"sidecar[{CONFIG_KEY!r}]: expected a mapping, got {type(raw).__name__}")
        try:
            heads = int(raw["num_attention_heads"])
            groups = int(raw.get("num_query_groups") or heads)
            head_dim = int(raw.get("kv_channels") or int(raw["hidden_size"]) // heads)
            return cls(
                num_layers=int(raw.get("num_layers") or 0),
                num_heads=heads,
                num_groups=groups,
                head_dim=head_dim,
                num_moe_experts=int(raw.get("num_moe_experts") or 0),
                vocab_size=int(raw["vocab_size"]) if raw.get("vocab_size") else None,
                padded_vocab_size=int(raw["padded_vocab_size"]) if raw.get("padded_vocab_size") else None,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise InvalidArgument(f"sidecar[{CONFIG_KEY!r}]: {exc!r} in {dict(raw)!r}") from exc


class TensorSpec(NamedTuple):
    """Where one HF tensor (or window) sits in the arena and how it is finished."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    copies: int  # staged blocks placed with a local strided copy (0: a pure view)


# One Megatron tensor in the plan: arena base of its region, template, HF names, dtype.
_Entry = tuple[int, Template, list[str], str]


@dataclass
class MegatronReceivePlan:
    """A :class:`mx_refit.plan.ReceivePlan` for Megatron-published shards (see module docs)."""

    reads: list[ReadOp]
    arena_bytes: int
    bytes_needed: int
    bytes_by_role: dict[str, tuple[int, int]]
    hf_names: list[str]
    unmapped: list[str] = field(default_factory=list)  # published names absent from the HF map
    _entries: list[_Entry] = field(default_factory=list, repr=False)

    @property
    def tensors(self) -> int:
        """How many HF tensors ``materialize`` yields."""
        return len(self.hf_names)

    @property
    def bytes_pulled(self) -> int:
        return sum(pulled for pulled, _ in self.bytes_by_role.values())

    def tensor_specs(self) -> Iterator[TensorSpec]:
        """Every output's arena placement, without touching memory (bookkeeping, verify)."""
        make = TensorSpec._make
        for base, tpl, names, dtype in self._entries:
            for name, out in zip(names, tpl.outs):
                yield make((name, base + out.rel, out.nbytes, out.shape, dtype, len(out.copies)))

    def materialize(self, arena: "torch.Tensor") -> Iterator[tuple[str, "torch.Tensor"]]:
        """Yield ``(hf_name, tensor)`` for every planned tensor once the reads have landed.

        Tensors are views of ``arena`` (a 1-D uint8 tensor of at least ``arena_bytes``); staged
        row-parallel blocks are first copied into place, once.
        """
        import torch

        if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.numel() < self.arena_bytes:
            raise InvalidArgument(
                f"arena: expected a 1-D uint8 tensor of >= {self.arena_bytes} bytes, got "
                f"{arena.dtype} {tuple(arena.shape)}"
            )
        dtypes: dict[str, torch.dtype] = {}
        origin = arena.storage_offset()
        for base, tpl, names, dtype in self._entries:
            tdtype = dtypes.get(dtype)
            if tdtype is None:
                tdtype = dtypes[dtype] = getattr(torch, dtype)
            for name, out in zip(names, tpl.outs):
                start = base + out.rel
                region = arena[start : start + out.nbytes]
                if out.copies:
                    rows = out.shape[0]
                    blocks = [
                        (c.dst_col, arena.as_strided((c.rows, c.width), (c.row_stride, 1), origin + base + c.landing))
                        for c in out.copies
                    ]
                    place_column_blocks(region.view(rows, out.nbytes // rows), blocks)
                yield name, region.view(tdtype).view(out.shape)


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


def plan_receive(
    version: VersionInfo,
    target: TargetLayout,
    *,
    row_slice_options: dict[str, Any] | None = None,
    sticky_bytes: int = STICKY_BYTES,
) -> MegatronReceivePlan:
    """Plan every byte ``target`` needs from ``version``'s Megatron shards.

    :param row_slice_options: keyword arguments for
        :func:`mx_refit.transport.ranges.plan_row_slice` (cost constants, ``force``) used for
        row-parallel column sub-blocks (target TP wider than source TP).
    :param sticky_bytes: a shard with replicas keeps being read from the replica used last until
        that replica is this many bytes ahead of the least-loaded one (long same-source runs
        coalesce into few descriptors; 0 balances every tensor).
    :raises CoverageError: some needed range is published by no source (lists all of them).
    :raises InvalidArgument: a malformed sidecar, an inconsistent descriptor or an unsupported
        target (e.g. a TP size that does not divide the heads).
    """
    return _Planner(version, target, row_slice_options, sticky_bytes).run()


# A shard slot's candidates: parallel tuples of source ids and their descriptors.
_Slot = tuple[tuple[str, ...], tuple[TensorDescriptor, ...]]
# Pass-1 result per tensor: template, (source, addr) per slot, HF names, dtype, role.
_Planned = tuple[Template, list[tuple[str, int] | None], list[str], str, Role]


class _Planner:
    def __init__(
        self,
        version: VersionInfo,
        target: TargetLayout,
        row_slice_options: dict[str, Any] | None,
        sticky_bytes: int,
    ) -> None:
        self.version = version
        self.target = target
        self.cfg = MegatronConfig.from_sidecar(version.sidecar)
        hf_map = version.sidecar.get(HF_MAP_KEY)
        if not isinstance(hf_map, Mapping):
            raise InvalidArgument(f"sidecar[{HF_MAP_KEY!r}]: expected a mapping, got {type(hf_map).__name__}")
        self.hf_map: Mapping[str, Any] = hf_map
        self.row_slice_options = row_slice_options
        self.sticky_bytes = sticky_bytes
        _check_target(target, self.cfg)
        n_experts = self.cfg.num_moe_experts
        if n_experts:
            per = n_experts // target.ep_size
            self.owned = (target.ep_rank * per, (target.ep_rank + 1) * per)
        else:
            self.owned = (0, 0)
        # Rotate first picks by receiver so workers start on different replicas of a shard.
        self.rotation = target.ep_rank * target.tp_size + target.tp_rank
        self.templates: dict[tuple[Any, ...], Template] = {}
        self.load: dict[str, int] = {s.source_id: 0 for s in version.sources}
        self.current: dict[tuple[str, ...], int] = {}  # replica set -> index read from last
        self.gaps: list[tuple[str, str]] = []
        self.expert_families: dict[str, int] = {}  # "name with id removed" -> 0
        self.experts_seen = 0

    # -- driver ----------------------------------------------------------------------------------
    def run(self) -> MegatronReceivePlan:
        index = _index(self.version)
        order = {s.source_id: i for i, s in enumerate(sorted(self.version.sources, key=lambda s: s.source_id))}
        # Pass 1, in name-map order: template and one source per needed slot, per tensor.
        planned: list[_Planned] = []
        keys: list[int] = []
        produced: set[str] = set()
        lo_owned, hi_owned = self.owned
        load, templates = self.load, self.templates
        current, rotation, sticky = self.current, self.rotation, self.sticky_bytes
        for mname, entry in self.hf_map.items():
            pairs = index.get(mname)
            names = entry.get("hf") if type(entry) is dict else None
            if type(names) is not list:
                names = _hf_names(mname, entry)  # validates, or raises naming the entry
            if pairs is None:
                self._missing(mname, names)
                continue
            first = pairs[0][1][0]
            role = first.role
            if role is Role.EXPERT_COLUMN or role is Role.EXPERT_ROW:
                eid = first.extras.get("expert_id")
                if eid is None:
                    eid = _parse_expert_id(mname)
                if not lo_owned <= eid < hi_owned:
                    continue
                self.experts_seen += 1
                if eid == lo_owned:
                    self.expert_families[_expert_family(mname)] = 0
            before = len(produced)
            produced.update(names)
            if len(produced) - before != len(names):
                if before == len(produced):
                    continue  # every name already received (e.g. a tied output layer)
                raise InvalidArgument(f"sidecar[{HF_MAP_KEY!r}][{mname!r}]: HF names {names} partly produced twice")

            if first.shard_axis < 0:
                # Unsplit: one slot, every holder a replica.
                slots = [pairs[0] if len(pairs) == 1 else _merge(pairs)]
                geometry: tuple[Any, ...] = ((0, first.local_shape),)
            else:
                slots, geometry = _split_slots(pairs)
            vocab_like = role is Role.VOCAB_PARALLEL or (
                (role is Role.COLUMN or role is Role.REPLICATED) and mname.endswith(_VOCAB_SUFFIXES)
            )
            key = (len(names), role, first.global_shape, first.dtype, first.shard_axis, geometry, vocab_like,
                   first.extras.get("tp_size") if first.shard_axis >= 0 else None)
            tpl = templates.get(key)
            if tpl is None:
                tpl = templates[key] = self._build_checked(mname, len(names), first, geometry, vocab_like)
            if tpl.gaps:
                self.gaps.extend((names[j], text) for j, text in tpl.gaps)
            chosen: list[tuple[str, int] | None] = [None] * len(slots)
            sort_key = -1
            for s, need in enumerate(tpl.slot_bytes):
                if need:
                    sids, descs = slots[s]
                    j = 0
                    if len(sids) > 1:
                        # Sticky replica choice (inlined: this runs for every replicated tensor).
                        j = current.get(sids, rotation % len(sids))
                        least = min(map(load.__getitem__, sids))
                        if load[sids[j]] - least > sticky:
                            j = list(map(load.__getitem__, sids)).index(least)
                        current[sids] = j
                    load[sids[j]] += need
                    chosen[s] = (sids[j], descs[j].addr)
                    if sort_key < 0:
                        sort_key = (order[sids[j]] << 64) + descs[j].addr
            planned.append((tpl, chosen, names, first.dtype, role))
            keys.append(sort_key)

        self._structural_gaps()
        if self.gaps:
            listed = "; ".join(f"{name}: {where}" for name, where in self.gaps)
            raise CoverageError(
                f"version {self.version.version} of {self.version.model!r} cannot cover {len(self.gaps)} "
                f"needed range(s) for target {self.target}: {listed}",
                gaps=list(self.gaps),
            )
        return self._layout(planned, keys, sorted(set(index).difference(self.hf_map)))

    def _layout(
        self,
        planned: list[_Planned],
        keys: list[int],
        unmapped: list[str],
    ) -> MegatronReceivePlan:
        """Pass 2: arena regions in (source, remote address) order so consecutive tensors of one
        source are adjacent on both sides, and reads that touch on both sides merge."""
        bases = [0] * len(planned)
        raw: list[list[Any]] = []  # [source_id, remote_addr, nbytes, local_offset]
        tail: dict[str, list[Any]] = {}  # source -> its last read, to extend
        cursor = 0
        for i in sorted(range(len(planned)), key=keys.__getitem__):
            tpl, chosen = planned[i][0], planned[i][1]
            base = bases[i] = cursor
            cursor += (tpl.region + REGION_ALIGN - 1) // REGION_ALIGN * REGION_ALIGN
            for s, src, nbytes, dst in tpl.pieces:
                sid, addr = chosen[s]  # type: ignore[misc]
                remote, local = addr + src, base + dst
                last = tail.get(sid)
                if last is not None and last[1] + last[2] == remote and last[3] + last[2] == local:
                    last[2] += nbytes
                else:
                    tail[sid] = op = [sid, remote, nbytes, local]
                    raw.append(op)
        by_role: dict[Role, list[int]] = {}
        entries: list[_Entry] = []
        hf_names: list[str] = []
        for (tpl, _, names, dtype, role), base in zip(planned, bases):
            counters = by_role.get(role)
            if counters is None:
                counters = by_role[role] = [0, 0]
            counters[0] += tpl.pulled
            counters[1] += tpl.needed
            entries.append((base, tpl, names, dtype))
            hf_names.extend(names)
        return MegatronReceivePlan(
            reads=[ReadOp(*op) for op in raw],
            arena_bytes=max(cursor, 1),
            bytes_needed=sum(c[1] for c in by_role.values()),
            bytes_by_role={role.value: (c[0], c[1]) for role, c in by_role.items()},
            hf_names=hf_names,
            unmapped=unmapped,
            _entries=entries,
        )

    def _build_checked(
        self, mname: str, kind: int, desc: TensorDescriptor, geometry: tuple[Any, ...], vocab_like: bool
    ) -> Template:
        try:
            return self._build(mname, kind, desc, geometry, vocab_like)
        except ValueError as exc:
            raise InvalidArgument(f"tensor {mname!r} ({desc.role.value}, {desc.global_shape}): {exc}") from exc

    # -- templates -------------------------------------------------------------------------------
    def _build(
        self,
        mname: str,
        kind: int,
        desc: TensorDescriptor,
        geometry: tuple[tuple[int, tuple[int, ...]], ...],
        vocab_like: bool,
    ) -> Template:
        role, gshape, axis = desc.role, tuple(desc.global_shape), desc.shard_axis
        expected = _EXPECTED_OUTPUTS.get(role, _IDENTITY)
        if kind != expected and not (role is Role.EXPERT_COLUMN and kind == _IDENTITY):
            raise ValueError(f"role {role.value!r} maps to {expected} HF tensors, the sidecar lists {kind}")
        if axis not in (-1, 0, 1) or (axis == 1 and len(gshape) != 2):
            raise ValueError(f"unsupported shard_axis {axis} for a {len(gshape)}-D tensor")
        for offset, local in geometry:
            if len(local) != len(gshape) or any(
                l != g for d, (l, g) in enumerate(zip(local, gshape)) if d != axis
            ) or (axis >= 0 and offset + local[axis] > gshape[axis]):
                raise ValueError(f"shard at offset {offset} of local shape {local} does not fit {gshape}")
        cfg, tgt = self.cfg, self.target
        sliced = not tgt.full_tensors
        whole_experts = role in _EXPERT_ROLES and tgt.ep_size > 1  # vLLM EP: expert TP = 1

        row_parallel = role in (Role.ROW, Role.EXPERT_ROW) and len(gshape) == 2
        if axis == 1 or row_parallel:
            if kind != _IDENTITY or not row_parallel:
                raise ValueError("only 2-D row-parallel tensors may be split on dim 1")
            cols = gshape[1]
            lo, hi = (
                split_window(cols, tgt.tp_size, tgt.tp_rank, what=f"{mname} columns")
                if sliced and not whole_experts
                else (0, cols)
            )
            slots = [(o, l[1]) for o, l in geometry] if axis == 1 else [(0, cols)]
            return columns_template(gshape, desc.itemsize, slots, Window(1, lo, hi), self.row_slice_options)

        rows = gshape[0]
        slots = [(o, l[0]) for o, l in geometry] if axis == 0 else [(0, rows)]
        if kind == _QKV:
            h, g, d = cfg.num_heads, cfg.num_groups, cfg.head_dim
            bands = qkv_bands(h, g, d)
            if rows != (h + 2 * g) * d:
                raise ValueError(f"fused QKV rows {rows} != (heads {h} + 2 x groups {g}) x head_dim {d}")
            full = (h * d, g * d, g * d)
            if sliced:
                if h % tgt.tp_size:
                    raise ValueError(f"num_attention_heads={h} does not divide by target TP size {tgt.tp_size}")
                kv = kv_rows_window(g, d, tgt.tp_size, tgt.tp_rank)
                windows = [Window(0, *split_window(h * d, tgt.tp_size, tgt.tp_rank, what="q rows")),
                           Window(0, *kv), Window(0, *kv)]
            else:
                windows = [Window(0, 0, n) for n in full]
        elif kind == _GATED:
            # The publishing TP: from the descriptor, never from how many sources exist.
            tp = rows // geometry[0][1][0] if axis == 0 else 1
            if axis == 0 and desc.extras.get("tp_size") not in (None, tp):
                raise ValueError(f"extras tp_size={desc.extras['tp_size']} disagrees with the shard geometry ({tp})")
            bands = gated_bands(rows, tp)
            half = rows // 2
            win = split_window(half, tgt.tp_size, tgt.tp_rank, what=f"{mname} gate/up rows") if (
                sliced and not whole_experts) else (0, half)
            windows = [Window(0, *win), Window(0, *win)]
        else:
            hf_rows = rows
            if vocab_like and cfg.vocab_size is not None:
                if cfg.vocab_size > rows:
                    raise ValueError(f"vocab_size {cfg.vocab_size} exceeds the {rows} published vocabulary rows")
                hf_rows = cfg.vocab_size  # trim Megatron's vocabulary padding
            bands = identity_bands(hf_rows)
            if not sliced or whole_experts or role is Role.REPLICATED or row_parallel or role is Role.ROW:
                windows = [Window(0, 0, hf_rows)]
            elif vocab_like:
                windows = [Window(0, *vocab_window(hf_rows, tgt.tp_size, tgt.tp_rank))]
            else:
                windows = [Window(0, *split_window(hf_rows, tgt.tp_size, tgt.tp_rank, what=f"{mname} rows"))]
        return rows_template(gshape, desc.itemsize, slots, bands, windows)

    # -- coverage ---------------------------------------------------------------------------------
    def _missing(self, mname: str, names: tuple[str, ...]) -> None:
        """A name-map entry no source publishes: a gap unless the target does not need it."""
        if ".experts." in mname:
            eid = _parse_expert_id(mname)
            if not self.owned[0] <= eid < self.owned[1]:
                return
            self.experts_seen += 1
            if eid == self.owned[0]:
                self.expert_families[_expert_family(mname)] = 0
        if self.cfg.tie_word_embeddings and mname.endswith("output_layer.weight"):
            return  # tied: the engine reuses the embedding, nobody publishes an output layer
        self.gaps.extend((name, f"not published by any source (Megatron {mname!r})") for name in names)

    def _structural_gaps(self) -> None:
        """Catch what a name map merged from too few sources cannot show: whole layers or experts
        that no source (and so no sidecar) mentions."""
        if self.cfg.num_layers:
            present: set[int] = set()
            routers: set[int] = set()
            for name in self.hf_map:
                if ".experts." in name:
                    continue
                layer = _layer_of(name)
                if layer >= 0:
                    present.add(layer)
                    if ".mlp.router." in name:
                        routers.add(layer)
            for layer in range(self.cfg.num_layers):
                if layer not in present:
                    self.gaps.append((f"decoder.layers.{layer}", "layer missing from every source"))
            if self.cfg.num_moe_experts:
                with_experts = {_layer_of(f) for f in self.expert_families}
                for layer in sorted(routers - with_experts):
                    self.gaps.append((f"decoder.layers.{layer}.mlp.experts", f"no expert {self.owned[0]} published"))
        per_family = self.owned[1] - self.owned[0]
        if self.expert_families and self.experts_seen != per_family * len(self.expert_families):
            # Slow path, only when something is missing: find exactly which experts.
            seen: dict[str, set[int]] = {f: set() for f in self.expert_families}
            for name in self.hf_map:
                if ".experts." in name:
                    family = _expert_family(name)
                    seen.setdefault(family, set()).add(_parse_expert_id(name))
            for family, ids in seen.items():
                for eid in range(*self.owned):
                    if eid not in ids:
                        self.gaps.append((family.replace("{E}", str(eid)), "expert missing from every source"))


def _check_target(target: TargetLayout, cfg: MegatronConfig) -> None:
    for axis in ("tp", "ep"):
        rank, size = getattr(target, f"{axis}_rank"), getattr(target, f"{axis}_size")
        if size < 1 or not 0 <= rank < size:
            raise InvalidArgument(f"target.{axis}_rank/{axis}_size: {rank}/{size} is not a valid rank")
    if target.ep_size > 1 and (not cfg.num_moe_experts or cfg.num_moe_experts % target.ep_size):
        raise InvalidArgument(
            f"target.ep_size: {target.ep_size} does not divide num_moe_experts={cfg.num_moe_experts}"
        )


def _index(version: VersionInfo) -> dict[str, list[_Slot]]:
    """Megatron name -> [(source ids, their descriptors)], one pair per group of sources that
    publish the same names in the same order (e.g. the TP ranks of one PP stage and EP rank).

    Grouping first lets C-level ``zip`` pair up each name's replicas/shards, so indexing costs
    one Python step per name and group instead of one per descriptor. Sources are in id order,
    so every later choice is deterministic.
    """
    groups: dict[tuple[str, ...], list[Any]] = {}
    for source in sorted(version.sources, key=lambda s: s.source_id):
        groups.setdefault(tuple(map(_NAME, source.tensors)), []).append(source)
    index: dict[str, list[_Slot]] = {}
    get = index.get
    for names, members in groups.items():
        sids = tuple(m.source_id for m in members)
        for name, descs in zip(names, zip(*(m.tensors for m in members))):
            pairs = get(name)
            if pairs is None:
                index[name] = [(sids, descs)]
            else:
                pairs.append((sids, descs))
    return index


def _merge(pairs: list[_Slot]) -> _Slot:
    """One candidate set out of several groups' replicas."""
    return tuple(s for sids, _ in pairs for s in sids), tuple(d for _, descs in pairs for d in descs)


def _split_slots(pairs: list[_Slot]) -> tuple[list[_Slot], tuple[Any, ...]]:
    """Shard slots (by offset, sorted) with their replicas, and the geometry key."""
    by_offset: dict[int, tuple[list[str], list[TensorDescriptor]]] = {}
    for sids, descs in pairs:
        for sid, desc in zip(sids, descs):
            slot = by_offset.get(desc.shard_offset)
            if slot is None:
                slot = by_offset[desc.shard_offset] = ([], [])
            slot[0].append(sid)
            slot[1].append(desc)
    offsets = sorted(by_offset)
    slots = [(tuple(by_offset[o][0]), tuple(by_offset[o][1])) for o in offsets]
    return slots, tuple((o, by_offset[o][1][0].local_shape) for o in offsets)


def _layer_of(name: str) -> int:
    """The (PP-global) layer index of ``decoder.layers.<L>.…``, or -1."""
    if not name.startswith("decoder.layers."):
        return -1
    number = name[15:].split(".", 1)[0]
    return int(number) if number.isdigit() else -1


def _hf_names(mname: str, entry: Any) -> tuple[str, ...]:
    names = entry.get("hf") if isinstance(entry, Mapping) else entry
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidArgument(f"sidecar[{HF_MAP_KEY!r}][{mname!r}]: expected a non-empty list of HF names, got {entry!r}")
    return tuple(names)


def _parse_expert_id(name: str) -> int:
    """Global expert id from ``...experts.linear_fc1.weight7`` or ``...local_experts.7.linear_fc1...``."""
    head, sep, tail = name.rpartition(".weight")
    if sep and tail.isdigit():
        return int(tail)
    head, sep, tail = name.partition(".local_experts.")
    number = tail.split(".", 1)[0]
    if sep and number.isdigit():
        return int(number)
    raise InvalidArgument(f"cannot find an expert id in {name!r}")


def _expert_family(name: str) -> str:
    """The name with its expert id replaced by ``{E}`` (one family per layer and parameter)."""
    head, sep, tail = name.rpartition(".weight")
    if sep and tail.isdigit():
        return f"{head}.weight{{E}}"
    head, sep, tail = name.partition(".local_experts.")
    return f"{head}.local_experts.{{E}}.{tail.split('.', 1)[1]}"


def describe_plan(plan: MegatronReceivePlan) -> dict[str, Any]:
    """A JSON-friendly summary (tensors, bytes, reads, copies) for logs and ``verify``."""
    copies = sum(spec.copies for spec in plan.tensor_specs())
    return {
        "tensors": plan.tensors,
        "reads": len(plan.reads),
        "arena_bytes": plan.arena_bytes,
        "bytes_needed": plan.bytes_needed,
        "bytes_pulled": plan.bytes_pulled,
        "bytes_by_role": {role: list(v) for role, v in plan.bytes_by_role.items()},
        "staged_copies": copies,
        "sources": len({r.source_id for r in plan.reads}),
        "unmapped": len(plan.unmapped),
    }
