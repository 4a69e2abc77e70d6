"""Layout and sidecar digests: how an unchanged manifest stays off the wire.

Trainers republish the same buffers every step, so from the second version on a source's
descriptors (and the merged sidecar) are usually identical to the previous version's. The
catalog stamps every registered source with a ``layout_digest`` (a stable hash of its
descriptors and regions) and every version with a ``sidecar_digest``; a reader announces the
digests it holds in ``GetVersionRequest`` and the catalog leaves those parts out of the reply.
A source's NIXL agent metadata (which lists every region the agent registered: ~44 bytes per
separately allocated tensor) has its own ``agent_metadata_digest`` and is left out the same way,
so a steady reply carries no per-tensor bytes at all.

* Catalog side: :func:`stamp_layout` reuses the previous registration's descriptor tuple,
  CUDA IPC export and digest when the layout is unchanged, so the common case costs one equality check and no
  hashing; :func:`sidecar_digest` hashes a version's canonical sidecar JSON once.
* Reader side: :class:`ManifestCache` (bounded, per model) hands out :class:`Known`
  snapshots: what a request announces, and what its reply is completed from.
* :class:`UnknownDigest`: a reply left out something the reader does not hold.

No grpc or protobuf import here.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mx_refit.catalog.validation import same_json
from mx_refit.errors import MxRefitError
from mx_refit.types import HF_RAW, CudaIpcExport, SourceInfo, TensorDescriptor, VersionInfo

__all__ = [
    "NOTHING_KNOWN",
    "Known",
    "Layout",
    "ManifestCache",
    "ManifestStats",
    "UnknownDigest",
    "layout_digest",
    "metadata_digest",
    "same_tensors",
    "sidecar_digest",
    "stamp_layout",
]

_DIGEST_BYTES = 16  # 128-bit BLAKE2b: accidental collisions are not a practical concern


class UnknownDigest(MxRefitError):
    """A catalog reply left out a layout or sidecar (by digest) that the reader does not hold."""


def _digest(text: str, person: bytes) -> str:
    return hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES, person=person).hexdigest()


def layout_digest(
    tensors: Sequence[TensorDescriptor],
    regions: Sequence[tuple[int, int]],
    cuda_ipc: CudaIpcExport | None = None,
) -> str:
    """Stable hex digest of validated descriptors, regions and CUDA IPC export (same in every
    process; without an export, the same digest as before exports were digested).

    Canonical JSON of every field: type-strict (``1``, ``1.0`` and ``true`` differ in extras)
    and independent of the key order of extras. Roles and memory types are ``str`` enums, so
    JSON writes their values. The export is digested because it is per region (one handle per
    tensor for separately allocated parameters): an unchanged one stays off the wire too.
    """
    rows = [
        (
            d.name,
            d.dtype,
            d.global_shape,
            d.local_shape,
            d.addr,
            d.nbytes,
            d.role,
            d.shard_axis,
            d.shard_offset,
            d.mem_type,
            d.device_id,
            d.extras,
            *_compile_form(d),
        )
        for d in tensors
    ]
    parts: list[Any] = [rows, list(regions)]
    if cuda_ipc is not None:
        parts.append([
            cuda_ipc.boot_id, cuda_ipc.host_name, cuda_ipc.pid, cuda_ipc.pid_namespace,
            bytes(cuda_ipc.device_uuid).hex(),
            [(r.addr, r.nbytes, bytes(r.handle).hex(), r.offset) for r in cuda_ipc.regions],
        ])
    text = json.dumps(
        parts,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return _digest(text, b"mx-refit/layout")


def _compile_form(d: TensorDescriptor) -> tuple[Any, ...]:
    # Only a compiled tensor adds its form, so digests of hf_raw layouts did not change.
    if d.compile_target == HF_RAW and not d.compile_metadata:
        return ()
    return ("compile", d.compile_target, d.compile_metadata)


def metadata_digest(metadata: bytes) -> str:
    """Stable hex digest of a source's NIXL agent metadata ("" for none)."""
    if not metadata:
        return ""
    return hashlib.blake2b(bytes(metadata), digest_size=_DIGEST_BYTES, person=b"mx-refit/agent").hexdigest()


