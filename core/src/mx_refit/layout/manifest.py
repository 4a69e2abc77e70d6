"""Reading a Megatron version's manifest: the sidecar config, the name map and the descriptor index.

Everything the planner needs to know about *what was published* (as opposed to what the
receiver needs, which is :mod:`mx_refit.layout.planner`'s business): the transformer config,
HF names per Megatron name, which sources hold which shards, and how to recover expert ids and
layer indices from PP-/EP-global names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any

from mx_refit.errors import InvalidArgument
from mx_refit.types import SourceInfo, TargetLayout, TensorDescriptor, VersionInfo

__all__ = [
    "CONFIG_KEY",
    "HF_MAP_KEY",
    "MegatronConfig",
    "Slot",
    "check_target",
    "expert_family",
    "group_sources",
    "hf_names",
    "index_descriptors",
    "layer_of",
    "merge_replicas",
    "parse_expert_id",
    "split_slots",
]

CONFIG_KEY = "megatron.config"
HF_MAP_KEY = "megatron.hf_map"

# A shard slot's candidates: parallel tuples of source ids and their (identical-bytes) descriptors.
Slot = tuple[tuple[str, ...], tuple[TensorDescriptor, ...]]

_FIRST, _SECOND = itemgetter(0), itemgetter(1)


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
    def from_sidecar(cls, sidecar: Mapping[str, Any]) -> MegatronConfig:
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


def check_target(target: TargetLayout, cfg: MegatronConfig) -> None:
    """Reject impossible receiver layouts before planning anything."""
    for axis in ("tp", "ep"):
        rank, size = getattr(target, f"{axis}_rank"), getattr(target, f"{axis}_size")
        if size < 1 or not 0 <= rank < size:
            raise InvalidArgument(f"target.{axis}_rank/{axis}_size: {rank}/{size} is not a valid rank")
    if target.ep_size > 1 and (not cfg.num_moe_experts or cfg.num_moe_experts % target.ep_size):
        raise InvalidArgument(
            f"target.ep_size: {target.ep_size} does not divide num_moe_experts={cfg.num_moe_experts}"
        )


def group_sources(version: VersionInfo) -> list[tuple[tuple[str, ...], list[SourceInfo], tuple[str, ...]]]:
    """Sources grouped by the exact tuple of names they publish: ``[(names, members, ids)]``.

    Members of a group (e.g. the TP ranks of one PP stage and EP rank) hold, position by
    position, the replicas or TP shards of the same tensors, so C-level ``zip``/``map`` can pair
    them up without a Python step per descriptor. Sources are taken in id order, so every later
    choice is deterministic.
    """
    groups: dict[tuple[str, ...], list[SourceInfo]] = {}
    for source in sorted(version.sources, key=lambda s: s.source_id):
        groups.setdefault(tuple([t.name for t in source.tensors]), []).append(source)  # see planner
    return [(names, members, tuple(m.source_id for m in members)) for names, members in groups.items()]


def index_descriptors(version: VersionInfo) -> dict[str, list[Slot]]:
    """Megatron name -> [(source ids, their descriptors)], one pair per source group."""
    index: dict[str, list[Slot]] = {}
    for names, members, sids in group_sources(version):
        for name, descs in zip(names, zip(*(m.tensors for m in members))):
            index.setdefault(name, []).append((sids, descs))
    return index


def merge_replicas(pairs: list[Slot]) -> Slot:
    """One candidate set out of several groups' replicas of an unsplit tensor."""
    return tuple(chain.from_iterable(map(_FIRST, pairs))), tuple(chain.from_iterable(map(_SECOND, pairs)))


def split_slots(pairs: list[Slot]) -> tuple[list[Slot], tuple[tuple[int, tuple[int, ...]], ...]]:
    """Shard slots of a split tensor (by offset, sorted) with their replicas, and the geometry
    ``((offset, local_shape), ...)`` that keys its template."""
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
    return slots, tuple((o, tuple(by_offset[o][1][0].local_shape)) for o in offsets)


def hf_names(mname: str, entry: Any) -> list[str]:
    """The HF names of one name-map entry (``{"hf": [...], ...}`` or a bare list), validated."""
    names = entry.get("hf") if isinstance(entry, Mapping) else entry
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidArgument(
            f"sidecar[{HF_MAP_KEY!r}][{mname!r}]: expected a non-empty list of HF names, got {entry!r}"
        )
    return list(names)


def layer_of(name: str) -> int:
    """The (PP-global) layer index of ``decoder.layers.<L>.…``, or -1."""
    if not name.startswith("decoder.layers."):
        return -1
    number = name[15:].split(".", 1)[0]
    return int(number) if number.isdigit() else -1


def parse_expert_id(name: str) -> int:
    """Global expert id of ``…experts.linear_fc1.weight7`` or ``…experts.local_experts.7.…``."""
    _, sep, tail = name.rpartition(".weight")
    if sep and tail.isdigit():
        return int(tail)
    _, sep, tail = name.partition(".local_experts.")
    number = tail.split(".", 1)[0]
    if sep and number.isdigit():
        return int(number)
    raise InvalidArgument(f"cannot find an expert id in {name!r}")


def expert_family(name: str) -> str:
    """The name with its expert id replaced by ``{E}`` (one family per layer and parameter)."""
    head, sep, tail = name.rpartition(".weight")
    if sep and tail.isdigit():
        return f"{head}.weight{{E}}"
    head, sep, tail = name.partition(".local_experts.")
    if not sep or "." not in tail:
        raise InvalidArgument(f"cannot find an expert id in {name!r}")
    return f"{head}.local_experts.{{E}}.{tail.split('.', 1)[1]}"
