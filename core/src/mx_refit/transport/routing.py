"""RoutingTransport: the :class:`~mx_refit.transport.base.Transport` Publisher and Receiver use.

It pins and indexes registered memory itself, registers it with NIXL when NIXL is in use, exports
CUDA regions for same-node readers, and routes every source of a read to NIXL or CUDA IPC
(:func:`~mx_refit.transport.base.select_path`). Both underlying transports are created lazily:
a reader whose sources are all same-node CUDA never starts a NIXL agent (nor its progress
thread), and nixl need not even be installed; a DRAM-only process never touches CUDA.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from mx_refit.errors import InvalidArgument, TransferError
from mx_refit.ranges import RegionIndex
from mx_refit.transport.base import CUDA_IPC, NIXL, PathChoice, ReadReport, Transport, check_mode, local_node, select_path

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.ranges import Range
    from mx_refit.transport.cuda_ipc import CudaIpcTransport
    from mx_refit.transport.nixl import NixlTransport
    from mx_refit.types import CudaIpcExport, SourceInfo

__all__ = ["RoutingTransport"]

log = logging.getLogger(__name__)


def _location(tensor: "torch.Tensor") -> tuple[str, int]:
    if tensor.device.type == "cuda":
        import torch

        index = tensor.device.index
        return "VRAM", index if index is not None else torch.cuda.current_device()
    if tensor.device.type == "cpu":
        return "DRAM", 0
    raise InvalidArgument(f"tensor.device: {tensor.device} is not supported (cpu or cuda only)")


def _span(tensor: "torch.Tensor") -> tuple[int, int]:
    if tensor.numel() == 0:
        return tensor.data_ptr(), 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), (last + 1) * tensor.element_size()


def _check_in_arena(source_id: str, ranges: "Sequence[Range]", arena_bytes: int) -> int:
    """The arena bytes ``ranges`` reach; raises naming the first range outside the arena."""
    reach = 0
    for _, offset, n in ranges:
        if offset < 0 or offset + n > arena_bytes:
            raise InvalidArgument(
                f"source {source_id}: read of {n} bytes at arena offset {offset} exceeds the "
                f"{arena_bytes}-byte arena"
            )
        reach = max(reach, offset + n)
    return reach


class RoutingTransport:
    """NIXL for everything that must cross a node or sits in host memory, CUDA IPC for CUDA
    sources on this node.

    Args:
        mode: ``auto`` (per source), ``nixl`` or ``cuda_ipc`` (forced; the latter fails for a
            source it cannot serve, naming the reason).
        name: NIXL agent name (unique among peers); generated when omitted.
        nixl: an existing NIXL transport to use (not closed by :meth:`close`).
    """

    def __init__(self, mode: str = "auto", *, name: str | None = None, nixl: "NixlTransport | None" = None) -> None:
        self.mode = check_mode(mode)
        self._name = nixl.agent_name if nixl is not None else (name or f"mx-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._nixl = nixl
        self._owns_nixl = nixl is None
        self._nixl_error: str | None = None
        self._ipc: "CudaIpcTransport | None" = None
        self._lock = threading.RLock()
        # Pinned storages per region (never freed while registered) and their locations.
        self._storages: dict[tuple[int, int], Any] = {}
        self._where: dict[tuple[int, int], tuple[str, int]] = {}
        self._index: dict[tuple[str, int], RegionIndex] = {}
        self._nixl_registered: set[tuple[int, int]] = set()
        # source -> (its export, the arena's device, the path chosen): steady cycles choose nothing
        self._choices: dict[str, tuple[Any, Any, PathChoice]] = {}
        self._checked: dict[str, tuple[Sequence[Range], int]] = {}  # source -> (ranges, arena bytes reached)
        # source -> (ranges, arena address, the NIXL ops of them): one list object per layout
        self._nixl_ops: dict[str, tuple[Sequence[Range], int, list[Range]]] = {}
        self._peers: dict[int, tuple[bytes, tuple[bytes, ...]]] = {}
        self._node = local_node()
        self._closed = False
        self.registrations = 0  # regions newly pinned (publish: published buffers; read: arena)
        self.descriptors_posted = 0  # NIXL descriptors plus device copies
        self.handles_opened = 0
        self.last_read_s = 0.0  # wall time of the last read() (benchmarks split the pull with it)

    @classmethod
    def wrap(cls, transport: "Transport | NixlTransport | None", mode: str, *, name: str) -> "RoutingTransport":
        """The routing transport a Publisher or Receiver uses: a new one (NIXL agent ``name``),
        the one given, or one wrapped around a given NIXL transport (the wrapper is the
        caller's; the NIXL transport stays its owner's)."""
        if transport is None:
            return cls(mode, name=name)
        if isinstance(transport, RoutingTransport):
            return transport
        return cls(mode, nixl=cast("NixlTransport", transport))

    # ------------------------------------------------------------------ parts
    @property
    def agent_name(self) -> str:
        return self._name

    def nixl(self, *, required: bool = True) -> "NixlTransport | None":
        """The NIXL transport, created on first use (``None`` when unavailable and not required)."""
        with self._lock:
            if self._nixl is None and self._nixl_error is None:
                try:
                    from mx_refit.transport.nixl import NixlTransport

                    self._nixl = NixlTransport(self._name)
                except (ImportError, TransferError) as exc:
                    self._nixl_error = f"{type(exc).__name__}: {exc}"
                    log.warning("NIXL is unavailable (%s); only same-node CUDA sources can be read", exc)
            if self._nixl is None and required:
                raise TransferError(f"agent {self._name}: NIXL is unavailable ({self._nixl_error})")
            return self._nixl

    def ipc(self) -> "CudaIpcTransport":
        with self._lock:
            if self._ipc is None:
                from mx_refit.transport.cuda_ipc import CudaIpcTransport

                self._ipc = CudaIpcTransport()
            return self._ipc

    def prime(self, arena: "torch.Tensor") -> None:
        """Ready the next read into ``arena`` while the refit waits for the catalog
        (:meth:`CudaIpcTransport.prime`; nothing to do for NIXL)."""
        ipc = self._ipc
        if ipc is not None and arena.device.type == "cuda":
            ipc.prime(arena)

    # ------------------------------------------------------------------ registration
    def register(self, tensor: "torch.Tensor") -> bool:
        return self.register_many([tensor]) > 0

    def register_many(self, tensors: Sequence["torch.Tensor"], *, nixl: bool | None = None) -> int:
        """Pin the storages of ``tensors`` that are not yet covered; returns the new regions.

        ``nixl``: register them with NIXL too (default: unless the mode is ``cuda_ipc``; when
        NIXL is unavailable in ``auto`` mode they are exported over CUDA IPC only)."""
        with self._lock:
            self._check_open()
            new: list[Any] = []
            for i, t in enumerate(tensors):
                where = _location(t)
                addr, nbytes = _span(t)
                index = self._index.get(where)
                if nbytes == 0 or (index is not None and index.contains(addr, nbytes)):
                    continue
                storage = t.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if not (key[0] <= addr and addr + nbytes <= key[0] + key[1]):
                    raise InvalidArgument(f"tensors[{i}]: bytes {addr:#x}+{nbytes} lie outside its storage")
                if key in self._storages:
                    continue
                self._storages[key] = storage
                self._where[key] = where
                self._index.setdefault(where, RegionIndex()).add(*key)
                new.append(t)
            self.registrations += len(new)
            if nixl if nixl is not None else self.mode != CUDA_IPC:
                self._register_nixl(list(self._storages), required=self.mode == NIXL)
            return len(new)

    def _register_nixl(self, keys: list[tuple[int, int]], *, required: bool) -> None:
        todo = [k for k in keys if k not in self._nixl_registered]
        if not todo:
            return
        agent = self.nixl(required=required)
        if agent is None:
            return
        import torch

        views = []
        for key in todo:
            storage = self._storages[key]
            views.append(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
        agent.register_many(views)
        self._nixl_registered.update(todo)

    def region_of(self, tensor: "torch.Tensor") -> tuple[int, int]:
        where = _location(tensor)
        addr, nbytes = _span(tensor)
        index = self._index.get(where)
        found = index.find(addr, max(nbytes, 1)) if index is not None else None
        if found is None:
            raise InvalidArgument(f"tensor bytes {addr:#x}+{nbytes} ({where[0]} device {where[1]}) are not registered")
        return found

    def deregister(self, tensor: "torch.Tensor") -> int:
        """Unpin every region holding ``tensor``'s bytes (NIXL and IPC exports included)."""
        where = _location(tensor)
        addr, nbytes = _span(tensor)
        with self._lock:
            keys = [k for k, w in self._where.items() if w == where and k[0] <= addr and addr + nbytes <= k[0] + k[1]]
            self._drop(keys)
            return len(keys)

    def is_registered(self, addr: int, nbytes: int, mem: str = "DRAM", dev: int = 0) -> bool:
        """Whether ``[addr, addr + nbytes)`` lies in memory pinned here."""
        index = self._index.get((mem, dev))
        return index is not None and index.contains(addr, nbytes)

    def deregister_all(self) -> int:
        """Unpin everything (after a drain: the owner may free or reallocate the memory)."""
        with self._lock:
            keys = list(self._storages)
            self._drop(keys)
            return len(keys)

    def _drop(self, keys: list[tuple[int, int]]) -> None:
        import torch

        for key in keys:
            storage = self._storages.pop(key)
            where = self._where.pop(key)
            self._index[where].remove(*key)
            if key in self._nixl_registered and self._nixl is not None:
                self._nixl.deregister(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
            self._nixl_registered.discard(key)
        if self._ipc is not None:
            self._ipc.forget_exports(keys)

    # ------------------------------------------------------------------ catalog fields
    def describe(self, regions: Sequence[tuple[int, int]]) -> "tuple[str, bytes, CudaIpcExport | None]":
        """``(agent name, NIXL metadata, CUDA IPC export)`` of ``regions`` for the catalog.

        The export is there when every region is CUDA memory of one device and the mode is not
        ``nixl``; NIXL metadata is empty when NIXL is not in use."""
        with self._lock:
            self._check_open()
            metadata = b""
            if self._nixl_registered:
                agent = self.nixl(required=False)
                metadata = agent.metadata() if agent is not None else b""
            export = None
            places = {self._where.get(tuple(r)) for r in regions}  # type: ignore[arg-type]
            if self.mode != NIXL and len(places) == 1:
                place = places.pop()
                if place is not None and place[0] == "VRAM":
                    export = self.ipc().export(regions, place[1])
            return self._name, metadata, export

    def metadata(self) -> bytes:
        return self.describe(())[1]

    # ------------------------------------------------------------------ reads
    def choose(self, source: "SourceInfo", arena: "torch.Tensor") -> PathChoice:
        """The path for ``source`` into ``arena`` (logged when it changes)."""
        device = arena.device
        memo = self._choices.get(source.source_id)
        if memo is not None and memo[1] == device and (memo[0] is source.cuda_ipc or memo[0] == source.cuda_ipc):
            return memo[2]
        local_uuid, peers = self._device_identity(arena)
        choice = select_path(self.mode, source.cuda_ipc, self._node, local_uuid, peers)
        if memo is None or memo[2] != choice:
            log.info("source %s: reading over %s (%s)", source.source_id, choice.path, choice.reason)
        self._choices[source.source_id] = (source.cuda_ipc, device, choice)
        return choice

    def _device_identity(self, arena: "torch.Tensor") -> tuple[bytes | None, tuple[bytes, ...]]:
        if arena.device.type != "cuda":
            return None, ()
        import torch

        dev = arena.device.index if arena.device.index is not None else torch.cuda.current_device()
        known = self._peers.get(dev)
        if known is None:
            from mx_refit.transport.cuda_ipc import device_uuid

            peers = tuple(
                device_uuid(other) for other in range(torch.cuda.device_count())
                if other != dev and torch.cuda.can_device_access_peer(dev, other)
            )
            known = self._peers[dev] = (device_uuid(dev), peers)
        return known

    def read(
        self,
        sources: "Mapping[str, SourceInfo]",
        requests: "Mapping[str, Sequence[Range]]",
        arena: "torch.Tensor",
        *,
        timeout_s: float,
        abort_check: "Callable[[], None] | None" = None,
        gone: "Callable[[], Collection[str]] | None" = None,
    ) -> ReadReport:
        """Read ``(remote addr, arena offset, n)`` ranges (coalesced and cut at the sources'
        region edges by the caller) from every source into ``arena``; CUDA IPC sources and NIXL
        sources are read in one call each. ``abort_check`` runs before, between NIXL polls and
        after: whatever it raises (a lost lease) ends the read at once; ``gone`` names sources the
        catalog expired, whose NIXL reads then fail at once (CUDA IPC copies are synchronous and
        need no such check). A failed read raises
        :class:`TransferError` whose ``completed_sources`` are the sources confirmed complete."""
        started = time.perf_counter()
        with self._lock:
            self._check_open()
            by_path: dict[str, dict[str, Sequence[Range]]] = {NIXL: {}, CUDA_IPC: {}}
            arena_bytes = arena.numel() * arena.element_size()
            for source_id, ranges in requests.items():
                checked = self._checked.get(source_id)
                if checked is None or checked[0] is not ranges or checked[1] > arena_bytes:
                    # Receivers hand the same cached list every steady cycle: check it once.
                    self._checked[source_id] = (ranges, _check_in_arena(source_id, ranges, arena_bytes))
                by_path[self.choose(sources[source_id], arena).path][source_id] = ranges
            nbytes: dict[str, int] = {}
            paths: dict[str, str] = {}
            descriptors = opened = 0
            if abort_check is not None:
                abort_check()
            try:
                if by_path[CUDA_IPC]:
                    report = self.ipc().read(sources, by_path[CUDA_IPC], arena)
                    nbytes.update(report.nbytes)
                    paths.update(report.paths)
                    descriptors += report.descriptors
                    opened += report.handles_opened
                if by_path[NIXL]:
                    moved, posted = self._read_nixl(sources, by_path[NIXL], arena, timeout_s, abort_check, gone)
                    nbytes.update(moved)
                    paths.update({s: NIXL for s in moved})
                    descriptors += posted
            except TransferError as exc:
                # Which batches are in place decides what a failover must read again.
                exc.completed_sources = exc.completed_sources | frozenset(nbytes)
                raise
            if abort_check is not None:
                abort_check()
            self.descriptors_posted += descriptors
            self.handles_opened += opened
            self.last_read_s = time.perf_counter() - started
            return ReadReport(nbytes, paths, descriptors, opened)

    def _read_nixl(
        self,
        sources: "Mapping[str, SourceInfo]",
        requests: "Mapping[str, Sequence[Range]]",
        arena: "torch.Tensor",
        timeout_s: float,
        abort_check: "Callable[[], None] | None" = None,
        gone: "Callable[[], Collection[str]] | None" = None,
    ) -> tuple[dict[str, int], int]:
        agent = self.nixl(required=True)
        assert agent is not None
        self._register_nixl([k for k, w in self._where.items() if w == _location(arena)], required=True)
        base = arena.data_ptr()
        local_mem, local_dev = _location(arena)
        remote_mem: dict[str, str] = {}
        remote_dev: dict[str, int] = {}
        ops: dict[str, list[tuple[int, int, int]]] = {}
        for source_id, ranges in requests.items():
            source = sources[source_id]
            if not source.agent_metadata:
                raise TransferError(
                    f"source {source_id}: exports no NIXL metadata (it runs without NIXL) and cannot be "
                    f"read over CUDA IPC from here ({self._choices[source_id][2].reason})", source_id=source_id,
                )
            agent.connect(source_id, source.agent_name, source.agent_metadata)
            first = source.tensors[0] if source.tensors else None
            remote_mem[source_id] = first.mem_type.value if first is not None else "DRAM"
            remote_dev[source_id] = first.device_id if first is not None else 0
            last = self._nixl_ops.get(source_id)
            if last is None or last[0] is not ranges or last[1] != base:  # the same list every steady cycle
                last = self._nixl_ops[source_id] = (ranges, base, [(remote, base + offset, n) for remote, offset, n in ranges])
            ops[source_id] = last[2]
        before = agent.descriptors_posted
        stats = agent.read_many(ops, remote_mem=remote_mem, remote_dev=remote_dev, local_mem=local_mem,
                                local_dev=local_dev, timeout_s=timeout_s, merge=False, abort_check=abort_check,
                                gone=gone)
        return {s: st.nbytes for s, st in stats.items()}, agent.descriptors_posted - before

    def forget(self, source_id: str) -> None:
        """A source expired or left the version: close its IPC handles and NIXL connection."""
        with self._lock:
            self._choices.pop(source_id, None)
            self._checked.pop(source_id, None)
            self._nixl_ops.pop(source_id, None)
            if self._ipc is not None:
                self._ipc.forget(source_id)
            if self._nixl is not None:
                self._nixl.disconnect(source_id)

    def known_sources(self) -> set[str]:
        return set(self._choices)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._ipc is not None:
                    self._ipc.close()
            finally:
                if self._nixl is not None and self._owns_nixl:
                    self._nixl.close()
                elif self._nixl is not None:  # borrowed: take back only our registrations
                    self._drop([k for k in self._storages if k in self._nixl_registered])
                self._storages.clear()
                self._index.clear()
                self._where.clear()

    def __enter__(self) -> "RoutingTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transport {self._name} is closed")

    def __repr__(self) -> str:
        return (f"RoutingTransport({self._name!r}, mode={self.mode!r}, regions={len(self._storages)}, "
                f"nixl={'on' if self._nixl is not None else 'off'}, ipc={'on' if self._ipc is not None else 'off'})")