def sidecar_digest(sidecar_text: str) -> str:
    """Stable hex digest of a sidecar's canonical JSON text."""
    return _digest(sidecar_text, b"mx-refit/sidecar")


@dataclass(frozen=True)
class Layout:
    """A source's descriptors, regions and CUDA IPC export together with their digest."""

    tensors: tuple[TensorDescriptor, ...]
    regions: tuple[tuple[int, int], ...]
    digest: str
    cuda_ipc: CudaIpcExport | None = None


def same_tensors(
    old: tuple[TensorDescriptor, ...], new: tuple[TensorDescriptor, ...]
) -> bool:
    """Equal descriptor tuples, extras compared type-strictly (``==`` alone takes ``1``,
    ``1.0`` and ``True`` as equal; the digest does not)."""
    if old is new:
        return True
    if len(old) != len(new) or old != new:
        return False
    return all(same_json(a.extras, b.extras) for a, b in zip(old, new, strict=True) if a.extras)


def stamp_layout(source: SourceInfo, previous: Layout | None) -> tuple[SourceInfo, Layout]:
    """``source`` with its ``layout_digest`` and ``agent_metadata_digest`` set, and its
    :class:`Layout`.

    ``previous`` is the same source id's last registered layout: when the new one is equal,
    its tuple objects and digest are reused (no hashing; later equality checks against it are
    identity checks). Call it with a validated source, outside the catalog lock.
    """
    if (
        previous is not None
        and previous.regions == source.regions
        and previous.cuda_ipc == source.cuda_ipc
        and same_tensors(previous.tensors, source.tensors)
    ):
        layout = previous
    else:
        layout = Layout(
            source.tensors, source.regions,
            layout_digest(source.tensors, source.regions, source.cuda_ipc), source.cuda_ipc,
        )
    stamped = replace(
        source, tensors=layout.tensors, regions=layout.regions, layout_digest=layout.digest,
        cuda_ipc=layout.cuda_ipc, agent_metadata_digest=metadata_digest(source.agent_metadata),
    )
    return stamped, layout


# --- reader side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Known:
    """What a reader holds for one model when it asks for a version.

    ``layout_digests`` and ``metadata_digests`` (source_id -> digest) and ``sidecar_digest``
    go into the request; ``layouts``, ``metadata`` and ``sidecars`` (by digest) complete the
    reply. A snapshot: later evictions from the cache cannot take away what a request in flight
    announced.
    """

    layout_digests: Mapping[str, str] = field(default_factory=dict)
    sidecar_digest: str = ""
    layouts: Mapping[str, Layout] = field(default_factory=dict)
    sidecars: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    metadata_digests: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, bytes] = field(default_factory=dict)


NOTHING_KNOWN = Known()


@dataclass(frozen=True)
class ManifestStats:
    """Counters of a client's ``get_version`` replies (for tests and diagnostics)."""

    replies: int = 0
    sources_sent: int = 0  # sources whose descriptors came over the wire
    sources_omitted: int = 0  # sources left out because their layout digest was known
    descriptors_sent: int = 0  # descriptors that came over the wire
    sidecars_sent: int = 0
    sidecars_omitted: int = 0
    metadata_sent: int = 0  # sources whose NIXL agent metadata came over the wire
    metadata_omitted: int = 0  # sources whose agent metadata was left out (digest known)
    refetches: int = 0  # replies that left out something unknown, so asked again in full


@dataclass
class _ModelEntry:
    layouts: dict[str, Layout] = field(default_factory=dict)  # digest -> layout
    sidecars: dict[str, dict[str, Any]] = field(default_factory=dict)  # digest -> sidecar
    # (layout digests, sidecar digest) of the last few manifests: what stays cached.
    recent: deque[tuple[frozenset[str], str]] = field(default_factory=deque)
    latest: dict[str, str] = field(default_factory=dict)  # source_id -> digest, newest reply
    latest_sidecar: str = ""
    # Agent metadata like layouts: by digest, the newest reply's per source, the last few kept.
    metadata: dict[str, bytes] = field(default_factory=dict)
    latest_metadata: dict[str, str] = field(default_factory=dict)
    recent_metadata: deque[frozenset[str]] = field(default_factory=deque)


