"""Request validation and normalisation for the catalog (pure functions, no grpc).

Everything here either returns a normalised copy (plain ``int`` shapes, enum members, JSON data
copied into plain ``dict``/``list``/scalars) or raises :class:`~mx_refit.errors.InvalidArgument`
whose message names the field and the offending value. The service calls these before it takes
its lock, so a rejected request never touches catalog state.
"""

from __future__ import annotations

import bisect
import json
import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mx_refit.checks import check_flag, check_name  # check_name: re-exported for the catalog
from mx_refit.checksums import validate_checksums
from mx_refit.compile_targets import (
    validate_compat,
    validate_compile_metadata,
    validate_compile_target,
    validate_revision,
)
from mx_refit.delta import validate_delta
from mx_refit.errors import InvalidArgument
from mx_refit.types import (
    DTYPE_SIZES,
    HF_RAW,
    CudaIpcExport,
    IpcRegion,
    MemType,
    MeshPosition,
    Role,
    SourceInfo,
    TensorDescriptor,
)

__all__ = [
    "CatalogLimits",
    "check_int",
    "check_name",
    "check_seconds",
    "check_token",
    "describe_mesh",
    "find_sidecar_conflict",
    "json_text",
    "merge_sidecar",
    "same_json",
    "to_json_value",
    "validate_descriptor",
    "validate_sidecar",
    "validate_source",
]

MiB = 1 << 20
_MAX_JSON_DEPTH = 64  # deeper nesting is a bug, and would hit Python's recursion limit


@dataclass(frozen=True)
class CatalogLimits:
    """Size and time bounds the catalog enforces (see docs/design.md "Limits")."""

    max_agent_metadata_bytes: int = 16 * MiB
    max_descriptors_per_source: int = 1_000_000
    max_sidecar_bytes: int = 64 * MiB  # of the sidecar's JSON encoding (UTF-8)
    max_expected_sources: int = 1 << 20
    max_expected_readers: int = 1 << 20
    max_ttl_s: float = 24 * 3600.0
    max_wait_s: float = 3600.0  # longest single wait_drained call
    max_watched_sources: int = 1 << 16  # a heartbeat's watch_source_ids


def check_int(value: object, field: str, *, minimum: int | None = None) -> int:
    """An integer (bools rejected: ``True`` as a shard axis is a bug, not a 1)."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{field}: must be an integer, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{field}: must be an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise InvalidArgument(f"{field}: {number} is below the minimum of {minimum}")
    return number


def check_seconds(value: object, field: str, *, maximum: float, allow_zero: bool = False) -> float:
    """A finite duration in seconds, > 0 (or >= 0) and <= ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{field}: must be a number of seconds, got {value!r}")
    seconds = float(value)
    low_ok = seconds >= 0 if allow_zero else seconds > 0
    if not math.isfinite(seconds) or not low_ok or seconds > maximum:
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgument(f"{field}: {value!r} must be {bound} and <= {maximum:g} seconds")
    return seconds


def check_token(token: object) -> str | None:
    """A bearer token: None, or a non-empty printable string without whitespace."""
    if token is None:
        return None
    if (
        not isinstance(token, str)
        or not token
        or not token.isprintable()
        or any(c.isspace() for c in token)
    ):
        raise InvalidArgument("token: must be a non-empty printable string without whitespace")
    return token


# --- JSON-typed data (descriptor extras, sidecars) ----------------------------------------------


def _json_path(path: list[str | int]) -> str:
    head, *rest = path
    return str(head) + "".join(f"[{json.dumps(key)}]" for key in rest)


def _normalize(value: Any, path: list[str | int]) -> Any:
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:  # fast path: exact types
        return value
    if kind is float and math.isfinite(value):
        return value
    # Slow path: subclasses and numpy scalars (Integral/Real, but not int/float).
    if isinstance(value, str):
        return str.__str__(value)  # a str subclass (a str enum) -> its plain string, as in JSON
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        if not math.isfinite(number):
            raise InvalidArgument(
                f"{_json_path(path)}: {number!r} is not a finite number (JSON has no NaN/Infinity)"
            )
        return number
    if len(path) > _MAX_JSON_DEPTH:
        raise InvalidArgument(
            f"{_json_path(path[:3])}: nested deeper than {_MAX_JSON_DEPTH} levels"
        )
    if kind is dict or isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for raw_key, item in value.items():
            if not isinstance(raw_key, str):
                raise InvalidArgument(
                    f"{_json_path(path)}: key {raw_key!r} is not a string "
                    "(JSON object keys are strings)"
                )
            key = str.__str__(raw_key)
            path.append(key)
            out[key] = _normalize(item, path)
            path.pop()
        return out
    if kind is list or kind is tuple or isinstance(value, (list, tuple)):
        items = []
        for index, item in enumerate(value):
            path.append(index)
            items.append(_normalize(item, path))
            path.pop()
        return items
    raise InvalidArgument(
        f"{_json_path(path)}: {type(value).__name__} value {_short(value)} is not JSON-typed "
        "(use None, bool, int, float, str, list or dict)"
    )


