"""Domain types shared by the catalog, the transport, the publisher and the receiver.

Plain dataclasses with no torch/nixl/grpc imports so that every layer (and every plugin) can
speak them without paying for heavy imports.
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "COMPILE_TARGETS",
    "DTYPE_SIZES",
    "HF_RAW",
    "BlockChecksums",
    "CompileCompat",
    "CudaIpcExport",
    "DeltaForm",
    "IpcRegion",
    "MemType",
    "MeshPosition",
    "Mirror",
    "PackedSums",
    "PublishedTensor",
    "ReadOp",
    "RefitStats",
    "Role",
    "SourceDelta",
    "SourceInfo",
    "TargetLayout",
    "TensorDelta",
    "TensorDescriptor",
    "VersionInfo",
    "VersionState",
]

# Element sizes of the dtypes the catalog accepts (torch names, without the "torch." prefix).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


# The compile target of bytes as trained (Megatron/HF form, the trainer's dtype): the default,
# never sent on the wire (an empty TensorDescriptor.compile_target means it).
HF_RAW = "hf_raw"
# Compile targets this project knows (any lowercase identifier is accepted; these are the named
# ones): "fp8_block" is FP8 E4M3 with 128x128 block scales (``weight`` + ``weight_scale_inv``),
# the form vLLM's block-FP8 linear layers load (see mx_refit.fp8).
COMPILE_TARGETS = (HF_RAW, "fp8_block", "vllm_fused", "deepgemm_fp8", "cutlass_fp8", "trtllm")


class Role(str, enum.Enum):
    """How a published tensor relates to its full (global) Megatron tensor."""

    REPLICATED = "replicated"  # the full tensor on every rank that holds it
    COLUMN = "column"  # split on dim 0
    ROW = "row"  # split on dim 1
    VOCAB_PARALLEL = "vocab_parallel"  # split on dim 0, padded vocabulary
    QKV_COLUMN = "qkv_column"  # fused, group-interleaved [q..., k, v] split on dim 0
    GATED_MLP_COLUMN = "gated_mlp_column"  # each rank holds [gate_r; up_r]
    EXPERT_COLUMN = "expert_column"  # one expert's fc1 ([gate; up]), maybe split by expert-TP
    EXPERT_ROW = "expert_row"  # one expert's fc2, maybe split on dim 1 by expert-TP


class MemType(str, enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class VersionState(str, enum.Enum):
    PENDING = "PENDING"  # fewer than the expected sources are registered and ready
    READY = "READY"  # every expected source is ready; readers may discover and lease it
    DRAINING = "DRAINING"  # the publisher retired it: no new leases, live leases may finish
    RETIRED = "RETIRED"  # drained; its buffers may be mutated
    EXPIRED = "EXPIRED"  # a source died (missed heartbeats); never offered again


@dataclass(frozen=True)
class MeshPosition:
    """A rank's place in the (tp, pp, ep, etp) mesh of the publishing job.

    ``etp_rank``/``etp_size``: the expert-tensor-parallel position, which splits expert tensors
    and may differ from TP (Megatron's ``expert_tensor_parallel_size``). ``etp_size=0`` means
    "not given": expert tensors (if any) are split like the dense ones, by TP.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 0

    def validate(self) -> None:
        """Raise :class:`~mx_refit.errors.InvalidArgument` naming the first bad field."""
        from mx_refit.errors import InvalidArgument

        for axis in ("tp", "pp", "ep", "etp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            for name, value in ((f"{axis}_rank", rank), (f"{axis}_size", size)):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidArgument(f"mesh.{name}: must be an integer, got {value!r}")
            if axis == "etp" and size == 0:  # not given
                if rank:
                    raise InvalidArgument(f"mesh.etp_rank: must be 0 when etp_size is 0, got {rank}")
                continue
            if size < 1:
                raise InvalidArgument(f"mesh.{axis}_size: must be >= 1, got {size}")
            if not 0 <= rank < size:
                raise InvalidArgument(f"mesh.{axis}_rank: must be in [0, {size}), got {rank}")


@dataclass(frozen=True)
class TensorDescriptor:
    """One registered, published tensor (a native shard) as recorded in the catalog.

    ``global_shape`` is the shape of the full (unsharded) tensor; ``local_shape`` the shard the
    source holds, starting at ``shard_offset`` along ``shard_axis`` (``-1`` when not sharded).
    ``addr``/``nbytes`` locate the contiguous bytes inside the source's registered memory.
    """

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    addr: int
    nbytes: int
    role: Role = Role.REPLICATED
    shard_axis: int = -1
    shard_offset: int = 0
    mem_type: MemType = MemType.DRAM
    device_id: int = 0
    extras: dict[str, Any] = field(default_factory=dict)
    # The form the bytes are in (``HF_RAW``: as trained) and what a reader must know about it
    # (string -> string; a reader's TargetLayout.required_metadata must be a subset).
    compile_target: str = HF_RAW
    compile_metadata: dict[str, str] = field(default_factory=dict)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class IpcRegion:
    """One registered CUDA region as a CUDA IPC export: ``handle`` (the 64-byte
    ``cudaIpcMemHandle_t`` of the allocation holding the region, opaque to everyone but CUDA)
    and ``offset``, where the region starts inside that allocation."""

    addr: int
    nbytes: int
    handle: bytes
    offset: int


@dataclass(frozen=True)
class CudaIpcExport:
    """How a reader on the same node maps a source's CUDA regions: the node's identity (boot id
    and host name; both must match the reader's), the exporting process (pid and pid namespace,
    so a reader can tell the source died), the CUDA device (its 16-byte UUID, stable across
    ``CUDA_VISIBLE_DEVICES``) and one :class:`IpcRegion` per registered region."""

    boot_id: str
    host_name: str
    pid: int
    pid_namespace: str
    device_uuid: bytes
    regions: tuple[IpcRegion, ...]


class Mirror(NamedTuple):
    """What a replica source holds: the ``nbytes`` at ``source_addr`` of trainer source
    ``source_id`` (same version) lie at ``addr`` in the replica's registered memory.

    Exact and independent of any layout: a reader of any target layout substitutes the replica
    for the trainer source on every read that falls inside mirrored bytes."""

    source_id: str
    source_addr: int
    nbytes: int
    addr: int


@dataclass(frozen=True)
class BlockChecksums:
    """End-to-end checksums of a source's tensors (``weight_sync.checksums``, see
    :mod:`mx_refit.checksums`): every tensor's bytes are cut into blocks of ``block_bytes`` from
    its first byte (the last block may be shorter), and ``sums`` holds one checksum per block,
    tensor after tensor in the order of :attr:`SourceInfo.tensors`
    (``ceil(nbytes / block_bytes)`` values per tensor)."""

    block_bytes: int
    sums: Sequence[int]  # a PackedSums once validated or decoded from the catalog


class PackedSums(Sequence[int]):
    """Block checksums held as packed little-endian int64 bytes (the catalog's
    ``BlockChecksums.sums_le64``): decoded with one buffer view, never one Python int per block
    unless indexed. A sequence of ints equal to the tuple of the same values; :meth:`array`
    (numpy) and ``device`` (a per-device cache filled by :mod:`mx_refit.checksums`) are made
    once per object, i.e. once per source and version on a reader."""

    __slots__ = ("packed", "_view", "_array", "device")

    def __init__(self, packed: bytes) -> None:
        if len(packed) % 8:
            raise ValueError(f"{len(packed)} bytes is not a multiple of 8")
        self.packed = bytes(packed)
        if sys.byteorder == "little":
            self._view: Sequence[int] = memoryview(self.packed).cast("q")
        else:  # pragma: no cover - big-endian hosts swap once
            swapped = array("q", self.packed)
            swapped.byteswap()
            self._view = swapped
        self._array: Any = None
        self.device: dict[str, Any] = {}

    @classmethod
    def of(cls, values: Iterable[int]) -> "PackedSums":
        """From ints (each an int64; :class:`OverflowError` otherwise)."""
        if isinstance(values, PackedSums):
            return values
        packed = array("q", values)
        if sys.byteorder != "little":  # pragma: no cover
            packed.byteswap()
        return cls(packed.tobytes())

    def array(self) -> Any:
        """A read-only numpy int64 view of the sums (made once)."""
        if self._array is None:
            import numpy as np

            self._array = np.frombuffer(self.packed, dtype="<i8")
        return self._array

    def __len__(self) -> int:
        return len(self.packed) // 8

    def __getitem__(self, index: Any) -> Any:
        got = self._view[index]
        return tuple(got) if isinstance(index, slice) else got

    def __iter__(self) -> Iterator[int]:
        return iter(self._view)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedSums):
            return self.packed == other.packed
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and tuple(self._view) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._view))

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedSums, (self.packed,))

    def __repr__(self) -> str:
        shown = ", ".join(map(str, self[:4]))
        return f"PackedSums([{shown}{', ...' if len(self) > 4 else ''}], n={len(self)})"


