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

from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from itertools import accumulate, chain, islice, repeat
from operator import setitem
from typing import Any

from mx_refit.errors import CoverageError, InvalidArgument
from mx_refit.layout.manifest import (
    CONFIG_KEY,
    HF_MAP_KEY,
    MegatronConfig,
    Slot,
    check_target,
    expert_family,
    group_sources,
    hf_names,
    layer_of,
    merge_replicas,
    parse_expert_id,
    split_slots,
)
from mx_refit.layout.placement import Template, build_template
from mx_refit.layout.receive_plan import (
    Entry,
    MegatronReceivePlan,
    TensorSpec,
    describe_plan,
    gc_paused,
    read_ops,
)
from mx_refit.types import Role, TargetLayout, TensorDescriptor, VersionInfo

__all__ = [
    "CONFIG_KEY",
    "HF_MAP_KEY",
    "MegatronConfig",
    "MegatronReceivePlan",
    "TensorSpec",
    "describe_plan",
    "plan_receive",
]

STICKY_BYTES = 64 << 20  # replica round-robin chunk (by address): neighbours coalesce

_EXPERT_COLUMN, _EXPERT_ROW = Role.EXPERT_COLUMN, Role.EXPERT_ROW
_COLUMN, _REPLICATED, _VOCAB = Role.COLUMN, Role.REPLICATED, Role.VOCAB_PARALLEL
_VOCAB_SUFFIXES = ("word_embeddings.weight", "output_layer.weight")


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
        :func:`mx_refit.ranges.plan_row_slice` (cost constants, ``force``) used for
        row-parallel column sub-blocks (target TP wider than source TP).
    :param sticky_bytes: replicas of a shard (replicated tensors, EP replicas of dense shards,
        experts under expert-data-parallelism) are dealt round robin by address chunks of this
        many bytes, so neighbouring tensors come from one source and coalesce into few
        descriptors while the load still spreads; 0 alternates tensor by tensor. The deal is
        rotated by the receiver's rank so workers start on different sources.
    :raises CoverageError: some needed range is published by no source (lists all of them).
    :raises InvalidArgument: a malformed sidecar, an inconsistent descriptor or an unsupported
        target (e.g. a TP size that does not divide the heads).
    """
    with gc_paused():
        return _Planner(version, target, row_slice_options, sticky_bytes).run()


class _Planner:
    def __init__(
        self,
        version: VersionInfo,
        target: TargetLayout,
        row_slice_options: dict[str, Any] | None,
        sticky_bytes: int,
        *,
        families: bool = True,
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
        check_target(target, self.cfg)
        n_experts = self.cfg.num_moe_experts
        per = n_experts // target.ep_size if n_experts else 0
        self.owned = (target.ep_rank * per, (target.ep_rank + 1) * per)
        self.templates: dict[tuple[Any, ...], Template] = {}
        self.template_roles: dict[int, Role] = {}  # id(template) -> role, for bytes_by_role
        self.template_uses: dict[int, int] = {}  # id(template) -> tensors planned with it
        # Group position layouts seen so far: len -> ((sigs, mapped, shared), families, general).
        self.partitions: dict[int, tuple[Any, dict[tuple[Any, ...], list[int]], list[int]]] = {}
        self.gaps: list[tuple[str, str]] = []
        self.expert_families: dict[str, int] = {}  # "name with id {E}" -> 0, learned from one id
        self.experts_seen = 0
        self.order: dict[str, int] = {}  # source id -> rank in id order
        # Rotate the replica deal by receiver so workers start on different sources.
        self.rotation = target.ep_rank * target.tp_size + target.tp_rank
        self.replica_state: dict[tuple[str, ...], list[int]] = {}  # round robin when sticky_bytes=0
        self.entries: list[Entry] = []
        self.keys: list[int] = []  # arena order: (source rank, remote address) of each tensor
        self.produced: set[str] = set()  # HF names planned so far
        self.saw_unmapped = False  # some published name is absent from the name map
        # False: the reference path, every tensor one by one through _plan_one (tests compare it
        # with the family fast path, which must give exactly the same plan).
        self.families = families

    # -- driver ----------------------------------------------------------------------------------
    def run(self) -> MegatronReceivePlan:
        """Pass 1: a template and one source per needed slot for every tensor the target needs;
        then the coverage gate; then pass 2 lays out the arena and the reads."""
        version, hf_map = self.version, self.hf_map
        groups = group_sources(version)
        # Names several groups hold (dense tensors replicated over EP ranks), by C-level set ops.
        held: set[str] = set()
        shared: set[str] = set()
        for names, _, _ in groups:
            if held:
                shared.update(held.intersection(names))
            held.update(names)
        self.order = {sid: i for i, sid in enumerate(sorted(s.source_id for s in version.sources))}
        general: dict[str, list[Slot]] = {}  # names planned one by one, with their (sids, descs)
        for names, members, sids in groups:
            self._plan_group(names, members, sids, shared, general)
        for mname, pairs in general.items():
            self._plan_one(mname, hf_map[mname], pairs)
        unmapped = sorted(held.difference(hf_map)) if self.saw_unmapped else []
        # Every mapped name seen in some group and the counts agree: nothing is missing.
        missing = hf_map.keys() - held if len(held) - len(unmapped) != len(hf_map) else set()
        if missing:
            for mname in hf_map:  # name-map order, for a readable error
                if mname in missing:
                    self._missing(mname, hf_names(mname, hf_map[mname]))

        self._structural_gaps()
        if self.gaps:
            listed = "; ".join(f"{name}: {where}" for name, where in self.gaps)
            raise CoverageError(
                f"version {version.version} of {version.model!r} cannot cover {len(self.gaps)} "
                f"needed range(s) for target {self.target}: {listed}",
                gaps=list(self.gaps),
            )
        return self._layout(self.entries, self.keys, unmapped)

    def _plan_group(
        self,
        names: tuple[str, ...],
        members: list[Any],
        sids: tuple[str, ...],
        shared: set[str],
        general: dict[str, list[Slot]],
    ) -> None:
        """Plan one group of sources that publish the same names in the same order.

        Unsplit tensors that only this group holds (experts, and every replicated tensor of a
        single-EP job) are planned a whole family at a time: same geometry, same replicas, so
        one template, vectorised source choice and C-level address extraction. The rest (TP
        shards, tensors several groups hold) are collected for :meth:`_plan_one`.
        """
        first_tensors = members[0].tensors
        entries = list(map(self.hf_map.get, names))
        # Family keys. A comprehension, not map(attrgetter(...)): 3.12 specialises its attribute
        # loads for the descriptor class, twice as fast as attrgetter's generic lookups here.
        sigs = [(t.role, t.global_shape, t.dtype, t.shard_axis, t.local_shape) for t in first_tensors]
        # Groups of one model (e.g. the EP ranks) usually share the exact position layout: reuse
        # the partition into families instead of re-hashing every signature (C-level compares).
        mapped = None
        if None in entries:  # some published names are not in the name map (reported)
            self.saw_unmapped = True
            mapped = [entry is not None for entry in entries]
        in_shared = [name in shared for name in names] if shared else None
        layout_key = (sigs, mapped, in_shared)
        cached = self.partitions.get(len(names))
        if cached is not None and cached[0] == layout_key:
            families, general_positions = cached[1], cached[2]
        else:
            families = {}
            general_positions = []
            get = families.get
            for i, sig in enumerate(sigs):
                if mapped is not None and not mapped[i]:
                    continue  # not in the name map: reported as unmapped
                if sig[3] >= 0 or (in_shared is not None and in_shared[i]) or not self.families:
                    general_positions.append(i)
                    continue
                family = get(sig)
                if family is None:
                    families[sig] = family = []
                family.append(i)
            self.partitions[len(names)] = (layout_key, families, general_positions)
        if general_positions:
            setdefault = general.setdefault
            if len(members) == 1:
                for i in general_positions:
                    setdefault(names[i], []).append((sids, (first_tensors[i],)))
            else:
                member_tensors = [m.tensors for m in members]
                for i in general_positions:
                    setdefault(names[i], []).append((sids, tuple([t[i] for t in member_tensors])))
        first_addrs: list[int] = []  # C-level, built on first need
        for sig, positions in families.items():
            if not first_addrs:
                first_addrs = [t.addr for t in first_tensors]
            self._plan_family(sig, positions, names, entries, first_tensors, sids, members, first_addrs)

    def _plan_family(
        self,
        sig: tuple[Any, ...],
        positions: list[int],
        names: tuple[str, ...],
        entries: list[Any],
        first_tensors: tuple[TensorDescriptor, ...],
        sids: tuple[str, ...],
        members: list[Any],
        first_addrs: list[int],
    ) -> None:
        """Plan a family: unsplit tensors of one group with one geometry (e.g. every expert fc1
        of every layer): one template, and per tensor only a few list-comprehension steps (no
        per-tensor function calls; comprehensions beat map(methodcaller) several times on 3.12)."""
        role, gshape, dtype, _, lshape = sig
        if self.target.whole_prefixes and self._any_whole(positions, entries):
            return self._one_by_one(positions, names, entries, sids, members)  # some received whole
        vocab_like = role is _VOCAB
        if role is _EXPERT_COLUMN or role is _EXPERT_ROW:
            eids: list[Any] = [first_tensors[i].extras.get("expert_id") for i in positions]
            if None in eids:
                eids = [parse_expert_id(names[i]) if e is None else e for e, i in zip(eids, positions)]
            lo, hi = self.owned
            for i in [i for i, e in zip(positions, eids) if e == lo]:
                self.expert_families[expert_family(names[i])] = 0
            if min(eids) < lo or max(eids) >= hi:
                positions = [i for i, e in zip(positions, eids) if lo <= e < hi]
                if not positions:
                    return
            self.experts_seen += len(positions)
        elif not vocab_like and (role is _COLUMN or role is _REPLICATED):
            flags = {names[i].endswith(_VOCAB_SUFFIXES) for i in positions}
            if len(flags) != 1:
                return self._one_by_one(positions, names, entries, sids, members)
            (vocab_like,) = flags
        try:
            hf = [entries[i]["hf"] for i in positions]
        except (KeyError, TypeError):
            hf = []
        kinds = {len(x) if type(x) is list else -1 for x in hf}
        if len(kinds) != 1 or -1 in kinds:
            # Unusual family (mixed mappings, bad entries): one by one.
            return self._one_by_one(positions, names, entries, sids, members)
        flat = list(chain.from_iterable(hf))
        produced = self.produced
        before = len(produced)
        produced.update(flat)  # one pass; a clash (rare) is undone below
        if len(produced) - before != len(flat):
            # Undo: the names produced so far are exactly those of the entries planned so far.
            self.produced = produced = set(chain.from_iterable(entry[2] for entry in self.entries))
            if not produced.isdisjoint(flat):  # names received already: one by one
                return self._one_by_one(positions, names, entries, sids, members)
            raise InvalidArgument(
                f"sidecar[{HF_MAP_KEY!r}]: an HF name appears twice among {names[positions[0]]!r}'s kind"
            )
        (kind,) = kinds
        key = (kind, role, gshape, dtype, -1, lshape, vocab_like)
        tpl = self.templates.get(key)
        if tpl is None:
            first = first_tensors[positions[0]]
            tpl = self._build_checked(names[positions[0]], kind, first, ((0, tuple(lshape)),), vocab_like)
            self.templates[key] = tpl
            self.template_roles[id(tpl)] = role
        self.template_uses[id(tpl)] = self.template_uses.get(id(tpl), 0) + len(positions)
        if tpl.gaps:  # an unsplit tensor covers itself; only a malformed geometry gets here
            for names_i in hf:
                self.gaps.extend((names_i[j], text) for j, text in tpl.gaps)
        # Replica per tensor (see _replica), vectorised over the family.
        n = len(sids)
        if n == 1:
            sid = sids[0]
            chosen_addrs = [first_addrs[i] for i in positions]
            rank = self.order[sid] << 64
            self.keys += [rank + a for a in chosen_addrs]
            self.entries += [[0, tpl, h, dtype, role, ((sid, a),)] for h, a in zip(hf, chosen_addrs)]
            return
        if self.sticky_bytes:
            chunk, rot = self.sticky_bytes, self.rotation
            picks = [(rot + first_addrs[i] // chunk) % n for i in positions]
        else:
            state = self.replica_state.setdefault(sids, [0])
            start = self.rotation + state[0]
            picks = [(start + k) % n for k in range(len(positions))]
            state[0] += len(positions)
        ranks = [self.order[sid] << 64 for sid in sids]
        tensors = [m.tensors for m in members]
        chosen_addrs = [tensors[j][i].addr for j, i in zip(picks, positions)]
        self.keys += [ranks[j] + a for j, a in zip(picks, chosen_addrs)]
        self.entries += [
            [0, tpl, h, dtype, role, ((sids[j], a),)] for h, j, a in zip(hf, picks, chosen_addrs)
        ]

    def _any_whole(self, positions: list[int], entries: list[Any]) -> bool:
        """Whether the target receives any of these tensors whole (``whole_prefixes``)."""
        for i in positions:
            entry = entries[i]
            names = entry.get("hf") if type(entry) is dict else None
            if type(names) is list and self.target.receives_whole(names):
                return True
        return False

    def _one_by_one(
        self,
        positions: list[int],
        names: tuple[str, ...],
        entries: list[Any],
        sids: tuple[str, ...],
        members: list[Any],
    ) -> None:
        for i in positions:
            self._plan_one(names[i], entries[i], [(sids, tuple(m.tensors[i] for m in members))])

    def _replica(self, sids: tuple[str, ...], first_addr: int) -> int:
        """Which replica of a shard to read. The first replica's address space is cut into
        ``sticky_bytes`` chunks dealt round robin over the replicas: tensors that sit next to each
        other come from one source (their reads coalesce) while the load spreads evenly. With
        ``sticky_bytes == 0`` replicas alternate tensor by tensor. The deal is rotated by the
        receiver's rank so workers start on different sources."""
        if self.sticky_bytes:
            return (self.rotation + first_addr // self.sticky_bytes) % len(sids)
        state = self.replica_state.setdefault(sids, [0])
        state[0] += 1
        return (self.rotation + state[0] - 1) % len(sids)

    def _plan_one(self, mname: str, entry: Any, pairs: list[Slot]) -> None:
        """The general path: one Megatron tensor, any shard geometry, replicas in any groups."""
        names = entry.get("hf") if type(entry) is dict else None
        if type(names) is not list:
            names = hf_names(mname, entry)  # validates, or raises naming the entry
        first = pairs[0][1][0]
        role = first.role
        vocab_like = False
        if role is _EXPERT_COLUMN or role is _EXPERT_ROW:
            eid = first.extras.get("expert_id")
            if eid is None:
                eid = parse_expert_id(mname)
            if not self.owned[0] <= eid < self.owned[1]:
                return  # another EP rank's expert
            self.experts_seen += 1
            if eid == self.owned[0]:
                self.expert_families[expert_family(mname)] = 0
        else:
            vocab_like = role is _VOCAB or (
                (role is _COLUMN or role is _REPLICATED) and mname.endswith(_VOCAB_SUFFIXES)
            )
        produced = self.produced
        if not produced.isdisjoint(names):
            if produced.issuperset(names):
                return  # every name already received (e.g. a tied output layer)
            raise InvalidArgument(
                f"sidecar[{HF_MAP_KEY!r}][{mname!r}]: HF names {names} partly produced twice"
            )
        produced.update(names)
        whole = bool(self.target.whole_prefixes) and self.target.receives_whole(names)
        axis = first.shard_axis
        if axis < 0:  # unsplit: one slot whose candidates are all replicas
            slots = [pairs[0] if len(pairs) == 1 else merge_replicas(pairs)]
            geometry: tuple[Any, ...] = ((0, tuple(first.local_shape)),)
            key: tuple[Any, ...] = (
                len(names),
                role,
                first.global_shape,
                first.dtype,
                -1,
                first.local_shape,
                vocab_like,
                whole,
            )
        else:
            slots, geometry = split_slots(pairs)
            key = (
                len(names),
                role,
                first.global_shape,
                first.dtype,
                axis,
                geometry,
                vocab_like,
                first.extras.get("tp_size"),
                whole,
            )
        tpl = self.templates.get(key)
        if tpl is None:
            tpl = self.templates[key] = self._build_checked(mname, len(names), first, geometry, vocab_like, whole)
            self.template_roles[id(tpl)] = role
        self.template_uses[id(tpl)] = self.template_uses.get(id(tpl), 0) + 1
        if tpl.gaps:
            self.gaps.extend((names[j], text) for j, text in tpl.gaps)
        chosen: list[tuple[str, int] | None] = [None] * len(slots)
        sort_key = -1
        for s, need in enumerate(tpl.slot_bytes):
            if need:
                sids, descs = slots[s]
                j = self._replica(sids, descs[0].addr) if len(sids) > 1 else 0
                chosen[s] = (sids[j], descs[j].addr)
                if sort_key < 0:
                    sort_key = (self.order[sids[j]] << 64) + descs[j].addr
        self.entries.append([0, tpl, names, first.dtype, role, chosen])
        self.keys.append(sort_key)

    def _layout(self, entries: list[Entry], keys: list[int], unmapped: list[str]) -> MegatronReceivePlan:
        """Pass 2: arena regions in (source, remote address) order, so consecutive tensors of one
        source are adjacent on both sides and their reads merge into one."""
        ordered = [entries[i] for i in sorted(range(len(entries)), key=keys.__getitem__)]
        bases = list(accumulate([entry[1].region for entry in ordered], initial=0))  # regions are aligned
        deque(map(setitem, ordered, repeat(0), bases), maxlen=0)  # entry[0] = its base, C-level
        # Every piece as (source_id, remote_addr, nbytes, local_offset), in one comprehension
        # (an explicit loop with appends cost ~30% more on ~19k pieces)...
        rows = [
            (chosen[s][0], chosen[s][1] + src, nbytes, base + dst)
            for base, tpl, _, _, _, chosen in ordered
            for s, src, nbytes, dst in tpl.pieces
        ]
        # ...then each piece that continues the previous one on both sides, same source, joins it.
        # (Addresses first: they rarely continue, so most tests stop at the first compare.)
        joins = [
            a + n == b and d + n == e and s == t
            for (s, a, n, d), (t, b, _, e) in zip(rows, islice(rows, 1, None))
        ]
        if True in joins:
            merged: list[tuple[str, int, int, int]] = []
            for row, join in zip(rows, [False, *joins]):
                if join:
                    sid, addr, nbytes, dst = merged[-1]
                    merged[-1] = (sid, addr, nbytes + row[2], dst)
                else:
                    merged.append(row)
            rows = merged
        by_role: dict[str, list[int]] = {}
        tensors = 0
        for tpl in self.templates.values():
            uses = self.template_uses.get(id(tpl), 0)
            counters = by_role.setdefault(self.template_roles[id(tpl)].value, [0, 0])
            counters[0] += uses * tpl.pulled
            counters[1] += uses * tpl.needed
            tensors += uses * len(tpl.outs)
        return MegatronReceivePlan(
            reads=read_ops(rows),
            arena_bytes=max(bases[-1], 1),
            bytes_needed=sum(c[1] for c in by_role.values()),
            bytes_by_role={role: (c[0], c[1]) for role, c in by_role.items() if c[1] or c[0]},
            tensors=tensors,
            unmapped=unmapped,
            _entries=entries,
        )

    def _build_checked(
        self,
        mname: str,
        kind: int,
        desc: TensorDescriptor,
        geometry: tuple[Any, ...],
        vocab_like: bool,
        whole: bool = False,
    ) -> Template:
        target = replace(self.target, full_tensors=True) if whole else self.target
        try:
            return build_template(
                mname, kind, desc, geometry, vocab_like, self.cfg, target, self.row_slice_options
            )
        except ValueError as exc:
            raise InvalidArgument(
                f"tensor {mname!r} ({desc.role.value}, {desc.global_shape}): {exc}"
            ) from exc

    # -- coverage ---------------------------------------------------------------------------------
    def _missing(self, mname: str, names: list[str]) -> None:
        """A name-map entry no source publishes: a gap unless the target does not need it."""
        if ".experts." in mname:
            eid = parse_expert_id(mname)
            if not self.owned[0] <= eid < self.owned[1]:
                return
            self.experts_seen += 1
            if eid == self.owned[0]:
                self.expert_families[expert_family(mname)] = 0
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
                layer = layer_of(name)
                if layer >= 0:
                    present.add(layer)
                    if ".mlp.router." in name:
                        routers.add(layer)
            for layer in range(self.cfg.num_layers):
                if layer not in present:
                    self.gaps.append((f"decoder.layers.{layer}", "layer missing from every source"))
            if self.cfg.num_moe_experts:
                with_experts = {layer_of(f) for f in self.expert_families}
                for layer in sorted(routers - with_experts):
                    self.gaps.append(
                        (f"decoder.layers.{layer}.mlp.experts", f"no expert {self.owned[0]} published")
                    )
        per_family = self.owned[1] - self.owned[0]
        if self.expert_families and self.experts_seen != per_family * len(self.expert_families):
            # Slow path, only when something is missing: find exactly which experts.
            seen: dict[str, set[int]] = {f: set() for f in self.expert_families}
            for name in self.hf_map:
                if ".experts." in name:
                    family = expert_family(name)
                    seen.setdefault(family, set()).add(parse_expert_id(name))
            for family, ids in seen.items():
                for eid in range(*self.owned):
                    if eid not in ids:
                        self.gaps.append(
                            (family.replace("{E}", str(eid)), "expert missing from every source")
                        )