def to_json_value(value: Any, field: str) -> Any:
    """A normalised deep copy of JSON-typed ``value`` (tuples become lists).

    Floats must be finite and dict keys strings, so that the value round-trips exactly through
    :func:`json_text` and ``json.loads`` (what the gRPC transport does).
    """
    return _normalize(value, [field])


def json_text(value: Any) -> str:
    """Canonical compact JSON encoding of an already normalised value."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def same_json(a: Any, b: Any) -> bool:
    """Type-strict equality of normalised JSON values (``1``, ``1.0`` and ``True`` differ)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = json_text(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate_sidecar(sidecar: Mapping[str, Any] | None, limits: CatalogLimits) -> dict[str, Any]:
    """Normalise a sidecar (``None`` means ``{}``) and enforce the size limit."""
    if sidecar is None:
        return {}
    if not isinstance(sidecar, Mapping):
        raise InvalidArgument(f"sidecar: must be a mapping, got {type(sidecar).__name__}")
    value: dict[str, Any] = to_json_value(sidecar, "sidecar")
    size = len(json_text(value).encode())
    if size > limits.max_sidecar_bytes:
        raise InvalidArgument(
            f"sidecar: {size} bytes of JSON exceeds the limit of {limits.max_sidecar_bytes} bytes"
        )
    return value


def find_sidecar_conflict(
    merged: Mapping[str, Any], extra: Mapping[str, Any], source_id: str, path: str = "sidecar"
) -> str | None:
    """Describe the first key where ``extra`` contradicts ``merged``, or None if they merge.

    Nested mappings are unioned (EP ranks each know only their experts' ``hf_name_map``
    entries); any other value must be identical.
    """
    for key, new in extra.items():
        if key not in merged:
            continue
        old, where = merged[key], f"{path}[{json.dumps(key)}]"
        if isinstance(old, dict) and isinstance(new, dict):
            conflict = find_sidecar_conflict(old, new, source_id, where)
            if conflict:
                return conflict
        elif not same_json(old, new):
            return (
                f"{where}: {_short(new)} from source {source_id!r} conflicts with {_short(old)} "
                "registered by another source"
            )
    return None


def merge_sidecar(merged: dict[str, Any], extra: Mapping[str, Any]) -> None:
    """Merge ``extra`` into ``merged`` in place (call after :func:`find_sidecar_conflict`)."""
    for key, new in extra.items():
        old = merged.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            merge_sidecar(old, new)
        elif key not in merged:
            merged[key] = to_json_value(new, "sidecar")  # a private copy: the source keeps its own


# --- sources and descriptors --------------------------------------------------------------------


def _at(index: int) -> str:
    return f"source.tensors[{index}]"


def _int_attr(value: object, index: int, attr: str, minimum: int | None = None) -> int:
    # Fast path first: validation runs once per descriptor, up to a million times a request,
    # so field names are only formatted when there is an error to report.
    if type(value) is int and (minimum is None or value >= minimum):
        return value
    return check_int(value, f"{_at(index)}.{attr}", minimum=minimum)


def _shape(value: object, index: int, attr: str) -> tuple[int, ...]:
    if type(value) is tuple and all(type(dim) is int and dim >= 0 for dim in value):
        return value
    field = f"{_at(index)}.{attr}"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidArgument(f"{field}: must be a sequence of integers, got {value!r}")
    dims = tuple(check_int(dim, f"{field}[{i}]") for i, dim in enumerate(value))
    for i, dim in enumerate(dims):
        if dim < 0:
            raise InvalidArgument(f"{field}[{i}]: {dim} is negative (shape {dims})")
    return dims


def _enum(cls: type[Role] | type[MemType], value: object, index: int, attr: str) -> Any:
    if type(value) is cls:
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(member.value for member in cls)
        raise InvalidArgument(
            f"{_at(index)}.{attr}: unknown value {value!r}; expected one of {allowed}"
        ) from None


_SCALARS = (str, int, bool, type(None))


def _extras(value: object, index: int) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{_at(index)}.extras: must be a mapping, got {type(value).__name__}")
    if not value:
        return {}
    # Common case: a flat dict of plain scalars needs only a shallow copy.
    if type(value) is dict and all(
        type(k) is str and (type(v) in _SCALARS or (type(v) is float and math.isfinite(v)))
        for k, v in value.items()
    ):
        return dict(value)
    return to_json_value(value, f"{_at(index)}.extras")  # type: ignore[no-any-return]


def validate_descriptor(desc: object, index: int) -> TensorDescriptor:
    """Validate one descriptor (``source.tensors[index]``); return its normalised copy."""
    if not isinstance(desc, TensorDescriptor):
        raise InvalidArgument(
            f"{_at(index)}: expected a TensorDescriptor, got {type(desc).__name__}"
        )
    name = desc.name
    if type(name) is not str or not name:
        check_name(name, f"{_at(index)}.name")
    dtype = desc.dtype
    itemsize = DTYPE_SIZES.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise InvalidArgument(
            f"{_at(index)}.dtype: unknown dtype {dtype!r} (tensor {name!r}); expected one of "
            + ", ".join(DTYPE_SIZES)
        )
    global_shape = _shape(desc.global_shape, index, "global_shape")
    local_shape = _shape(desc.local_shape, index, "local_shape")
    axis = _int_attr(desc.shard_axis, index, "shard_axis")
    offset = _int_attr(desc.shard_offset, index, "shard_offset")
    addr = _int_attr(desc.addr, index, "addr")
    nbytes = _int_attr(desc.nbytes, index, "nbytes")
    device_id = _int_attr(desc.device_id, index, "device_id", minimum=0)
    problem = _geometry_problem(global_shape, local_shape, axis, offset, addr)
    if problem is None and nbytes != math.prod(local_shape) * itemsize:
        problem = (
            f"nbytes: {nbytes} does not match local_shape {local_shape} x {dtype} = "
            f"{math.prod(local_shape) * itemsize} bytes"
        )
    if problem is not None:
        raise InvalidArgument(f"{_at(index)}.{problem} (tensor {name!r})")
    return TensorDescriptor(
        name=name,
        dtype=dtype,
        global_shape=global_shape,
        local_shape=local_shape,
        addr=addr,
        nbytes=nbytes,
        role=_enum(Role, desc.role, index, "role"),
        shard_axis=axis,
        shard_offset=offset,
        mem_type=_enum(MemType, desc.mem_type, index, "mem_type"),
        device_id=device_id,
        extras=_extras(desc.extras, index),
        **_compile_fields(desc, index),
    )


def _compile_fields(desc: TensorDescriptor, index: int) -> dict[str, Any]:
    target = desc.compile_target
    if target == HF_RAW and not desc.compile_metadata:  # the common case: nothing to copy
        return {}
    target = validate_compile_target(target, f"{_at(index)}.compile_target")
    metadata = validate_compile_metadata(desc.compile_metadata, f"{_at(index)}.compile_metadata", target)
    return {"compile_target": target, "compile_metadata": metadata}


def _geometry_problem(
    global_shape: tuple[int, ...],
    local_shape: tuple[int, ...],
    axis: int,
    offset: int,
    addr: int,
) -> str | None:
    """What is wrong with a shard's geometry (``"<attr>: <why>"``), or None."""
    ndim = len(global_shape)
    if len(local_shape) != ndim:
        return (
            f"local_shape: {local_shape} has {len(local_shape)} dims but global_shape "
            f"{global_shape} has {ndim}"
        )
    if axis == -1:
        if local_shape != global_shape:
            return (
                f"local_shape: {local_shape} differs from global_shape {global_shape} but "
                "shard_axis is -1 (unsharded)"
            )
        if offset != 0:
            return f"shard_offset: {offset} must be 0 when shard_axis is -1"
    elif not 0 <= axis < ndim:
        return (
            f"shard_axis: {axis} is out of range for the {ndim}-dim global_shape "
            f"{global_shape} (use -1 for an unsharded tensor)"
        )
    else:
        if offset < 0:
            return f"shard_offset: {offset} is negative"
        for dim in range(ndim):
            if dim != axis and local_shape[dim] != global_shape[dim]:
                return (
                    f"local_shape: {local_shape} differs from global_shape {global_shape} on "
                    f"dim {dim}, which is not the shard axis {axis}"
                )
        if offset + local_shape[axis] > global_shape[axis]:
            return (
                f"shard_offset: {offset} + local extent {local_shape[axis]} exceeds "
                f"global_shape[{axis}] = {global_shape[axis]}"
            )
    if addr < 0:
        return f"addr: {addr} is negative"
    return None


def _validate_mesh(mesh: object) -> MeshPosition:
    if not isinstance(mesh, MeshPosition):
        raise InvalidArgument(f"source.mesh: expected a MeshPosition, got {type(mesh).__name__}")
    fields = ("tp_rank", "tp_size", "pp_rank", "pp_size", "ep_rank", "ep_size", "etp_rank", "etp_size")
    clean = MeshPosition(**{f: check_int(getattr(mesh, f), f"source.mesh.{f}") for f in fields})
    try:
        clean.validate()
    except ValueError as exc:
        raise InvalidArgument(f"source.{exc}") from None
    return clean


def validate_source(source: object, limits: CatalogLimits) -> SourceInfo:
    """Validate a source and all its descriptors; return the normalised copy."""
    if not isinstance(source, SourceInfo):
        raise InvalidArgument(f"source: expected a SourceInfo, got {type(source).__name__}")
    source_id = check_name(source.source_id, "source.source_id")
    mesh = _validate_mesh(source.mesh)
    agent_name = check_name(source.agent_name, "source.agent_name")
    metadata = source.agent_metadata
    if not isinstance(metadata, (bytes, bytearray, memoryview)):
        raise InvalidArgument(
            f"source.agent_metadata: must be bytes, got {type(metadata).__name__}"
        )
    metadata = bytes(metadata)
    if len(metadata) > limits.max_agent_metadata_bytes:
        raise InvalidArgument(
            f"source.agent_metadata: {len(metadata)} bytes exceeds the limit of "
            f"{limits.max_agent_metadata_bytes} bytes"
        )
    tensors = source.tensors
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        raise InvalidArgument(f"source.tensors: must be a sequence, got {type(tensors).__name__}")
    if len(tensors) > limits.max_descriptors_per_source:
        raise InvalidArgument(
            f"source.tensors: {len(tensors)} descriptors exceed the limit of "
            f"{limits.max_descriptors_per_source} per source"
        )
    clean: list[TensorDescriptor] = []
    first_index: dict[str, int] = {}
    for index, desc in enumerate(tensors):
        checked = validate_descriptor(desc, index)
        previous = first_index.setdefault(checked.name, index)
        if previous != index:
            raise InvalidArgument(
                f"source.tensors[{index}].name: {checked.name!r} duplicates "
                f"source.tensors[{previous}] of source {source_id!r}"
            )
        clean.append(checked)
    check_flag(source.ready, "source.ready")
    regions = _validate_regions(source.regions, clean, limits)
    cuda_ipc = validate_cuda_ipc(source.cuda_ipc, regions, clean)
    checksums = validate_checksums(source.checksums, clean)
    return SourceInfo(
        source_id=source_id,
        mesh=mesh,
        agent_name=agent_name,
        agent_metadata=metadata,
        tensors=tuple(clean),
        ready=source.ready,
        regions=regions,
        incarnation=_check_incarnation(source.incarnation),
        cuda_ipc=cuda_ipc,
        checksums=checksums,
        delta=validate_delta(source.delta, clean, regions, checksums),
        lease_fence_s=check_seconds(
            source.lease_fence_s, "source.lease_fence_s", maximum=limits.max_ttl_s, allow_zero=True
        ),
        revision=validate_revision(source.revision),
        compat=validate_compat(source.compat),
    )


IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
DEVICE_UUID_BYTES = 16


def validate_cuda_ipc(
    export: object, regions: Sequence[tuple[int, int]], tensors: Sequence[TensorDescriptor]
) -> CudaIpcExport | None:
    """A source's CUDA IPC export: sizes of the opaque fields, every exported region one of the
    source's registered regions, the source's tensors in CUDA memory. ``None`` passes."""
    if export is None:
        return None
    if not isinstance(export, CudaIpcExport):
        raise InvalidArgument(f"source.cuda_ipc: expected a CudaIpcExport, got {type(export).__name__}")
    for name, limit in (("boot_id", 64), ("host_name", 255), ("pid_namespace", 64)):
        value = getattr(export, name)
        if not isinstance(value, str) or len(value) > limit or (not value and name != "pid_namespace"):
            raise InvalidArgument(f"source.cuda_ipc.{name}: {value!r} must be a non-empty string of at most {limit} characters")
    pid = check_int(export.pid, "source.cuda_ipc.pid", minimum=1)
    uuid = export.device_uuid
    if not isinstance(uuid, (bytes, bytearray)) or len(uuid) != DEVICE_UUID_BYTES:
        raise InvalidArgument(
            f"source.cuda_ipc.device_uuid: must be {DEVICE_UUID_BYTES} bytes, got "
            f"{len(uuid) if isinstance(uuid, (bytes, bytearray)) else type(uuid).__name__}"
        )
    if any(d.mem_type != MemType.VRAM for d in tensors):
        raise InvalidArgument("source.cuda_ipc: given, but the source publishes tensors in host memory")
    known = set(regions)
    clean: list[IpcRegion] = []
    for index, region in enumerate(export.regions):
        field = f"source.cuda_ipc.regions[{index}]"
        if not isinstance(region, IpcRegion):
            raise InvalidArgument(f"{field}: expected an IpcRegion, got {type(region).__name__}")
        handle = region.handle
        if not isinstance(handle, (bytes, bytearray)) or len(handle) != IPC_HANDLE_BYTES:
            raise InvalidArgument(
                f"{field}.handle: must be {IPC_HANDLE_BYTES} bytes, got "
                f"{len(handle) if isinstance(handle, (bytes, bytearray)) else type(handle).__name__}"
            )
        offset = check_int(region.offset, f"{field}.offset", minimum=0)
        span = (check_int(region.addr, f"{field}.addr"), check_int(region.nbytes, f"{field}.nbytes"))
        if span not in known:
            raise InvalidArgument(f"{field}: ({span[0]:#x}, {span[1]}) is not one of source.regions")
        clean.append(IpcRegion(span[0], span[1], bytes(handle), offset))
    if len({r.addr for r in clean}) != len(clean):
        raise InvalidArgument("source.cuda_ipc.regions: a region is exported twice")
    return CudaIpcExport(export.boot_id, export.host_name, pid, export.pid_namespace, bytes(uuid), tuple(clean))


def check_incarnations(values: object) -> dict[str, str]:
    """A heartbeat's ``incarnations``: source id -> incarnation (None: none claimed)."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise InvalidArgument(
            f"incarnations: must be a mapping of source id to incarnation, got {type(values).__name__}"
        )
    return {
        check_name(sid, "incarnations key"): check_name(inc, f"incarnations[{sid!r}]")
        for sid, inc in values.items()
    }


def _check_incarnation(value: object) -> str:
    if not isinstance(value, str) or len(value) > 256 or not value.isprintable():
        raise InvalidArgument(
            f"source.incarnation: must be a printable string of at most 256 characters, got {value!r}"
        )
    return value


def _validate_regions(
    regions: object, tensors: Sequence[TensorDescriptor], limits: CatalogLimits
) -> tuple[tuple[int, int], ...]:
    """Regions are well formed, and every tensor lies inside one of them (when any are given)."""
    if isinstance(regions, (str, bytes)) or not isinstance(regions, Sequence):
        raise InvalidArgument(f"source.regions: must be a sequence, got {type(regions).__name__}")
    if len(regions) > limits.max_descriptors_per_source:
        raise InvalidArgument(
            f"source.regions: {len(regions)} regions exceed the limit of {limits.max_descriptors_per_source}"
        )
    clean: list[tuple[int, int]] = []
    for index, region in enumerate(regions):
        if not (isinstance(region, Sequence) and len(region) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in region)):
            raise InvalidArgument(f"source.regions[{index}]: expected (addr, nbytes) integers, got {region!r}")
        addr, nbytes = region
        if addr < 0 or nbytes <= 0:
            raise InvalidArgument(f"source.regions[{index}]: ({addr}, {nbytes}) needs addr >= 0 and nbytes > 0")
        clean.append((addr, nbytes))
    clean.sort()
    if clean:
        starts = [a for a, _ in clean]
        for index, desc in enumerate(tensors):
            if desc.nbytes == 0:
                continue
            i = bisect.bisect_right(starts, desc.addr) - 1
            # Regions may nest or overlap; any one containing the tensor will do.
            while i >= 0 and not (clean[i][0] + clean[i][1] >= desc.addr + desc.nbytes):
                i -= 1
            if i < 0:
                raise InvalidArgument(
                    f"source.tensors[{index}] ({desc.name!r}): bytes {desc.addr:#x}+{desc.nbytes} lie "
                    "outside every registered region in source.regions"
                )
    return tuple(clean)


def describe_mesh(mesh: MeshPosition) -> str:
    """``tp 0/2, pp 1/4, ep 0/1`` (and ``, etp 0/1`` when given) for error messages."""
    etp = f", etp {mesh.etp_rank}/{mesh.etp_size}" if mesh.etp_size else ""
    return (
        f"tp {mesh.tp_rank}/{mesh.tp_size}, pp {mesh.pp_rank}/{mesh.pp_size}, "
        f"ep {mesh.ep_rank}/{mesh.ep_size}{etp}"
    )