class DeltaForm(str, enum.Enum):
    """How one tensor's change since a base version is recorded (layouts: :mod:`mx_refit.delta`)."""

    WHOLE = "whole"  # changed densely: read the tensor itself
    SPARSE = "sparse"  # changed elements: chunk counts, offsets, new bytes
    BLOCKS = "blocks"  # changed 256-byte blocks: a bitmap, then the blocks


@dataclass(frozen=True)
class TensorDelta:
    """One changed tensor of a :class:`SourceDelta`: ``tensor`` indexes ``SourceInfo.tensors``;
    its record is ``nbytes`` at ``offset`` of the delta's record region (0 and 0 for WHOLE)."""

    tensor: int
    form: DeltaForm
    offset: int
    nbytes: int
    changed: int
    narrow: int = 0  # SPARSE: changed elements whose only changed byte is the first


@dataclass(frozen=True)
class SourceDelta:
    """A source's bytes as a change against ``base_version`` of the same source and layout
    (``weight_sync.delta``). ``base_digest`` names the base's checksums
    (:func:`mx_refit.delta.checksums_digest`): a reader applies the delta only onto bytes it
    verified against exactly those. The records live in their own registered region
    ``(addr, nbytes)``, checked by ``record_sums`` (blocks of the source's checksum block size).
    Tensors without an entry did not change."""

    base_version: int
    base_digest: str
    addr: int
    nbytes: int
    tensors: tuple[TensorDelta, ...]
    record_sums: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompileCompat:
    """What a source's compiled bytes depend on (compared by readers for every compile target
    but ``hf_raw``). An empty field is "not stated" and matches anything."""

    framework: str = ""
    torch_version: str = ""
    cuda_version: str = ""
    triton_version: str = ""
    gpu_arch: str = ""
    compile_config_digest: str = ""

    def mismatches(self, other: "CompileCompat") -> list[str]:
        """``"field: mine vs theirs"`` for each field both state and that differs."""
        out = []
        for name in COMPAT_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine and theirs and mine != theirs:
                out.append(f"{name}: {theirs!r} offered, {mine!r} wanted")
        return out