class ManifestCache:
    """The layouts and sidecars a reader received, by digest (thread-safe, bounded).

    Per model it keeps what the last ``versions`` manifests referenced (an unchanged layout is
    one entry however many versions share it), for at most ``models`` models, least recently
    used dropped first. ``versions=0`` disables caching.
    """

    def __init__(self, versions: int = 2, models: int = 8) -> None:
        if versions < 0 or models < 1:
            raise ValueError(f"versions must be >= 0 and models >= 1, got {versions}, {models}")
        self._versions = versions
        self._max_models = models
        self._lock = threading.Lock()
        self._models: OrderedDict[str, _ModelEntry] = OrderedDict()
        self._stats: dict[str, int] = dict.fromkeys(ManifestStats.__dataclass_fields__, 0)

    @property
    def stats(self) -> ManifestStats:
        with self._lock:
            return ManifestStats(**self._stats)

    def count(self, **deltas: int) -> None:
        """Add to the :class:`ManifestStats` counters."""
        with self._lock:
            for name, delta in deltas.items():
                self._stats[name] += delta

    def known(self, model: str) -> Known:
        """A snapshot of what is cached for ``model`` (:data:`NOTHING_KNOWN` if nothing)."""
        with self._lock:
            entry = self._models.get(model)
            if entry is None:
                return NOTHING_KNOWN
            self._models.move_to_end(model)
            return Known(
                layout_digests=dict(entry.latest),
                sidecar_digest=entry.latest_sidecar,
                layouts=dict(entry.layouts),
                sidecars=dict(entry.sidecars),
                metadata_digests=dict(entry.latest_metadata),
                metadata=dict(entry.metadata),
            )

    def remember(self, model: str, info: VersionInfo) -> None:
        """Cache the layouts and sidecar of a complete ``info`` (parts without a digest, from
        a catalog that does not send them, are not cached)."""
        if not self._versions:
            return
        with self._lock:
            entry = self._models.get(model)
            if entry is None:
                entry = self._models[model] = _ModelEntry()
                while len(self._models) > self._max_models:
                    self._models.popitem(last=False)
            else:
                self._models.move_to_end(model)
            latest: dict[str, str] = {}
            for source in info.sources:
                digest = source.layout_digest
                if digest:
                    latest[source.source_id] = digest
                    if digest not in entry.layouts:
                        entry.layouts[digest] = Layout(source.tensors, source.regions, digest, source.cuda_ipc)
            if info.sidecar_digest and info.sidecar_digest not in entry.sidecars:
                entry.sidecars[info.sidecar_digest] = info.sidecar
            entry.latest, entry.latest_sidecar = latest, info.sidecar_digest
            self._remember_metadata(entry, info)
            entry.recent.append((frozenset(latest.values()), info.sidecar_digest))
            if len(entry.recent) > self._versions:
                entry.recent.popleft()
                live = frozenset().union(*(digests for digests, _ in entry.recent))
                live_sidecars = {digest for _, digest in entry.recent}
                entry.layouts = {d: v for d, v in entry.layouts.items() if d in live}
                entry.sidecars = {d: v for d, v in entry.sidecars.items() if d in live_sidecars}

    def _remember_metadata(self, entry: _ModelEntry, info: VersionInfo) -> None:
        latest = {s.source_id: s.agent_metadata_digest for s in info.sources if s.agent_metadata_digest}
        for source in info.sources:
            if source.agent_metadata_digest and source.agent_metadata_digest not in entry.metadata:
                entry.metadata[source.agent_metadata_digest] = source.agent_metadata
        entry.latest_metadata = latest
        entry.recent_metadata.append(frozenset(latest.values()))
        if len(entry.recent_metadata) > self._versions:
            entry.recent_metadata.popleft()
            live = frozenset().union(*entry.recent_metadata)
            entry.metadata = {d: v for d, v in entry.metadata.items() if d in live}

    def clear(self) -> None:
        """Forget everything (counters stay)."""
        with self._lock:
            self._models.clear()
