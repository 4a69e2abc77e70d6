"""CUDA IPC data path for sources on the same node: device-to-device copies, no NIXL, no UCX.

Why it exists: for a same-GPU peer UCX moved bytes over ``tcp/lo`` at 0.4-0.5 GB/s on one H200
(issue 10), where a device copy runs at about 2 TB/s.

Source side (:meth:`CudaIpcTransport.export`): one ``cudaIpcMemHandle_t`` per registered CUDA region, taken on the
*allocation* that holds the region (``cuMemGetAddressRange``), plus the region's offset inside it. Exports are cached
per region, so republishing the same buffers costs nothing. Allocations made with ``expandable_segments`` (cuMemMap)
have no IPC handle: such a source exports nothing and readers fall back to NIXL.

Reader side (:meth:`CudaIpcTransport.read`): each handle is opened once and cached per (source, region) in a
:class:`HandleCache`; a changed handle (reallocated after a drain) is reopened; an expired source or a closing transport closes
its handles. The coalesced ranges become one batched copy kernel (:mod:`mx_refit.copies`) from :data:`KERNEL_MIN_COPIES` of them
on, else ``cuMemcpyAsync`` calls over a device's dedicated streams, or a verifying receiver's ``copy_hook`` kernel; waited on
once. A source in this process is read from its own addresses (CUDA cannot open its own handle).

Only the CUDA driver library (``libcuda.so.1``, through ctypes) and torch (streams, device UUIDs) are used.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mx_refit.errors import InvalidArgument, TransferError
from mx_refit.transport.base import CUDA_IPC, LocalNode, ReadReport, local_node
from mx_refit.types import CudaIpcExport, IpcRegion

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.ranges import Range
    from mx_refit.types import SourceInfo

__all__ = ["COPY_STREAMS", "HANDLE_BYTES", "CudaIpcTransport", "HandleCache", "device_uuid"]

log = logging.getLogger(__name__)

# A read of this many copies or more is spread over several streams. A device copy costs ~2.5 us
# of launch and tail on top of its bytes (370 copies of the Megatron-shaped model took 3.8 ms
# against 2.9 ms as one flat copy on one H200); on several streams those gaps overlap.
COPY_STREAMS = 4
SPREAD_MIN_COPIES = 16
# From this many ranges on a read is one batched kernel (mx_refit.copies), not a copy per range.
KERNEL_MIN_COPIES = 16
_COPY_OVERHEAD_BYTES = 5 << 20  # ~2.5 us at ~2 TB/s: what one copy's fixed cost is worth in bytes
HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(CUipcMemHandle)
UUID_BYTES = 16
_Copy = tuple[int, int, int]  # (source pointer, destination pointer, bytes): one device copy
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class _Driver:
    """The few CUDA driver calls the IPC path makes, through ctypes (no build step, no extra
    package). Calls run in the caller's current context; :meth:`bind` makes the primary context
    of a device current (torch's runtime uses the same primary context)."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise TransferError(f"CUDA IPC: the CUDA driver library is not available ({exc})") from exc
        self.lib = lib
        u64, vp = ctypes.c_uint64, ctypes.c_void_p
        sigs: dict[str, list[Any]] = {
            "cuInit": [ctypes.c_uint],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), u64],
            "cuIpcOpenMemHandle_v2": [ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint],
            "cuIpcCloseMemHandle": [u64],
            "cuMemGetAddressRange_v2": [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64],
            "cuMemcpyAsync": [u64, u64, ctypes.c_size_t, vp],
            "cuCtxSetCurrent": [vp],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), ctypes.c_int],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        self.check(lib.cuInit(0), "cuInit")
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self.memcpy_async = lib.cuMemcpyAsync

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise TransferError(f"CUDA IPC: {what} failed: {(text.value or b'?').decode()} (CUresult {rc})")

    def bind(self, device: int) -> None:
        """Make ``device``'s primary context (torch's) current on this thread."""
        ctx = self._contexts.get(device)
        if ctx is None:
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._contexts[device] = ctx
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def allocation_of(self, addr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), addr),
                   f"cuMemGetAddressRange({addr:#x})")
        return int(base.value), int(size.value)

    def export(self, base: int) -> bytes:
        handle = _IpcHandle()
        self.check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), base), f"cuIpcGetMemHandle({base:#x})")
        return bytes(bytearray(handle))

    def open(self, handle: bytes) -> int:
        raw = _IpcHandle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, _LAZY_ENABLE_PEER_ACCESS),
                   "cuIpcOpenMemHandle")
        return int(ptr.value)

    def close(self, ptr: int) -> None:
        self.check(self.lib.cuIpcCloseMemHandle(ptr), f"cuIpcCloseMemHandle({ptr:#x})")