COMPAT_FIELDS = (
    "framework", "torch_version", "cuda_version", "triton_version", "gpu_arch", "compile_config_digest",
)


@dataclass(frozen=True)
class SourceInfo:
    """A publishing process (a trainer rank or a replica) and everything a reader needs of it.

    ``regions`` are the ``(addr, nbytes)`` memory regions the source registered with NIXL. A
    NIXL descriptor must lie inside one registered region, so readers never merge reads across
    a region boundary even when two regions happen to be adjacent in memory (back-to-back
    allocations). Empty: readers treat every tensor as its own region.

    ``incarnation`` identifies the publishing process (unique per process start): a restarted
    rank registers under its predecessor's ``source_id`` with a new incarnation and replaces it.

    ``layout_digest`` is set by the catalog (anything a publisher sends is ignored): a stable
    hash of ``tensors`` and ``regions``, equal exactly when they are. It lets readers recognise
    an unchanged layout without walking it; being derived data, it takes no part in ``==``.

    ``cuda_ipc``: the source's CUDA IPC export (same-node readers copy its CUDA regions device to
    device), or ``None``. It is sent with every reply (handles change when a trainer reallocates
    after a drain, while the layout may not).

    ``checksums``: per-block checksums of the tensors' bytes for this version, or ``None`` (off).
    Like ``cuda_ipc`` it is sent with every reply and is not part of ``layout_digest``: the
    bytes change every version while the layout does not.

    ``lease_fence_s``: the source's promise about leases the catalog may lose (a restart of a
    catalog whose store keeps nothing): once its publisher learns the catalog no longer knows
    it, it leaves its buffers untouched this long before mutating them. A reader whose lease
    TTL is at most every source's fence may then trust its lease's own deadline and release
    without waiting for the catalog's answer (:mod:`mx_refit.receive.lease`). 0: no promise (replicas).
    """

    source_id: str
    mesh: MeshPosition
    agent_name: str
    agent_metadata: bytes
    tensors: tuple[TensorDescriptor, ...]
    ready: bool = False
    regions: tuple[tuple[int, int], ...] = ()
    layout_digest: str = field(default="", compare=False)
    cuda_ipc: CudaIpcExport | None = None
    incarnation: str = ""
    # Set by the catalog like ``layout_digest``: a stable hash of ``agent_metadata`` (which
    # lists every region the agent registered), so an unchanged one stays off the wire.
    agent_metadata_digest: str = field(default="", compare=False)
    checksums: BlockChecksums | None = None
    # A replica source (``weight_sync.fanout: tree``): the trainer sources' bytes it holds, and
    # ``tensors`` is its one registered receive arena (a uint8 buffer). Empty for a trainer rank.
    mirrors: tuple[Mirror, ...] = ()
    lease_fence_s: float = 0.0
    # Content-addressed revision of this version's bytes (same source_id and revision: identical
    # bytes; "" not stated) and what compiled bytes depend on (None: nothing stated). Neither is
    # part of ``layout_digest``: both may change every version while the layout does not.
    revision: str = ""
    compat: CompileCompat | None = None
    # weight_sync.delta: what changed since a base version (None: a full version only).
    delta: SourceDelta | None = None


