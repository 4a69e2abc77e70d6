"""The ``mx`` backend's init and update infos.

Both travel as plain JSON (vLLM's HTTP routes, Ray, Dynamo's ``/engine/<route>`` bodies), so
every field is a str, int, float, bool or None, and both validate themselves on construction
with messages that name the field and the value. vLLM's ``parse_init_info`` /
``parse_update_info`` turn unknown or missing keys into ``ValueError``; the checks here add
types and ranges (:class:`mx_refit.errors.InvalidArgument`, also a ``ValueError``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from mx_refit.errors import InvalidArgument

__all__ = ["MxInitInfo", "MxUpdateInfo"]


def _check_str(cls: str, field: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{cls}.{field}: expected a non-empty string, got {value!r}")


def _check_number(
    cls: str,
    field: str,
    value: Any,
    *,
    minimum: float,
    integer: bool = False,
    optional: bool = False,
    strict: bool = False,
) -> None:
    if value is None and optional:
        return
    kinds = (int,) if integer else (int, float)
    # bool is an int subclass; JSON `true` must not pass as a timeout or a version.
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise InvalidArgument(f"{cls}.{field}: expected {kind}, got {value!r}")
    if value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        raise InvalidArgument(f"{cls}.{field}: must be {op} {minimum}, got {value!r}")


def _check_address(cls: str, field: str, value: Any) -> None:
    _check_str(cls, field, value)
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{cls}.{field}: expected 'host:port', got {value!r}")


@dataclass
class MxInitInfo(WeightTransferInitInfo):
    """Sent once per worker through ``init_weight_transfer_engine``.

    :param catalog: The mx-refit catalog's gRPC address, ``host:port``.
    :param model: The model name trainers publish under.
    :param token: Bearer token the catalog requires, if any.
    :param arena_device: Where the receive buffers live: ``None`` = the worker's device (GPU
        memory on GPU workers, so NIXL writes straight into VRAM), or ``"cpu"`` to stage in host
        memory.
    :param lease_ttl_s: Lease TTL while bytes are in flight (renewed every third of it).
    :param transfer_timeout_s: Budget of one version's NIXL reads.
    :param ready_timeout_s: Default time to wait for the requested version to become READY.
    :param load_batch_bytes: Upper bound on the bytes handed to ``model.load_weights`` per call.
    :param strict_names: Refuse versions carrying tensors the model does not have (before any
        weight is touched). Turn off only for checkpoints with extra tensors vLLM ignores.
    :param checksums: Verify every pulled byte against the trainers' end-to-end checksums before
        loading (the trainers must publish with ``weight_sync.checksums: true``).
    """

    catalog: str
    model: str
    token: str | None = None
    arena_device: str | None = None
    lease_ttl_s: float = 60.0
    transfer_timeout_s: float = 300.0
    ready_timeout_s: float = 0.0
    load_batch_bytes: int = 512 << 20
    strict_names: bool = True
    checksums: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_address(name, "catalog", self.catalog)
        _check_str(name, "model", self.model)
        _check_str(name, "token", self.token, optional=True)
        _check_str(name, "arena_device", self.arena_device, optional=True)
        _check_number(name, "lease_ttl_s", self.lease_ttl_s, minimum=0, strict=True)
        _check_number(name, "transfer_timeout_s", self.transfer_timeout_s, minimum=0, strict=True)
        _check_number(name, "ready_timeout_s", self.ready_timeout_s, minimum=0)
        _check_number(name, "load_batch_bytes", self.load_batch_bytes, minimum=1, integer=True)
        for flag in ("strict_names", "checksums"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidArgument(f"{name}.{flag}: expected a bool, got {getattr(self, flag)!r}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe payload for ``init_weight_transfer_engine``."""
        return asdict(self)


@dataclass
class MxUpdateInfo(WeightTransferUpdateInfo):
    """Sent per update through ``update_weights`` (one dict, or one per rank in a list).

    :param version: Load exactly this version (it must be READY), or ``None`` for the newest
        READY version >= ``min_version``.
    :param min_version: Lower bound when ``version`` is ``None``.
    :param wait_s: Wait up to this long for a matching READY version; ``None`` uses the init
        info's ``ready_timeout_s``.
    :param model: Catalog model name for this update; ``None`` uses the init info's (set it when
        updating a speculative draft model published under its own name).
    """

    version: int | None = None
    min_version: int = 0
    wait_s: float | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_number(name, "version", self.version, minimum=0, integer=True, optional=True)
        _check_number(name, "min_version", self.min_version, minimum=0, integer=True)
        _check_number(name, "wait_s", self.wait_s, minimum=0, optional=True)
        _check_str(name, "model", self.model, optional=True)
        if self.version is not None and self.min_version > self.version:
            raise InvalidArgument(
                f"{name}.min_version: {self.min_version} is above the exact version {self.version}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe payload for ``update_weights``."""
        return asdict(self)
