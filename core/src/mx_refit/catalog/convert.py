"""Conversions between catalog protobuf messages and :mod:`mx_refit.types` domain objects.

Free-form data (descriptor ``extras``, sidecars) travels as canonical JSON text so that ints
(of any size), floats (exactly, via their shortest repr), strings, bools, ``None``, lists and
nested dicts round-trip unchanged; tuples arrive as lists. An empty string stands for ``{}``.

Malformed input in either direction raises :class:`~mx_refit.errors.InvalidArgument` naming the
field. Semantic validation (shapes, sizes, consistency) is the service's job, not this module's.

GetVersion replies may leave out a source's tensors and regions, or the sidecar, that the reader
announced it holds (by digest, see :mod:`mx_refit.catalog.digests`): :func:`manifest_to_proto`
decides what to leave out, :func:`version_info_from_proto` completes a reply from the reader's
:class:`~mx_refit.catalog.digests.Known` snapshot.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

from google.protobuf.message import Message

from mx_refit.catalog._records import Manifest
from mx_refit.catalog.api import ReadProgress, VersionSummary
from mx_refit.catalog.digests import NOTHING_KNOWN, Known, UnknownDigest
from mx_refit.catalog.v1 import catalog_pb2 as pb
from mx_refit.catalog.validation import json_text, to_json_value
from mx_refit.errors import InvalidArgument
from mx_refit.types import (
    COMPAT_FIELDS,
    HF_RAW,
    BlockChecksums,
    CompileCompat,
    CudaIpcExport,
    DeltaForm,
    IpcRegion,
    MemType,
    MeshPosition,
    Mirror,
    PackedSums,
    Role,
    SourceDelta,
    SourceInfo,
    TensorDelta,
    TensorDescriptor,
    VersionInfo,
    VersionState,
)

__all__ = [
    "delta_from_proto",
    "read_progress_from_proto",
    "request_message",
    "descriptor_from_proto",
    "descriptor_to_proto",
    "json_from_text",
    "json_to_text",
    "manifest_to_proto",
    "mesh_from_proto",
    "mesh_to_proto",
    "source_from_proto",
    "source_to_proto",
    "state_from_proto",
    "state_to_proto",
    "summary_from_proto",
    "summary_to_proto",
    "version_info_from_proto",
    "version_info_to_proto",
]

# Proto enum values are the domain member names with a prefix (ROLE_COLUMN <-> Role.COLUMN).
_ROLE_TO_PB: dict[Role, pb.Role] = {m: getattr(pb, f"ROLE_{m.name}") for m in Role}
_MEM_TO_PB: dict[MemType, pb.MemType] = {m: getattr(pb, f"MEM_TYPE_{m.name}") for m in MemType}
_STATE_TO_PB: dict[VersionState, pb.VersionState] = {
    m: getattr(pb, f"VERSION_STATE_{m.name}") for m in VersionState
}
_ROLE_FROM_PB: dict[int, Role] = {v: k for k, v in _ROLE_TO_PB.items()}
_MEM_FROM_PB: dict[int, MemType] = {v: k for k, v in _MEM_TO_PB.items()}
_STATE_FROM_PB: dict[int, VersionState] = {v: k for k, v in _STATE_TO_PB.items()}


def _to_pb[E: enum.Enum, P: int](
    table: Mapping[E, P], cls: type[E], value: object, field: str
) -> P:
    try:
        return table[cls(value)]
    except (ValueError, KeyError):
        allowed = ", ".join(str(m.value) for m in cls)
        raise InvalidArgument(
            f"{field}: unknown value {value!r}; expected one of {allowed}"
        ) from None


def _from_pb[E: enum.Enum](table: Mapping[int, E], value: int, field: str) -> E:
    member = table.get(value)
    if member is None:
        raise InvalidArgument(f"{field}: unknown or unspecified enum value {value}")
    return member


def state_to_proto(state: VersionState) -> pb.VersionState:
    """``VersionState`` -> ``pb.VersionState`` value."""
    return _to_pb(_STATE_TO_PB, VersionState, state, "state")


def state_from_proto(value: int, field: str = "state") -> VersionState:
    """``pb.VersionState`` value -> ``VersionState``."""
    return _from_pb(_STATE_FROM_PB, value, field)


def json_to_text(value: Mapping[str, Any] | None, field: str) -> str:
    """Encode a JSON-typed mapping; ``""`` for empty/None (the proto default)."""
    if value is None:
        return ""
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{field}: must be a mapping, got {type(value).__name__}")
    if not value:
        return ""
    return json_text(to_json_value(value, field))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def json_from_text(text: str, field: str) -> dict[str, Any]:
    """Decode a JSON object sent by :func:`json_to_text` (``""`` is ``{}``)."""
    if not text:
        return {}
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise InvalidArgument(f"{field}: invalid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field}: expected a JSON object, got {type(value).__name__}")
    return value


def mesh_to_proto(mesh: MeshPosition) -> pb.MeshPosition:
    """``MeshPosition`` -> message."""
    return pb.MeshPosition(
        tp_rank=mesh.tp_rank,
        tp_size=mesh.tp_size,
        pp_rank=mesh.pp_rank,
        pp_size=mesh.pp_size,
        ep_rank=mesh.ep_rank,
        ep_size=mesh.ep_size,
        etp_rank=mesh.etp_rank,
        etp_size=mesh.etp_size,
    )


def mesh_from_proto(msg: pb.MeshPosition) -> MeshPosition:
    """Message -> ``MeshPosition`` (not validated)."""
    return MeshPosition(
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size,
        pp_rank=msg.pp_rank,
        pp_size=msg.pp_size,
        ep_rank=msg.ep_rank,
        ep_size=msg.ep_size,
        etp_rank=msg.etp_rank,
        etp_size=msg.etp_size,
    )


def _fill_descriptor(msg: pb.TensorDescriptor, desc: TensorDescriptor, field: str) -> None:
    # str-valued enums hash and compare like their values, so "column" finds Role.COLUMN too.
    role = _ROLE_TO_PB.get(desc.role)
    if role is None:
        role = _to_pb(_ROLE_TO_PB, Role, desc.role, f"{field}.role")
    mem_type = _MEM_TO_PB.get(desc.mem_type)
    if mem_type is None:
        mem_type = _to_pb(_MEM_TO_PB, MemType, desc.mem_type, f"{field}.mem_type")
    try:
        msg.name = desc.name
        msg.dtype = desc.dtype
        msg.global_shape.extend(desc.global_shape)
        msg.local_shape.extend(desc.local_shape)
        msg.addr = desc.addr
        msg.nbytes = desc.nbytes
        msg.role = role
        msg.shard_axis = desc.shard_axis
        msg.shard_offset = desc.shard_offset
        msg.mem_type = mem_type
        msg.device_id = desc.device_id
    except (TypeError, ValueError) as exc:  # wrong type, or out of the int64/int32 range
        raise InvalidArgument(f"{field}: cannot encode descriptor {desc.name!r}: {exc}") from None
    extras = desc.extras
    if type(extras) is not dict and not isinstance(extras, Mapping):
        raise InvalidArgument(f"{field}.extras: must be a mapping, got {type(extras).__name__}")
    if extras:
        msg.extras_json = json_to_text(extras, f"{field}.extras")
    target = desc.compile_target
    if target != HF_RAW:  # the default stays off the wire: old payloads are byte-identical
        try:
            msg.compile_target = target
            if desc.compile_metadata:
                msg.compile_metadata.update(desc.compile_metadata)
        except (TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgument(f"{field}.compile_metadata: cannot encode {desc.compile_metadata!r}: {exc}") from None
    elif desc.compile_metadata:
        raise InvalidArgument(
            f"{field}.compile_metadata: {desc.compile_metadata!r} given for tensor {desc.name!r} "
            f"of compile target {HF_RAW!r}, which takes none"
        )


def descriptor_to_proto(desc: TensorDescriptor, field: str = "tensor") -> pb.TensorDescriptor:
    """``TensorDescriptor`` -> message."""
    msg = pb.TensorDescriptor()
    _fill_descriptor(msg, desc, field)
    return msg


def descriptor_from_proto(msg: pb.TensorDescriptor, field: str = "tensor") -> TensorDescriptor:
    """Message -> ``TensorDescriptor`` (not validated)."""
    role = _ROLE_FROM_PB.get(msg.role)
    if role is None:
        role = _from_pb(_ROLE_FROM_PB, msg.role, f"{field}.role")
    mem_type = _MEM_FROM_PB.get(msg.mem_type)
    if mem_type is None:
        mem_type = _from_pb(_MEM_FROM_PB, msg.mem_type, f"{field}.mem_type")
    extras = msg.extras_json
    return TensorDescriptor(
        name=msg.name,
        dtype=msg.dtype,
        global_shape=tuple(msg.global_shape),
        local_shape=tuple(msg.local_shape),
        addr=msg.addr,
        nbytes=msg.nbytes,
        role=role,
        shard_axis=msg.shard_axis,
        shard_offset=msg.shard_offset,
        mem_type=mem_type,
        device_id=msg.device_id,
        extras=json_from_text(extras, f"{field}.extras") if extras else {},
        compile_target=msg.compile_target or HF_RAW,
        compile_metadata=dict(msg.compile_metadata) if msg.compile_metadata else {},
    )


def source_to_proto(
    source: SourceInfo, msg: pb.SourceInfo | None = None, *, omit_tensors: bool = False,
    omit_metadata: bool = False,
) -> pb.SourceInfo:
    """``SourceInfo`` -> message (filled into ``msg`` when given); ``omit_tensors`` leaves
    tensors, regions and the CUDA IPC export (all three covered by the layout digest) out and
    says so (``tensors_omitted``); ``omit_metadata`` the agent metadata (``agent_metadata_omitted``)."""
    msg = pb.SourceInfo() if msg is None else msg
    if not isinstance(source, SourceInfo):
        raise InvalidArgument(f"source: expected a SourceInfo, got {type(source).__name__}")
    try:
        msg.source_id = source.source_id
        msg.mesh.CopyFrom(mesh_to_proto(source.mesh))
        msg.agent_name = source.agent_name
        if omit_metadata and source.agent_metadata_digest:
            msg.agent_metadata_omitted = True
        else:
            msg.agent_metadata = bytes(source.agent_metadata)
        msg.agent_metadata_digest = source.agent_metadata_digest
        msg.ready = source.ready
        msg.layout_digest = source.layout_digest
        msg.incarnation = source.incarnation
        msg.lease_fence_s = source.lease_fence_s
        msg.revision = source.revision
        if source.compat is not None:
            msg.compat.SetInParent()
            for name in COMPAT_FIELDS:
                setattr(msg.compat, name, getattr(source.compat, name))
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidArgument(f"source: cannot encode source {source.source_id!r}: {exc}") from None
    if source.cuda_ipc is not None and not (omit_tensors and source.layout_digest):
        _fill_cuda_ipc(msg.cuda_ipc, source.cuda_ipc)  # else in the digested layout the reader holds
    if source.checksums is not None:  # sent also when the layout is omitted: it changes every version
        try:
            msg.checksums.block_bytes = source.checksums.block_bytes
            msg.checksums.sums_le64 = PackedSums.of(source.checksums.sums).packed  # no int per block
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise InvalidArgument(f"source.checksums: cannot encode: {exc}") from None
    if source.delta is not None:  # sent also when the layout is omitted: it changes every version
        _fill_delta(msg.delta, source.delta)
    for index, mirror in enumerate(source.mirrors):
        try:
            msg.mirrors.add(source_id=mirror[0], source_addr=mirror[1], nbytes=mirror[2], addr=mirror[3])
        except (TypeError, ValueError, IndexError) as exc:
            raise InvalidArgument(f"source.mirrors[{index}]: {mirror!r}: {exc}") from None
    if omit_tensors:
        msg.tensors_omitted = True
        return msg
    for index, desc in enumerate(source.tensors):
        _fill_descriptor(msg.tensors.add(), desc, f"source.tensors[{index}]")
    for index, (addr, nbytes) in enumerate(source.regions):
        try:
            msg.regions.add(addr=addr, nbytes=nbytes)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"source.regions[{index}]: ({addr!r}, {nbytes!r}): {exc}") from None
    return msg


def source_from_proto(
    msg: pb.SourceInfo, field: str = "source", known: Known | None = None
) -> SourceInfo:
    """Message -> ``SourceInfo`` (not validated).

    ``known`` is given for GetVersion replies: a source whose ``layout_digest`` the reader holds
    takes the held tensors, regions and CUDA IPC export (decoding nothing, whether or not they were sent); one
    left out with a digest the reader does not hold raises :class:`UnknownDigest`. Without
    ``known`` (a registration), a source may not leave anything out.
    """
    digest = msg.layout_digest
    layout = known.layouts.get(digest) if known is not None and digest else None
    metadata = _held_metadata(msg, field, known) if msg.agent_metadata_omitted else msg.agent_metadata
    if layout is not None and (layout.cuda_ipc is not None or msg.tensors_omitted):
        cuda_ipc = layout.cuda_ipc  # the held (identical) object: later checks are identity
    else:
        cuda_ipc = cuda_ipc_from_proto(msg.cuda_ipc) if msg.HasField("cuda_ipc") else None
    if layout is not None:
        tensors, regions = layout.tensors, layout.regions
    elif msg.tensors_omitted:
        if known is None:
            raise InvalidArgument(
                f"{field}.tensors_omitted: only GetVersion replies may leave tensors out"
            )
        raise UnknownDigest(
            f"{field}: the catalog left out the tensors of source {msg.source_id!r} (layout "
            f"{digest or '<no digest>'}), which this reader does not hold"
        )
    else:
        tensors = tuple(
            descriptor_from_proto(desc, f"{field}.tensors[{i}]")
            for i, desc in enumerate(msg.tensors)
        )
        regions = tuple((r.addr, r.nbytes) for r in msg.regions)
    return SourceInfo(
        source_id=msg.source_id,
        mesh=mesh_from_proto(msg.mesh),
        agent_name=msg.agent_name,
        agent_metadata=metadata,
        tensors=tensors,
        ready=msg.ready,
        regions=regions,
        layout_digest=digest,
        incarnation=msg.incarnation,
        agent_metadata_digest=msg.agent_metadata_digest,
        cuda_ipc=cuda_ipc,
        checksums=checksums_from_proto(msg.checksums, f"{field}.checksums") if msg.HasField("checksums") else None,
        mirrors=tuple(Mirror(m.source_id, m.source_addr, m.nbytes, m.addr) for m in msg.mirrors),
        lease_fence_s=msg.lease_fence_s,
        revision=msg.revision,
        compat=(
            CompileCompat(**{name: getattr(msg.compat, name) for name in COMPAT_FIELDS})
            if msg.HasField("compat") else None
        ),
        delta=delta_from_proto(msg.delta) if msg.HasField("delta") else None,
    )


def _held_metadata(msg: pb.SourceInfo, field: str, known: Known | None) -> bytes:
    """The agent metadata a reply left out, from what the reader holds (by digest)."""
    if known is None:
        raise InvalidArgument(f"{field}.agent_metadata_omitted: only GetVersion replies may leave it out")
    digest = msg.agent_metadata_digest
    held = known.metadata.get(digest) if digest else None
    if held is None:
        raise UnknownDigest(
            f"{field}: the catalog left out the agent metadata of source {msg.source_id!r} "
            f"({digest or '<no digest>'}), which this reader does not hold"
        )
    return held


def checksums_from_proto(msg: pb.BlockChecksums, field: str) -> BlockChecksums:
    """The packed form (``sums_le64``) with one buffer view when set, else the older repeated
    ``sums`` (packed once here, so every later use is the same)."""
    packed = msg.sums_le64
    if packed:
        if len(packed) % 8:
            raise InvalidArgument(f"{field}.sums_le64: {len(packed)} bytes, not a multiple of 8 (one int64 per block)")
        return BlockChecksums(msg.block_bytes, PackedSums(packed))
    return BlockChecksums(msg.block_bytes, PackedSums.of(msg.sums))


_DELTA_FORMS = {
    DeltaForm.WHOLE: pb.DELTA_FORM_WHOLE,
    DeltaForm.SPARSE: pb.DELTA_FORM_SPARSE,
    DeltaForm.BLOCKS: pb.DELTA_FORM_BLOCKS,
}
_DELTA_FORMS_BACK = {v: k for k, v in _DELTA_FORMS.items()}


def _fill_delta(msg: pb.SourceDelta, delta: SourceDelta) -> None:
    try:
        msg.base_version = delta.base_version
        msg.base_digest = delta.base_digest
        msg.addr = delta.addr
        msg.nbytes = delta.nbytes
        msg.record_sums.extend(delta.record_sums)
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidArgument(f"source.delta: cannot encode: {exc}") from None
    for index, entry in enumerate(delta.tensors):
        try:
            msg.tensors.add(
                tensor=entry.tensor, form=_DELTA_FORMS[DeltaForm(entry.form)], offset=entry.offset,
                nbytes=entry.nbytes, changed=entry.changed, narrow=entry.narrow,
            )
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidArgument(f"source.delta.tensors[{index}]: {entry!r}: {exc}") from None


def delta_from_proto(msg: pb.SourceDelta) -> SourceDelta:
    """Message -> ``SourceDelta`` (not validated; an unknown form is kept as its number and
    refused by validation)."""
    return SourceDelta(
        base_version=msg.base_version,
        base_digest=msg.base_digest,
        addr=msg.addr,
        nbytes=msg.nbytes,
        tensors=tuple(
            TensorDelta(t.tensor, _DELTA_FORMS_BACK.get(t.form, t.form), t.offset, t.nbytes,  # type: ignore[arg-type]
                        t.changed, t.narrow)
            for t in msg.tensors
        ),
        record_sums=tuple(msg.record_sums),
    )


def _fill_cuda_ipc(msg: pb.CudaIpcExport, export: CudaIpcExport) -> None:
    try:
        msg.boot_id = export.boot_id
        msg.host_name = export.host_name
        msg.pid = export.pid
        msg.pid_namespace = export.pid_namespace
        msg.device_uuid = bytes(export.device_uuid)
        for region in export.regions:
            msg.regions.add(addr=region.addr, nbytes=region.nbytes, handle=bytes(region.handle),
                            offset=region.offset)
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidArgument(f"source.cuda_ipc: cannot encode {export!r}: {exc}") from None


def cuda_ipc_from_proto(msg: pb.CudaIpcExport) -> CudaIpcExport:
    """Message -> ``CudaIpcExport`` (not validated)."""
    return CudaIpcExport(
        boot_id=msg.boot_id,
        host_name=msg.host_name,
        pid=msg.pid,
        pid_namespace=msg.pid_namespace,
        device_uuid=msg.device_uuid,
        regions=tuple(IpcRegion(r.addr, r.nbytes, r.handle, r.offset) for r in msg.regions),
    )


def version_info_to_proto(info: VersionInfo) -> pb.VersionInfo:
    """``VersionInfo`` -> message (everything included)."""
    msg = pb.VersionInfo(
        model=info.model,
        version=info.version,
        state=state_to_proto(info.state),
        expected_sources=info.expected_sources,
        sidecar_json=json_to_text(info.sidecar, "sidecar"),
        sidecar_digest=info.sidecar_digest,
    )
    for source in info.sources:
        source_to_proto(source, msg.sources.add())
    for replica in info.replicas:
        source_to_proto(replica, msg.replicas.add())
    msg.readers.update(info.readers)
    return msg


def manifest_to_proto(
    manifest: Manifest,
    known_layouts: Mapping[str, str],
    known_sidecar: str,
    msg: pb.VersionInfo | None = None,
    known_metadata: Mapping[str, str] | None = None,
) -> pb.VersionInfo:
    """A served version -> message (filled into ``msg`` when given), leaving out what the
    reader holds: the tensors of each source whose ``layout_digest`` equals the reader's for
    that source id (``known_layouts``), its agent metadata likewise (``known_metadata``), and
    the sidecar when its digest is ``known_sidecar``.
    """
    msg = pb.VersionInfo() if msg is None else msg
    msg.model = manifest.model
    msg.version = manifest.version
    msg.state = state_to_proto(manifest.state)
    msg.expected_sources = manifest.expected_sources
    msg.sidecar_digest = manifest.sidecar_digest
    if known_sidecar and known_sidecar == manifest.sidecar_digest:
        msg.sidecar_omitted = True
    elif manifest.sidecar_text != "{}":  # "" stands for {} on the wire
        msg.sidecar_json = manifest.sidecar_text  # already canonical: no re-encoding
    for source in manifest.sources:
        digest = source.layout_digest
        omit = bool(digest) and known_layouts.get(source.source_id) == digest
        held = known_metadata.get(source.source_id) if known_metadata else None
        source_to_proto(source, msg.sources.add(), omit_tensors=omit,
                        omit_metadata=bool(held) and held == source.agent_metadata_digest)
    for replica in manifest.replicas:  # small (one arena each) and short-lived: always whole
        source_to_proto(replica, msg.replicas.add())
    if manifest.readers:
        msg.readers.update(manifest.readers)
    return msg


def version_info_from_proto(msg: pb.VersionInfo, known: Known | None = None) -> VersionInfo:
    """Message -> ``VersionInfo``, completed from ``known`` where the reply left parts out
    (:class:`UnknownDigest` when ``known`` lacks one of them)."""
    digest = msg.sidecar_digest
    sidecar = (known or NOTHING_KNOWN).sidecars.get(digest) if digest else None
    if sidecar is None:
        if msg.sidecar_omitted:
            raise UnknownDigest(
                f"sidecar: the catalog left out sidecar {digest or '<no digest>'}, which this "
                "reader does not hold"
            )
        sidecar = json_from_text(msg.sidecar_json, "sidecar")
    return VersionInfo(
        model=msg.model,
        version=msg.version,
        state=state_from_proto(msg.state),
        expected_sources=msg.expected_sources,
        sources=tuple(
            source_from_proto(src, f"sources[{i}]", known or NOTHING_KNOWN)
            for i, src in enumerate(msg.sources)
        ),
        sidecar=sidecar,
        sidecar_digest=digest,
        replicas=tuple(source_from_proto(r, f"replicas[{i}]") for i, r in enumerate(msg.replicas)),
        readers=dict(msg.readers),
    )


def summary_to_proto(summary: VersionSummary) -> pb.VersionSummary:
    """``VersionSummary`` -> message."""
    return pb.VersionSummary(
        model=summary.model,
        version=summary.version,
        state=state_to_proto(summary.state),
        expected_sources=summary.expected_sources,
        registered_sources=summary.registered_sources,
        ready_sources=summary.ready_sources,
        leases=summary.leases,
        expected_readers=summary.expected_readers,
        completed_reads=summary.completed_reads,
    )


def summary_from_proto(msg: pb.VersionSummary) -> VersionSummary:
    """Message -> ``VersionSummary``."""
    return VersionSummary(
        model=msg.model,
        version=msg.version,
        state=state_from_proto(msg.state),
        expected_sources=msg.expected_sources,
        registered_sources=msg.registered_sources,
        ready_sources=msg.ready_sources,
        leases=msg.leases,
        expected_readers=msg.expected_readers,
        completed_reads=msg.completed_reads,
    )


def request_message(cls: type[Message], **fields: Any) -> Any:
    """Build a request message; a field of the wrong type or out of its wire range (int32,
    int64) is the caller's InvalidArgument naming the field and the value."""
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        for name, value in fields.items():
            try:
                cls(**{name: value})
            except (TypeError, ValueError) as field_exc:
                raise InvalidArgument(
                    f"{name}: {value!r} is not valid in {cls.__name__} ({field_exc})"
                ) from None
        raise InvalidArgument(f"{cls.__name__}: {exc}") from None


def read_progress_from_proto(reply: pb.WaitReadReply) -> ReadProgress:
    return ReadProgress(
        done=reply.done,
        expected_readers=reply.expected_readers,
        completed_readers=tuple(reply.completed_readers),
    )