_driver_lock = threading.Lock()
_driver: _Driver | None = None


def _cuda() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def device_uuid(device: int) -> bytes:
    """The 16-byte UUID of a CUDA device (what ``cuDeviceGetUuid`` returns)."""
    import hashlib

    import torch

    uuid = torch.cuda.get_device_properties(device).uuid
    raw = getattr(uuid, "bytes", None)  # a list of ints (torch's _CUuuid) or bytes
    if raw is not None and len(raw) == UUID_BYTES:
        return bytes(raw)
    return hashlib.blake2b(str(uuid).encode(), digest_size=UUID_BYTES).digest()


class _Lanes:
    """A device's dedicated copy streams and the events a read records on them (made once:
    creating CUDA events every read costs more than the read of a small model)."""

    def __init__(self, device: int, streams: int) -> None:
        import torch

        self.streams = [torch.cuda.Stream(device=device) for _ in range(streams)]
        self.handles = [ctypes.c_void_p(s.cuda_stream) for s in self.streams]
        self.ready = torch.cuda.Event()  # the arena's users are done with it
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.joined = [torch.cuda.Event() for _ in self.streams]  # [0] unused


@dataclass
class _Opened:
    ptr: int  # where the allocation is mapped in this process
    users: int  # (source, region) entries that use it


@dataclass
class _Program:
    """One read's device copies, valid while the same request lists (the receiver's cached
    ones, by identity) are read from the same exports into the same arena. Opening,
    translating and spreading are then skipped: a steady read goes straight to its copies."""

    requests: dict[str, Any]
    exports: dict[str, CudaIpcExport]
    arena_ptr: int
    lanes: _Lanes
    groups: list[list[tuple[int, int, int]]]
    nbytes: dict[str, int]
    batch: Any = None  # a mx_refit.copies.BatchedCopy doing every copy, or None (the groups do)
    flat: list[list[tuple[int, int, int]]] = field(default_factory=list)  # every copy, one group: for copy_hook

    def serves(self, sources: "Mapping[str, SourceInfo]", requests: "Mapping[str, Any]", arena: Any) -> bool:
        if len(requests) != len(self.requests) or arena.data_ptr() != self.arena_ptr:
            return False
        return all(
            self.requests.get(sid) is ranges
            and (sources[sid].cuda_ipc is self.exports[sid] or sources[sid].cuda_ipc == self.exports[sid])
            for sid, ranges in requests.items()
        )


@dataclass(frozen=True)
class _Entry:
    handle: bytes
    region: IpcRegion