@dataclass(frozen=True)
class VersionInfo:
    """A version's manifest: all its sources, their descriptors and the model-level sidecar.

    ``sidecar_digest`` is set by the catalog: a stable hash of the merged sidecar (like
    :attr:`SourceInfo.layout_digest`, derived data that takes no part in ``==``).
    """

    model: str
    version: int
    state: VersionState
    expected_sources: int
    sources: tuple[SourceInfo, ...]
    sidecar: dict[str, Any] = field(default_factory=dict)
    sidecar_digest: str = field(default="", compare=False)
    # Ready replica sources (fan-out): never counted in ``expected_sources``, no mesh position.
    replicas: tuple[SourceInfo, ...] = field(default=(), compare=False)
    # Live leases reading each source (trainer or replica), as of this reply: how a reader
    # spreads over the holders under a per-source reader cap.
    readers: dict[str, int] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class TargetLayout:
    """The layout a receiver (an inference worker) needs.

    ``full_tensors=True`` asks for whole HF tensors (the engine's loader shards them itself);
    otherwise only this rank's TP/EP slice of each HF tensor is planned and pulled, except for
    HF names that start with one of ``whole_prefixes``: those arrive whole (an engine that can
    place its own slice of most tensors but not of these, e.g. one layer kind it cannot prove).
    A fused source tensor (Megatron's QKV, gate/up) arrives whole when any of its names does.

    ``compile_targets``: the forms the receiver's engine loads (a whitelist; default ``hf_raw``
    only). ``required_metadata``: ``(key, value)`` pairs every tensor of a non-``hf_raw`` target
    must carry in its ``compile_metadata`` (subset rule; a dict is accepted and kept sorted).
    ``compat``: the receiver's runtime, compared with each source's for every target but
    ``hf_raw`` (None: not compared). Discovery refuses a version that cannot satisfy them
    (:func:`mx_refit.compile_targets.check_compile_targets`).
    """

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    full_tensors: bool = True
    compile_targets: tuple[str, ...] = (HF_RAW,)
    required_metadata: tuple[tuple[str, str], ...] = ()
    compat: CompileCompat | None = None
    whole_prefixes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Hashable whatever the caller passed: plans are cached by the target layout.
        if not isinstance(self.compile_targets, tuple):
            targets = (self.compile_targets,) if isinstance(self.compile_targets, str) else self.compile_targets
            object.__setattr__(self, "compile_targets", tuple(targets))
        metadata = self.required_metadata
        if isinstance(metadata, Mapping) or not isinstance(metadata, tuple):
            items = metadata.items() if isinstance(metadata, Mapping) else metadata
            object.__setattr__(self, "required_metadata", tuple(sorted((str(k), str(v)) for k, v in items)))

    def receives_whole(self, hf_names: "list[str] | tuple[str, ...]") -> bool:
        """Whether tensors with these HF names are received whole."""
        if self.full_tensors:
            return True
        prefixes = self.whole_prefixes
        return bool(prefixes) and any(n.startswith(prefixes) for n in hf_names)


