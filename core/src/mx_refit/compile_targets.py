"""Compile targets: which form a version's bytes are in, and whether a receiver can load them.

Every published tensor names its form (``TensorDescriptor.compile_target``; ``hf_raw``, the
bytes as trained, by default) and what a reader must know about it (``compile_metadata``, a
string map). A source states a content-addressed ``revision`` of its bytes and the runtime they
were compiled for (:class:`~mx_refit.types.CompileCompat`).

A version has one *compiled target*: the one target other than ``hf_raw`` its tensors use (an FP8
version ships its linear weights as ``fp8_block`` and keeps norms, embeddings and routers in
``hf_raw``), or ``hf_raw`` when none does. A receiver's :class:`~mx_refit.types.TargetLayout`
names the targets it accepts; :func:`check_compile_targets` refuses, with one error naming the
tensor, the offered target and the wanted one, a version whose target it does not accept, whose
compiled tensors lack required metadata, whose sources were compiled for another runtime, or
that mixes targets (two compiled targets, or one tensor in two forms across sources).

Pure: no torch, no grpc. The catalog validates the fields with the ``validate_*`` functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from mx_refit.errors import CompileTargetError, InvalidArgument
from mx_refit.types import COMPAT_FIELDS, HF_RAW, CompileCompat, SourceInfo, TargetLayout, VersionInfo

__all__ = [
    "CompileTargetError",
    "check_compile_targets",
    "validate_compat",
    "validate_compile_metadata",
    "validate_compile_target",
    "validate_revision",
    "version_target",
]

_TARGET = re.compile(r"[a-z][a-z0-9_]{0,63}")
_REVISION = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY = 128
MAX_METADATA_VALUE = 1024
MAX_COMPAT_VALUE = 256


def validate_compile_target(value: object, field: str) -> str:
    """A lowercase identifier (``hf_raw`` for ``""``, the wire's default)."""
    if value == "":
        return HF_RAW
    if not isinstance(value, str) or not _TARGET.fullmatch(value):
        raise InvalidArgument(
            f"{field}: {value!r} is not a compile target (a lowercase identifier of at most 64 "
            "characters such as 'hf_raw' or 'fp8_block')"
        )
    return value


def validate_compile_metadata(value: object, field: str, target: str) -> dict[str, str]:
    """A string -> string map, bounded; none for ``hf_raw``."""
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{field}: must be a mapping of strings, got {type(value).__name__}")
    if value and target == HF_RAW:
        raise InvalidArgument(f"{field}: {dict(value)!r} given for compile target {HF_RAW!r}, which takes none")
    if len(value) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(f"{field}: {len(value)} entries exceed the limit of {MAX_METADATA_ENTRIES}")
    for key, item in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_METADATA_KEY:
            raise InvalidArgument(f"{field}: key {key!r} must be a non-empty string of at most {MAX_METADATA_KEY} characters")
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise InvalidArgument(f"{field}[{key!r}]: {item!r} must be a string of at most {MAX_METADATA_VALUE} characters")
    return dict(value)


def validate_revision(value: object, field: str = "source.revision") -> str:
    """``""`` (not stated) or up to 128 characters of ``[A-Za-z0-9._:-]``."""
    if value == "":
        return ""
    if not isinstance(value, str) or not _REVISION.fullmatch(value):
        raise InvalidArgument(f"{field}: {value!r} must be at most 128 characters of [A-Za-z0-9._:-]")
    return value


def validate_compat(value: object, field: str = "source.compat") -> CompileCompat | None:
    """``None`` or a :class:`CompileCompat` of short strings."""
    if value is None:
        return None
    if not isinstance(value, CompileCompat):
        raise InvalidArgument(f"{field}: expected a CompileCompat, got {type(value).__name__}")
    for name in COMPAT_FIELDS:
        item = getattr(value, name)
        if not isinstance(item, str) or len(item) > MAX_COMPAT_VALUE or not item.isprintable():
            raise InvalidArgument(f"{field}.{name}: {item!r} must be a printable string of at most {MAX_COMPAT_VALUE} characters")
    return value


def version_target(sources: Iterable[SourceInfo]) -> str:
    """The version's compiled target (see the module doc); :class:`CompileTargetError` when it
    mixes targets."""
    forms: dict[str, tuple[str, str]] = {}  # tensor name -> (target, source id)
    compiled: tuple[str, str, str] | None = None  # (target, tensor, source id)
    for source in sources:
        for desc in source.tensors:
            target = desc.compile_target
            seen = forms.setdefault(desc.name, (target, source.source_id))
            if seen[0] != target:
                raise CompileTargetError(
                    f"tensors[{desc.name!r}].compile_target: mixed targets: source {seen[1]!r} offers "
                    f"{seen[0]!r}, source {source.source_id!r} offers {target!r}; a version has one form per tensor"
                )
            if target == HF_RAW:
                continue
            if compiled is None:
                compiled = (target, desc.name, source.source_id)
            elif compiled[0] != target:
                raise CompileTargetError(
                    f"tensors[{desc.name!r}].compile_target: mixed targets: {target!r} (source "
                    f"{source.source_id!r}) and {compiled[0]!r} (tensor {compiled[1]!r}, source "
                    f"{compiled[2]!r}); a version has one compiled target"
                )
    return compiled[0] if compiled else HF_RAW


def check_compile_targets(info: VersionInfo, target: TargetLayout) -> str:
    """The version's compiled target, when ``target`` can load it; otherwise
    :class:`CompileTargetError` naming the tensor, the offered target and the wanted ones."""
    offered = version_target(info.sources)
    wanted = target.compile_targets
    if offered not in wanted:
        name = _first_tensor(info, offered)
        raise CompileTargetError(
            f"version {info.version} of {info.model!r}: tensor {name!r} is offered as compile "
            f"target {offered!r}, but this receiver wants {' or '.join(map(repr, wanted))}"
            + (" (publish with weight_sync.publish_format matching the engine)" if offered in ("hf_raw", "fp8_block") else "")
        )
    if offered == HF_RAW:
        return offered
    required = target.required_metadata
    for source in info.sources:
        problems = target.compat.mismatches(source.compat) if target.compat and source.compat else []
        for desc in source.tensors:
            if desc.compile_target == HF_RAW:
                continue
            if problems:
                raise CompileTargetError(
                    f"tensor {desc.name!r} (compile target {offered!r}) of source {source.source_id!r} was "
                    f"compiled for another runtime: {'; '.join(problems)}"
                )
            for key, value in required:
                if desc.compile_metadata.get(key) != value:
                    raise CompileTargetError(
                        f"tensor {desc.name!r} of source {source.source_id!r}: compile target {offered!r} "
                        f"with compile_metadata[{key!r}] = {desc.compile_metadata.get(key)!r}, but this "
                        f"receiver wants {value!r}"
                    )
    return offered


def _first_tensor(info: VersionInfo, target: str) -> str:
    for source in info.sources:
        for desc in source.tensors:
            if desc.compile_target == target:
                return desc.name
    return "<none>"