class HandleCache:
    """Opened IPC handles per (source, region), reopened when a region's handle changes, closed
    when the source is forgotten or the cache closes.

    Several regions of one source may lie in one allocation (one handle): each handle is opened
    once per process (CUDA maps an allocation once) and reference counted. ``open_handle`` and
    ``close_handle`` are the CUDA calls (plain functions here, so the bookkeeping is testable
    without a GPU).
    """

    def __init__(self, open_handle: Callable[[bytes], int], close_handle: Callable[[int], None]) -> None:
        self._open_handle = open_handle
        self._close_handle = close_handle
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._opened: dict[bytes, _Opened] = {}
        self.opened = 0  # real opens, ever
        self.closed = 0

    def bases(self, source_id: str, regions: Sequence[IpcRegion]) -> dict[int, int]:
        """``region addr -> local address of the region's first byte`` for every region of
        ``source_id``; opens what is new or changed, closes what the source no longer exports."""
        wanted = {r.addr: r for r in regions}
        for key in [k for k in self._entries if k[0] == source_id]:
            stale = self._entries[key]
            region = wanted.get(key[1])
            if region is None or region.handle != stale.handle:
                del self._entries[key]
                self._drop(stale.handle)
        out: dict[int, int] = {}
        for addr, region in wanted.items():
            entry = self._entries.get((source_id, addr))
            if entry is None:
                opened = self._opened.get(region.handle)
                if opened is None:
                    opened = self._opened[region.handle] = _Opened(self._open_handle(region.handle), 0)
                    self.opened += 1
                opened.users += 1
                entry = self._entries[(source_id, addr)] = _Entry(region.handle, region)
            elif entry.region != region:  # same allocation, region moved inside it
                entry = self._entries[(source_id, addr)] = _Entry(region.handle, region)
            out[addr] = self._opened[region.handle].ptr + region.offset
        return out

    def forget(self, source_id: str) -> None:
        for key in [k for k in self._entries if k[0] == source_id]:
            self._drop(self._entries.pop(key).handle)

    def sources(self) -> set[str]:
        return {k[0] for k in self._entries}

    def close(self) -> None:
        for source_id in self.sources():
            self.forget(source_id)

    def _drop(self, handle: bytes) -> None:
        opened = self._opened[handle]
        opened.users -= 1
        if opened.users == 0:
            del self._opened[handle]
            self.closed += 1
            try:
                self._close_handle(opened.ptr)
            except Exception as exc:  # a dead exporter's mapping: nothing left to undo
                log.debug("closing an IPC mapping failed: %s", exc)

    def __len__(self) -> int:
        return len(self._opened)


def translate(
    requests: Sequence["Range"], regions: Sequence[IpcRegion], bases: Mapping[int, int], arena_base: int
) -> list[tuple[int, int, int]]:
    """``(remote, arena offset, n)`` ranges -> ``(local src ptr, dst ptr, n)`` device copies.

    Each range must lie inside one exported region (the receiver cuts merged reads at region
    edges, the same rule as for NIXL)."""
    import bisect

    ordered = sorted(regions, key=lambda r: r.addr)
    starts = [r.addr for r in ordered]
    out = []
    for remote, offset, n in requests:
        i = bisect.bisect_right(starts, remote) - 1
        if i < 0 or remote + n > ordered[i].addr + ordered[i].nbytes:
            raise InvalidArgument(f"remote range {remote:#x}+{n} lies in no exported CUDA IPC region")
        region = ordered[i]
        out.append((bases[region.addr] + (remote - region.addr), arena_base + offset, n))
    return out


