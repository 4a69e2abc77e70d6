"""The ``mx`` backend's init and update infos.

Both travel as plain JSON (vLLM's HTTP routes, Ray, Dynamo's ``/engine/<route>`` bodies), so
every field is a str, int, float, bool or None, and both validate themselves on construction
with messages that name the field and the value. vLLM's ``parse_init_info`` /
``parse_update_info`` turn unknown or missing keys into ``ValueError``; the checks here add
types and ranges (:class:`mx_refit.errors.InvalidArgument`, also a ``ValueError``): the core's
checks and defaults (``mx_refit.config``), the ones ``weight_sync`` and ``Receiver`` use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from mx_refit.config import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_LOAD_BATCH_BYTES,
    DEFAULT_RECEIVE_BUFFER_BYTES,
    DEFAULT_TRANSFER_TIMEOUT_S,
    DIRECT,
    STAGED,
    check_count,
    check_flag,
    check_name,
    check_receive_buffer_bytes,
    check_receive_mode,
    check_seconds,
)
from mx_refit.errors import InvalidArgument

__all__ = ["MxInitInfo", "MxUpdateInfo"]


def _check_str(cls: str, field: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    check_name(value, f"{cls}.{field}", blank_ok=False)


def _check_address(cls: str, field: str, value: Any) -> None:
    _check_str(cls, field, value)
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{cls}.{field}: expected 'host:port', got {value!r}")


PHASES = ("load", "stage", "commit")


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
    :param rank_exact: Pull only this rank's bytes and place them into vLLM's parameters
        (modules it cannot prove are pulled whole and loaded by vLLM, with a warning naming
        them); ``False`` pulls whole HF tensors for every parameter.
    :param receive_mode: ``weight_sync.receive_mode``: ``"staged"``, the receive arena holds
        this worker's whole version (its own rank's bytes), so a version can be staged while
        generation runs and committed in one short step (``MxUpdateInfo.phase``). ``"direct"``:
        no arena; the bytes go into vLLM's parameters through a registered buffer of at most
        ``receive_buffer_bytes``, chunk by chunk (rank-exact windows in row pieces), with
        generation paused (``phase="load"`` only). A direct load that fails after its first
        write raises ``mx_refit.PartiallyUpdated``: refit again before serving.
    :param receive_buffer_bytes: ``weight_sync.receive_buffer_bytes``: ``direct``'s buffer, the
        receive memory outside the parameters (>= 4096 and one row of the widest tensor).
    """

    catalog: str
    model: str
    token: str | None = None
    arena_device: str | None = None
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S  # the core's (weight_sync) default
    ready_timeout_s: float = 0.0
    load_batch_bytes: int = DEFAULT_LOAD_BATCH_BYTES
    strict_names: bool = True
    checksums: bool = False
    rank_exact: bool = True
    receive_mode: str = STAGED
    receive_buffer_bytes: int = DEFAULT_RECEIVE_BUFFER_BYTES

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_receive_mode(self.receive_mode, f"{name}.receive_mode")
        check_receive_buffer_bytes(self.receive_buffer_bytes, f"{name}.receive_buffer_bytes")
        if self.receive_mode == DIRECT and self.checksums:
            raise InvalidArgument(
                f"{name}.checksums: True verifies a whole version before loading; receive_mode 'direct' "
                f"writes the parameters chunk by chunk (use receive_mode 'staged' for checksums)"
            )
        check_flag(self.rank_exact, f"{name}.rank_exact")
        _check_address(name, "catalog", self.catalog)
        _check_str(name, "model", self.model)
        _check_str(name, "token", self.token, optional=True)
        _check_str(name, "arena_device", self.arena_device, optional=True)
        check_seconds(self.lease_ttl_s, f"{name}.lease_ttl_s")
        check_seconds(self.transfer_timeout_s, f"{name}.transfer_timeout_s")
        check_seconds(self.ready_timeout_s, f"{name}.ready_timeout_s", allow_zero=True)
        check_count(self.load_batch_bytes, f"{name}.load_batch_bytes", minimum=1)
        check_flag(self.strict_names, f"{name}.strict_names")
        check_flag(self.checksums, f"{name}.checksums")

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
    :param phase: ``"load"`` (pull, then load: generation must be paused), ``"stage"`` (start
        pulling the version into the receive arena in the background and return at once:
        generation keeps running) or ``"commit"`` (wait for the staged pull, then place it into
        the parameters: the short step to run with generation paused).
    """

    version: int | None = None
    min_version: int = 0
    wait_s: float | None = None
    model: str | None = None
    phase: str = "load"

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.phase not in PHASES:
            raise InvalidArgument(f"{name}.phase: expected one of {', '.join(PHASES)}, got {self.phase!r}")
        if self.version is not None:
            check_count(self.version, f"{name}.version", minimum=0)
        check_count(self.min_version, f"{name}.min_version", minimum=0)
        if self.wait_s is not None:
            check_seconds(self.wait_s, f"{name}.wait_s", allow_zero=True)
        _check_str(name, "model", self.model, optional=True)
        if self.version is not None and self.min_version > self.version:
            raise InvalidArgument(
                f"{name}.min_version: {self.min_version} is above the exact version {self.version}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe payload for ``update_weights``."""
        return asdict(self)
