"""The transport seam: what Publisher and Receiver need of a data path, and the per-source choice
between the two paths mx-refit has (NIXL, and CUDA IPC for CUDA sources on the same node).

Pure Python, no torch/nixl: the choice is a function of plain values, so it is tested without a
GPU. See docs/design.md, "Transport".
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from mx_refit.checks import CUDA_IPC, NIXL, TRANSPORT_MODES
from mx_refit.checks import check_mode as check_one_of
from mx_refit.errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.ranges import Range
    from mx_refit.types import CudaIpcExport, SourceInfo

__all__ = [
    "NIXL",
    "CUDA_IPC",
    "TRANSPORT_MODES",
    "LocalNode",
    "PathChoice",
    "ReadReport",
    "Transport",
    "check_mode",
    "local_node",
    "row_slice_costs",
    "select_path",
]



def check_mode(mode: str, field: str = "transport") -> str:
    """``mode`` if it is one of :data:`TRANSPORT_MODES` (auto picks per source; the others force
    one path for every source)."""
    return check_one_of(mode, field, TRANSPORT_MODES)


@dataclass(frozen=True)
class LocalNode:
    """Who this process is, for comparing with a source's :class:`CudaIpcExport`."""

    boot_id: str
    host_name: str
    pid: int
    pid_namespace: str


@lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: no IPC path (the boot id must match on both sides)
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def local_node() -> LocalNode:
    return LocalNode(_boot_id(), socket.gethostname(), os.getpid(), _pid_namespace())


@dataclass(frozen=True)
class PathChoice:
    """The path for one source and why (the reason is logged and ends up in errors)."""

    path: str  # NIXL or CUDA_IPC
    reason: str


def select_path(
    mode: str,
    export: "CudaIpcExport | None",
    node: LocalNode,
    local_device_uuid: bytes | None,
    peer_uuids: Sequence[bytes] = (),
) -> PathChoice:
    """Choose how to read one source.

    CUDA IPC when the source exported its CUDA regions, runs on this node (same boot id AND host
    name), and the receive arena is on a CUDA device (``local_device_uuid``) that is the source's
    device or can reach it through peer access (``peer_uuids``: devices the local one can access).
    Everything else reads through NIXL. ``mode`` forces a path: ``nixl`` always, ``cuda_ipc``
    raises :class:`InvalidArgument` naming the reason when IPC is impossible.
    """
    check_mode(mode)
    if mode == NIXL:
        return PathChoice(NIXL, "weight_sync.transport is 'nixl'")
    why_not = _ipc_obstacle(export, node, local_device_uuid, peer_uuids)
    if why_not is None:
        assert export is not None
        same = export.device_uuid == local_device_uuid
        return PathChoice(CUDA_IPC, "same node, same GPU" if same else "same node, peer GPU")
    if mode == CUDA_IPC:
        raise InvalidArgument(f"weight_sync.transport: 'cuda_ipc' is impossible here: {why_not}")
    return PathChoice(NIXL, why_not)


def _ipc_obstacle(
    export: "CudaIpcExport | None", node: LocalNode, local_uuid: bytes | None, peer_uuids: Sequence[bytes]
) -> str | None:
    if export is None or not export.regions:
        return "the source exports no CUDA IPC handles (host memory, or IPC unavailable there)"
    if not node.boot_id or export.boot_id != node.boot_id or export.host_name != node.host_name:
        return f"the source runs on another node ({export.host_name}, boot {export.boot_id[:8]})"
    if local_uuid is None:
        return "the receive arena is not in CUDA memory"
    if export.device_uuid != local_uuid and export.device_uuid not in peer_uuids:
        return "the source's GPU is not reachable by peer access from the arena's GPU"
    return None


def row_slice_costs(sources: "Sequence[SourceInfo]", node: LocalNode | None = None) -> dict[str, float]:
    """The cost constants for the hull-or-rows choice when reading ``sources`` from here.

    Device-copy costs (:data:`mx_refit.ranges.DEVICE_COPY_COSTS`) when every source exports its
    CUDA memory over IPC from this node, so an ``auto`` reader copies on the device; otherwise
    an empty dict (the NIXL defaults of :func:`mx_refit.ranges.plan_row_slice`). A wrong guess
    (a reader forced to ``nixl``, an arena on a GPU without peer access) costs speed, never
    bytes: both modes read exactly the same window.
    """
    from mx_refit.ranges import DEVICE_COPY_COSTS

    node = node or local_node()
    if sources and node.boot_id and all(
        s.cuda_ipc is not None and s.cuda_ipc.regions and s.cuda_ipc.boot_id == node.boot_id
        and s.cuda_ipc.host_name == node.host_name
        for s in sources
    ):
        return dict(DEVICE_COPY_COSTS)
    return {}


@dataclass(frozen=True)
class ReadReport:
    """What one :meth:`Transport.read` moved, per source."""

    nbytes: dict[str, int]
    paths: dict[str, str]  # source_id -> NIXL / CUDA_IPC
    descriptors: int  # NIXL descriptors posted or device copies issued
    handles_opened: int = 0

    @property
    def path(self) -> str:
        """One word for RefitStats: the single path used, or ``mixed``."""
        kinds = set(self.paths.values())
        return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else NIXL)


@runtime_checkable
class Transport(Protocol):
    """What Publisher and Receiver talk to (:class:`~mx_refit.transport.routing.RoutingTransport`
    is the one they build; it routes every source to NIXL or CUDA IPC).

    Source side: :meth:`register_many` pins the storages of published tensors (never freed while
    registered), :meth:`region_of` names the region a tensor lies in, :meth:`describe` fills the
    catalog's connection fields for those regions. Reader side: :meth:`register` the receive
    arena, :meth:`read` coalesced ranges from many sources at once, :meth:`forget` a source that
    is gone (its connection and handles are closed). :meth:`close` releases everything.
    """

    registrations: int

    def register_many(self, tensors: "Sequence[torch.Tensor]", *, nixl: bool | None = None) -> int: ...

    def register(self, tensor: "torch.Tensor") -> bool: ...

    def deregister(self, tensor: "torch.Tensor") -> int: ...

    def deregister_all(self) -> int: ...

    def region_of(self, tensor: "torch.Tensor") -> tuple[int, int]: ...

    def describe(self, regions: Sequence[tuple[int, int]]) -> "tuple[str, bytes, CudaIpcExport | None]": ...

    def read(
        self,
        sources: "Mapping[str, SourceInfo]",
        requests: "Mapping[str, Sequence[Range]]",
        arena: "torch.Tensor",
        *,
        timeout_s: float,
        abort_check: "Callable[[], None] | None" = None,
        gone: "Callable[[], Collection[str]] | None" = None,
    ) -> ReadReport: ...

    def known_sources(self) -> set[str]: ...

    def forget(self, source_id: str) -> None: ...

    def close(self) -> None: ...