class CudaIpcTransport:
    """Exports CUDA regions (source side) and copies from same-node sources (reader side).

    ``max_streams``: how many dedicated streams a read spreads its copies over once it has
    :data:`SPREAD_MIN_COPIES` or more (small copies then overlap instead of queueing one
    after another; one large copy is one copy on one stream).
    """

    def __init__(self, max_streams: int = COPY_STREAMS) -> None:
        if max_streams < 1:
            raise InvalidArgument(f"max_streams: {max_streams} must be >= 1")
        self._lock = threading.RLock()
        self._exports: dict[tuple[int, int], IpcRegion] = {}
        self._failed_export: str | None = None
        self._cache: HandleCache | None = None
        self._lanes: dict[int, _Lanes] = {}
        self.max_streams = max_streams
        self.last_streams = 0
        # (the per-source copy lists, stream count, their copies spread over the streams)
        self._spread_cache: tuple[tuple[list[_Copy], ...], int, list[list[_Copy]]] | None = None
        self._node: LocalNode = local_node()
        self.copies = 0
        self.bytes_read = 0
        self.last_copy_s = 0.0
        self.last_kernel = False  # whether the last read was one batched kernel
        self.last_timing: dict[str, float] = {}
        # source_id -> (request list, its key, device copies, bytes): a cycle's translation
        self._translated: dict[str, tuple[Any, Any, list[tuple[int, int, int]], int]] = {}
        # The last read, whole: a steady cycle (same request lists, same exports, same arena)
        # goes straight to the copies (see _Program).
        self._program: _Program | None = None
        # (thread, arena address) of a prime() whose stream setup the next read still owes
        self._primed: tuple[int, int] | None = None
        self._closed = False
        self.copy_hook: Any = None  # set for one pull by a verifying receiver (mx_refit.checksum_kernels.CopySums)

    @property
    def handles_opened(self) -> int:
        return self._cache.opened if self._cache is not None else 0

    # ---------------------------------------------------------------- source side
    def export(self, regions: Sequence[tuple[int, int]], device: int) -> CudaIpcExport | None:
        """The IPC export of CUDA ``regions`` on ``device`` (``None`` when the memory cannot be
        exported, e.g. expandable segments: readers then use NIXL)."""
        if not self._node.boot_id:
            return None  # readers could never prove they share this node
        with self._lock:
            out: list[IpcRegion] = []
            try:
                import torch

                driver = _cuda()
                with torch.cuda.device(device):
                    driver.bind(device)
                    for addr, nbytes in regions:
                        region = self._exports.get((addr, nbytes))
                        if region is None:
                            base, size = driver.allocation_of(addr)
                            if addr + nbytes > base + size:
                                raise TransferError(f"region {addr:#x}+{nbytes} spans several CUDA allocations")
                            region = IpcRegion(addr, nbytes, driver.export(base), addr - base)
                            self._exports[(addr, nbytes)] = region
                        out.append(region)
            except TransferError as exc:
                if self._failed_export != str(exc):
                    log.warning("no CUDA IPC export (readers on this node will use NIXL): %s", exc)
                    self._failed_export = str(exc)
                return None
            node = self._node
            return CudaIpcExport(node.boot_id, node.host_name, node.pid, node.pid_namespace,
                                 device_uuid(device), tuple(out))

    def forget_exports(self, regions: Sequence[tuple[int, int]]) -> None:
        """Drop cached exports (the regions were deregistered; their memory may be freed)."""
        with self._lock:
            for key in regions:
                self._exports.pop(tuple(key), None)  # type: ignore[arg-type]

    # ---------------------------------------------------------------- reader side
    def prime(self, arena: "torch.Tensor") -> None:
        """Do a steady read's stream setup now, while the refit waits for the catalog: bind the
        context and order the copy stream after the arena's users (their work queued so far;
        nothing else touches the arena before the read). The next read on this thread into
        ``arena`` skips it. A no-op until a read into ``arena`` made a steady program; harmless
        if no read follows. (Measured on the H200: it also wakes the GPU before the copy.)"""
        import torch

        with self._lock:
            self._primed = None  # only this refit's prime may count
            program = self._program
            if self._closed or program is None or program.arena_ptr != arena.data_ptr():
                return
            dev = arena.device.index if arena.device.index is not None else torch.cuda.current_device()
            lanes = program.lanes
            _cuda().bind(dev)
            lanes.ready.record(torch.cuda.current_stream(dev))
            lanes.streams[0].wait_event(lanes.ready)
            self._primed = (threading.get_ident(), program.arena_ptr)

    def read(
        self,
        sources: "Mapping[str, SourceInfo]",
        requests: "Mapping[str, Sequence[Range]]",
        arena: "torch.Tensor",
    ) -> ReadReport:
        """Copy every source's ``(remote, arena offset, n)`` ranges into ``arena`` on one
        dedicated stream of the arena's device; returns once every copy finished.

        Raises :class:`TransferError` naming the source when its handles cannot be opened or the
        source process is gone (before or after the copies): nothing of a dead source's memory
        is trusted."""
        import torch

        with self._lock:
            if self._closed:
                raise TransferError("CUDA IPC transport is closed")
            driver = _cuda()
            dev = arena.device.index if arena.device.index is not None else torch.cuda.current_device()
            with torch.cuda.device(dev):
                return self._read(driver, dev, sources, requests, arena)

    def _read(
        self,
        driver: _Driver,
        dev: int,
        sources: "Mapping[str, SourceInfo]",
        requests: "Mapping[str, Sequence[Range]]",
        arena: "torch.Tensor",
    ) -> ReadReport:
        import torch

        t0 = time.perf_counter()
        primed, self._primed = self._primed, None
        if self._cache is None:
            self._cache = HandleCache(driver.open, driver.close)
        opened_before = self._cache.opened
        program = self._program
        if program is not None and program.serves(sources, requests, arena):
            for source_id in requests:
                self._check_alive(source_id, program.exports[source_id])
            primed_here, bound = primed == (threading.get_ident(), program.arena_ptr), False
        else:
            primed_here, bound = False, True
            driver.bind(dev)  # opening handles needs the context
            program = self._prepare(sources, requests, arena, dev)
        lanes, groups, nbytes, batch = program.lanes, program.groups, program.nbytes, program.batch
        copies = sum(len(g) for g in groups) + (batch.blocks if batch is not None else 0)
        memcpy = driver.memcpy_async
        t1 = time.perf_counter()
        if not primed_here:  # else prime() did this while the catalog answered
            if not bound:
                driver.bind(dev)
            # Copies wait for whatever the arena's users queued before this refit.
            lanes.ready.record(torch.cuda.current_stream(dev))
            lanes.streams[0].wait_event(lanes.ready)
        lanes.begin.record(lanes.streams[0])  # here, not in prime(): the copies' own time
        if self.copy_hook is not None:  # copies that also checksum (each byte read once) replace the batch
            groups, batch = self.copy_hook.launch(groups if batch is None else program.flat, arena, lanes.streams[0]), None
        if batch is not None:
            with torch.cuda.stream(lanes.streams[0]):
                batch.launch()
        for i, group in enumerate(groups):
            if i:
                lanes.streams[i].wait_event(lanes.begin)
            handle = lanes.handles[i]
            for src, dst, n in group:
                rc = memcpy(dst, src, n, handle)
                if rc:
                    driver.check(rc, f"cuMemcpyAsync of {n} bytes")
        for i in range(1, len(groups)):
            lanes.joined[i].record(lanes.streams[i])
            lanes.streams[0].wait_event(lanes.joined[i])
        end = lanes.end
        end.record(lanes.streams[0])
        t2 = time.perf_counter()
        # Poll rather than block (a blocking wait wakes ~0.1 ms late, a tenth of a 10,000 x 256 KiB
        # pull), yielding the GIL each turn: a stage's poll must not starve a serving thread.
        while not end.query():
            time.sleep(0)
        end.synchronize()  # returns at once; raises what the copies raised
        t3 = time.perf_counter()
        self.last_streams = max(len(groups), 1 if batch is not None else 0)
        self.last_kernel = batch is not None
        self.last_copy_s = lanes.begin.elapsed_time(end) / 1e3  # the copies alone, on the device
        for source_id in requests:  # died while we copied: its bytes are not trusted
            export = sources[source_id].cuda_ipc
            assert export is not None
            self._check_alive(source_id, export)
        self.copies += copies
        self.bytes_read += sum(nbytes.values())
        self.last_timing = {"prepare_s": t1 - t0, "enqueue_s": t2 - t1, "wait_s": t3 - t2,
                            "check_s": time.perf_counter() - t3}
        return ReadReport(nbytes, {s: CUDA_IPC for s in requests}, copies,
                          self._cache.opened - opened_before)

    def _prepare(
        self,
        sources: "Mapping[str, SourceInfo]",
        requests: "Mapping[str, Sequence[Range]]",
        arena: "torch.Tensor",
        dev: int,
    ) -> _Program:
        """Open or check the sources' handles and translate the requests into device copies:
        one batched kernel or copies spread over the lanes' streams; remembered as the steady
        program."""
        assert self._cache is not None
        parts: list[list[_Copy]] = []
        nbytes: dict[str, int] = {}
        for source_id, ranges in requests.items():
            export = sources[source_id].cuda_ipc
            assert export is not None
            self._check_alive(source_id, export)
            if export.pid == self._node.pid and export.pid_namespace == self._node.pid_namespace:
                bases = {r.addr: r.addr for r in export.regions}  # our own memory
            else:
                try:
                    bases = self._cache.bases(source_id, export.regions)
                except TransferError as exc:
                    raise TransferError(f"source {source_id}: {exc}", source_id=source_id) from exc
            # The receiver hands the same (cached) request list every cycle: translate it once.
            key = (arena.data_ptr(), tuple(sorted(bases.items())), export.regions)
            cached = self._translated.get(source_id)
            if cached is None or cached[0] is not ranges or cached[1] != key:
                cached = self._translated[source_id] = (
                    ranges, key, translate(ranges, export.regions, bases, arena.data_ptr()),
                    sum(n for _, _, n in ranges),
                )
            parts.append(cached[2])
            nbytes[source_id] = cached[3]
        lanes = self._lanes.get(dev)
        if lanes is None or len(lanes.streams) != self.max_streams:
            lanes = self._lanes[dev] = _Lanes(dev, self.max_streams)
        from mx_refit.copies import batched_ranges

        batch = batched_ranges(flat := [c for part in parts for c in part], arena, KERNEL_MIN_COPIES)
        groups = [] if batch is not None else self._spread(parts, len(lanes.streams))
        exports = {sid: sources[sid].cuda_ipc for sid in requests}
        self._program = _Program(dict(requests), exports, arena.data_ptr(), lanes, groups, nbytes,  # type: ignore[arg-type]
                                 batch, [flat])
        return self._program

    def _spread(self, parts: list[list[_Copy]], streams: int) -> list[list[_Copy]]:
        """The cycle's copies as one group per stream, balanced by bytes plus a per-copy cost;
        cached, since the per-source lists are the same objects every steady cycle."""
        cached = self._spread_cache
        # Identity, not id(): the cache holds the lists, so a new list never passes for an old one.
        if (cached is not None and cached[1] == streams and len(cached[0]) == len(parts)
                and all(a is b for a, b in zip(cached[0], parts))):
            return cached[2]
        copies = [c for part in parts for c in part]
        if streams == 1 or len(copies) < SPREAD_MIN_COPIES:
            groups = [copies]
        else:
            groups = [[] for _ in range(streams)]
            load = [0] * streams
            for copy in sorted(copies, key=lambda c: -c[2]):  # largest first: greedy balance
                i = load.index(min(load))
                groups[i].append(copy)
                load[i] += copy[2] + _COPY_OVERHEAD_BYTES
            groups = [g for g in groups if g]
        self._spread_cache = (tuple(parts), streams, groups)
        return groups

    def _check_alive(self, source_id: str, export: CudaIpcExport) -> None:
        if export.pid_namespace != self._node.pid_namespace or not export.pid_namespace:
            return  # another pid namespace: the catalog's source TTL is the only witness
        try:
            os.kill(export.pid, 0)
        except ProcessLookupError:
            self.forget(source_id)
            raise TransferError(
                f"source {source_id}: its process (pid {export.pid}) is gone; its CUDA memory is "
                "not read", source_id=source_id,
            ) from None
        except PermissionError:
            pass  # alive, owned by another user

    def forget(self, source_id: str) -> None:
        """Close the handles of a source that expired or was replaced."""
        with self._lock:
            self._translated.pop(source_id, None)
            if self._program is not None and source_id in self._program.exports:
                self._program = self._primed = None  # it reads that source: made anew next read
            if self._cache is not None:
                self._cache.forget(source_id)

    def sources(self) -> set[str]:
        return self._cache.sources() if self._cache is not None else set()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._cache is not None:
                started = time.monotonic()
                self._cache.close()
                log.debug("closed CUDA IPC handles in %.3f s", time.monotonic() - started)
            self._lanes.clear()
            self._spread_cache = None
            self._program = self._primed = None
            self._exports.clear()