@dataclass
class PublishedTensor:
    """What a trainer-side collector hands the publisher: a live tensor plus its shard geometry.

    The tensor is registered in place (never copied); it must be contiguous.
    """

    name: str
    tensor: "torch.Tensor"
    role: Role = Role.REPLICATED
    global_shape: tuple[int, ...] | None = None  # None: same as the local shape
    shard_axis: int = -1
    shard_offset: int = 0
    extras: dict[str, Any] = field(default_factory=dict)
    # The form of the bytes (HF_RAW: as trained) and its metadata (see TensorDescriptor).
    compile_target: str = HF_RAW
    compile_metadata: dict[str, str] = field(default_factory=dict)


class ReadOp(NamedTuple):
    """One contiguous byte range: ``nbytes`` at ``remote_addr`` of a source land at
    ``local_offset`` of the receiver's arena.

    A NamedTuple (immutable, built in C): a sliced MoE plan holds ~19k of them, and a frozen
    dataclass's ``__init__`` made building them a quarter of planning time."""

    source_id: str
    remote_addr: int
    nbytes: int
    local_offset: int


@dataclass(frozen=True)
class RefitStats:
    """What one refit cycle moved and how long it took (reported to ``mx_refit_refit_done``)."""

    model: str
    version: int
    tensors: int
    bytes_pulled: int
    bytes_needed: int
    descriptors: int
    seconds: float
    new_registrations: int
    sources: int
    plan_seconds: float = 0.0  # planning + coalescing; ~0 once the layout is cached
    transport: str = "nixl"  # the path the bytes took: "nixl", "cuda_ipc" or "mixed"
    handles_opened: int = 0  # CUDA IPC handles opened this cycle (0 once they are cached)
    blocks_verified: int = 0  # checksum blocks verified (weight_sync.checksums; 0 when off)
    kind: str = "full"  # "delta": only the changes since the version held were pulled (weight_sync.delta)
    bytes_changed: int = 0  # delta refits: bytes of this receiver's arena the delta changed
    delta_refused: str = ""  # weight_sync.delta auto and a full refit: why not a delta
    # weight_sync.delta auto: the estimates the choice was made from (0 before one was possible)
    full_estimate_s: float = 0.0
    delta_estimate_s: float = 0.0
    # Wall seconds per step of the cycle (discover, plan, lease, heartbeat_start, pull, release,
    # materialize, load): where a whole refit spends what its pull does not. "lease" is ~0 when
    # the catalog found and leased the version in one call (counted in "discover").
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # Fan-out: how many of the sources read from were replicas (0 without fan-out).
    replicas_read: int = 0
    # Sources that failed mid-pull and whose ranges were read from other holders instead, and
    # the bytes read again for that (0 and () when nothing failed).
    failed_over: tuple[str, ...] = ()
    bytes_reread: int = 0
    # How the lease was known held for the whole pull: "catalog" (the release's answer was
    # waited for) or "deadline" (its local bound, under the sources' fences; sent after).
    lease_confirmed_by: str = "catalog"
    # The version's compiled target (mx_refit.compile_targets): "hf_raw", or e.g. "fp8_block".
    compile_target: str = HF_RAW
    # weight_sync.receive_mode: "staged" (the whole version in the receive arena first) or
    # "direct" (into the parameters through a bounded buffer, in ``chunks`` pulls).
    receive_mode: str = "staged"
    chunks: int = 1
    # Bytes the receiver allocated to receive into, outside the engine's parameters: the arena
    # (staged) or the bounce buffer (direct, at most receive_buffer_bytes).
    receive_memory_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_pulled / self.seconds / 1e9 if self.seconds > 0 else 0.0
