"""NixlTransport: one NIXL agent per process, cached registrations, batched READs with retries.

Measured constraints this module is shaped by (nixl 1.5.1 / UCX, 2xH200 over NVLink, see
``feasibility.md`` section 11):

* Every descriptor in a request costs about 5 us: 10,000 x 256 KiB descriptors ran at 46 GB/s,
  64 large ones at 354 GB/s. So all ranges are coalesced (adjacent on BOTH sides) before posting,
  and every descriptor of one peer goes into ONE ``initialize_xfer`` request.
* Registering is costly per region, cheap per byte: :meth:`NixlTransport.register` pins a
  tensor's whole storage and caches it (:mod:`mx_refit.transport.nixl_memory`).
* STRIDED (Nx5) descriptors report DONE but move the WRONG bytes. They are never used; a column
  window is fetched per row or as a contiguous hull plus a local strided copy
  (:func:`mx_refit.ranges.plan_row_slice`).
* Metadata travels through the catalog (:meth:`NixlTransport.metadata` on the source,
  :meth:`NixlTransport.connect` on the reader); reloading, dead peers and the sockets a failed load
  leaks are handled in :mod:`mx_refit.transport.nixl_peers`. A transfer to a peer that died
  raises ``nixlRemoteDisconnectError`` when it is posted.
* The agent and its UCX progress thread (woken periodically, not busy-polling) are made in
  :mod:`mx_refit.transport.nixl_agent`.

Checked on 2xH200 with this module (torch 2.11, VRAM GPU1 -> GPU0): 1 GiB READ 239-329 GB/s; the
dim-1 half of a [8192, 8192] bf16 tensor took 66 ms per-row (8,192 descriptors) and 0.72 ms as a
hull plus local copy. On the CPU CI box (UCX cma + tcp, 2 shared cores) reads run at 1-5 GB/s.

Thread safety: the agent is created with NIXL's no-sync mode (no listen thread), so every agent
call here (and in the registration and peer tables, which share the agent) is serialised by one
lock; polling releases it between checks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mx_refit.errors import InvalidArgument, NotFound, TransferError
from mx_refit.ranges import Range, check_local_disjoint, coalesce, total_bytes
from mx_refit.transport.nixl_agent import DEFAULT_PROGRESS_WAKE_MS, create_agent
from mx_refit.transport.nixl_memory import Registrations
from mx_refit.transport.nixl_peers import RemoteAgents

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DEFAULT_PROGRESS_WAKE_MS", "NixlTransport", "TransferStats"]

log = logging.getLogger(__name__)

_MEM_TYPES = ("DRAM", "VRAM")
# NIXL exception class names that retrying cannot fix (bad descriptors, unknown memory).
_PERMANENT_ERRORS = {
    "nixlNotFoundError", "nixlInvalidParamError", "nixlNotSupportedError", "nixlMismatchError"
}
_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.001  # caps completion-detection lag at 1 ms (0.3% of an 8 GiB NVLink pull)
_BACKOFF_MAX_S = 1.0

@dataclass(frozen=True)
class TransferStats:
    """Outcome of one successful READ from one peer."""

    peer_key: str
    agent_name: str
    nbytes: int  # bytes moved
    descriptors: int  # descriptors in the (last, successful) request, after coalescing
    requested_ops: int  # ranges the caller asked for, before coalescing
    seconds: float  # wall time including retries
    attempts: int  # 1 + retries used

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Job:
    """One peer's READ inside :meth:`NixlTransport.read_many`."""

    peer_key: str
    agent_name: str
    ops: list[Range]
    requested: int
    remote_mem: str
    remote_dev: int
    local_mem: str
    local_dev: int
    handle: Any = None
    deadline: float = 0.0
    retry_at: float = 0.0
    attempts: int = 0
    last_error: str = ""
    permanent: bool = False  # retrying cannot help
    prepared: "_Prepared | None" = None


@dataclass
class _Prepared:
    """One peer's last checked read: the caller's ops list (trusted unchanged while it is the
    same object: receivers hand their cached plan's lists every steady cycle), the ranges to post,
    their bytes, and the NIXL descriptor lists once built. Valid while the memory locations and
    the local registrations (``generation``) are the same."""

    given: Sequence[Range]
    where: tuple[str, int, str, int, int]  # remote mem, remote dev, local mem, local dev, generation
    ops: list[Range]
    nbytes: int
    descs: tuple[Any, Any] | None = None  # (local, remote) NIXL descriptor lists

class NixlTransport:
    """One NIXL agent (per process) that registers local memory and READs from remote peers.

    Args:
        name: this agent's name; peers address it by this name, so it must be unique among them.
        backends: NIXL backends to instantiate.
        max_retries: retries per peer after the first attempt (ERR, timeout, transient errors).
        timeout_s: default per-attempt timeout of a READ.
        retry_backoff_s: first retry delay; doubles per retry (capped at 1 s).
        progress_wake_ms: wake-up period of the UCX progress thread, which otherwise sleeps until
            UCX signals an event. ``0`` is NIXL's busy poll (a core per process); ``None`` runs
            no progress thread (only this process's own calls progress it: a source then cannot
            serve peers that read over tcp).
        unreachable_s: how long an agent whose connection failed (it disconnected, or its
            metadata could not be loaded) is refused by :meth:`connect` without a load attempt.
    """

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        *,
        max_retries: int = 3,
        timeout_s: float = 60.0,
        retry_backoff_s: float = 0.05,
        progress_wake_ms: float | None = DEFAULT_PROGRESS_WAKE_MS,
        unreachable_s: float = 60.0,
    ) -> None:
        if not name:
            raise InvalidArgument("name: must be a non-empty agent name")
        if max_retries < 0:
            raise InvalidArgument(f"max_retries: {max_retries} must be >= 0")
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s: {timeout_s} must be > 0")
        if progress_wake_ms is not None and progress_wake_ms < 0:
            raise InvalidArgument(f"progress_wake_ms: {progress_wake_ms} must be >= 0 (or None)")
        # Listen thread off: metadata is exchanged through the catalog, never over NIXL's socket.
        self._agent: Any = create_agent(name, backends, progress_wake_ms)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransferError(f"agent {name}: NIXL backends {missing} are not available")
        self._name = name
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.retry_backoff_s = retry_backoff_s
        self._lock = threading.RLock()
        self._closed = False
        self._memory = Registrations(self._agent, name)
        self._remote = RemoteAgents(self._agent, unreachable_s)
        self.bytes_read = 0
        self.descriptors_posted = 0
        self.transfers = 0  # NIXL requests posted, retries included
        self.retries = 0
        self.descs_built = 0  # descriptor list pairs built (once per prepared read, not per cycle)
        # peer -> its last checked read; and the ops lists last checked disjoint together
        self._prepared: dict[str, _Prepared] = {}
        self._disjoint: tuple[Sequence[Range], ...] = ()

    # ------------------------------------------------------------------ identity / counters
    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def registrations(self) -> int:
        """Real NIXL ``register_memory`` calls so far."""
        return self._memory.registrations

    @property
    def remote_loads(self) -> int:
        """Real NIXL ``add_remote_agent`` calls so far."""
        return self._remote.remote_loads

    @property
    def unreachable_s(self) -> float:
        return self._remote.unreachable_s

    @unreachable_s.setter
    def unreachable_s(self, seconds: float) -> None:
        self._remote.unreachable_s = seconds

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory) for the catalog.

        Call it after registering; it changes whenever new memory is registered."""
        with self._lock:
            self._check_open()
            return bytes(self._agent.get_agent_metadata())

    # ------------------------------------------------------------------ registration
    def register(self, tensor: "torch.Tensor") -> bool:
        """Register the whole storage behind ``tensor`` unless it is already covered.

        Returns True when a NIXL registration happened, False on a cache hit (the tensor's bytes
        lie inside an already registered region of the same memory type and device). The storage
        is kept alive until it is deregistered, so a cached address can never be reused by a
        different allocation.
        """
        return self.register_many([tensor]) > 0

    def register_many(self, tensors: Iterable["torch.Tensor"]) -> int:
        """Register the storages of all ``tensors`` that are not yet covered, in one NIXL call per
        memory type (normally exactly one). Returns the number of new regions."""
        with self._lock:
            self._check_open()
            return self._memory.register_many(tensors)

    def region_of(self, tensor: "torch.Tensor") -> tuple[int, int]:
        """The registered region ``(addr, nbytes)`` holding ``tensor``'s bytes (register it first)."""
        with self._lock:
            return self._memory.region_of(tensor)

    def is_registered(self, addr: int, nbytes: int, mem: str = "DRAM", dev: int = 0) -> bool:
        """Whether local bytes ``[addr, addr + nbytes)`` lie inside registered memory."""
        with self._lock:
            return self._memory.covered(mem, dev, addr, nbytes)

    def deregister(self, tensor: "torch.Tensor") -> int:
        """Deregister every region that contains ``tensor``'s bytes (e.g. an arena being replaced
        by a bigger one) and release its storage. Returns the number of regions removed.

        Peers hold the old metadata until the next :meth:`metadata` is published."""
        with self._lock:
            self._check_open()
            return self._memory.deregister(tensor)

    def deregister_all(self) -> None:
        """Deregister every region and forget the cache (the storages may be freed afterwards)."""
        with self._lock:
            self._memory.deregister_all()

    # ------------------------------------------------------------------ peers
    def connect(self, peer_key: str, agent_name: str, metadata: bytes) -> str:
        """Make ``peer_key`` readable: load the peer's agent metadata unless exactly these bytes are
        already loaded. Changed metadata (the source restarted or registered more memory) replaces
        the old remote agent. Returns the remote agent name."""
        with self._lock:
            self._check_open()
            return self._remote.connect(peer_key, agent_name, bytes(metadata))

    def disconnect(self, peer_key: str) -> None:
        """Forget ``peer_key``; its remote agent is removed once no other peer key uses it."""
        with self._lock:
            self._remote.disconnect(peer_key)
            self._prepared.pop(peer_key, None)

    def _drop_disconnected(self, job: _Job) -> None:
        """The peer's endpoint failed (it died, or its link did): the read fails now, without
        retries, and its remote agent is removed, which frees its sockets and NIXL state. The
        peer key stays known, so the caller can still :meth:`disconnect` it; a later
        :meth:`connect` with new metadata (a restarted source) loads afresh."""
        job.permanent = True
        job.last_error += " (the remote agent disconnected: the source died or its link dropped)"
        with self._lock:
            self._remote.drop_disconnected(job.agent_name)

    # ------------------------------------------------------------------ reads
    def read(
        self,
        peer_key: str,
        ops: Sequence[Range],
        *,
        remote_mem: str = "DRAM",
        remote_dev: int = 0,
        local_mem: str = "DRAM",
        local_dev: int = 0,
        timeout_s: float | None = None,
    ) -> TransferStats:
        """READ ``ops`` = ``(remote_addr, local_addr, nbytes)`` ranges from one connected peer.

        Ranges are coalesced, then posted as ONE NIXL request. Each attempt is bounded by
        ``timeout_s`` (default: the transport's); ERR, timeouts and transient NIXL errors are
        retried ``max_retries`` times with exponential backoff.

        Raises:
            NotFound: ``peer_key`` was never connected.
            InvalidArgument: a local range is outside registered memory, or ranges conflict.
            TransferError: the transfer failed permanently or ran out of retries (names the peer
                and its agent).
        """
        return self.read_many({peer_key: ops}, remote_mem=remote_mem, remote_dev=remote_dev,
                              local_mem=local_mem, local_dev=local_dev, timeout_s=timeout_s)[peer_key]

    def read_many(
        self,
        requests: Mapping[str, Sequence[Range]],
        *,
        remote_mem: str | Mapping[str, str] = "DRAM",
        remote_dev: int | Mapping[str, int] = 0,
        local_mem: str = "DRAM",
        local_dev: int = 0,
        timeout_s: float | None = None,
        merge: bool = True,
        abort_check: Callable[[], None] | None = None,
        gone: Callable[[], Collection[str]] | None = None,
    ) -> dict[str, TransferStats]:
        """READ from several peers at once: every peer's request is posted before waiting on any,
        so the transfers overlap. ``remote_mem``/``remote_dev`` may be per-peer mappings (each
        trainer rank's GPU). Retry and error semantics are per peer as in :meth:`read`; after all
        peers settle, any that failed raise one :class:`TransferError` naming all of them (its
        ``source_id`` is the first, ``failed_sources`` all of them, ``completed_sources`` the
        peers whose request reached DONE: exactly the batches whose bytes are in place).
        Everything is validated before anything is posted.

        ``merge=False`` posts ``ops`` as given: for callers that already coalesced them and cut
        them at the remote's registration boundaries, which this transport cannot see.

        ``abort_check`` is called before posting and between polls; whatever it raises (a lost
        lease) ends the read at once: every posted request is released and the error propagates.
        ``gone`` is polled there too: a peer it names (the catalog expired it: a frozen process
        keeps its connection but serves nothing) has its pending request released and failed at
        once, without retries, instead of waiting out ``timeout_s`` per attempt."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise InvalidArgument(f"timeout_s: {timeout} must be > 0")
        _check_mem("local_mem", local_mem)
        started = time.monotonic()
        results: dict[str, TransferStats] = {}
        jobs: list[_Job] = []
        with self._lock:
            self._check_open()
            for key, ops in requests.items():
                peer = self._remote.peers.get(key)
                if peer is None:
                    raise NotFound(f"peer {key}: not connected (call connect() with its metadata first)")
                r_mem = remote_mem[key] if isinstance(remote_mem, Mapping) else remote_mem
                r_dev = remote_dev[key] if isinstance(remote_dev, Mapping) else remote_dev
                _check_mem(f"remote_mem[{key}]", r_mem)
                prepared = self._prepare(key, ops, merge, (r_mem, int(r_dev), local_mem, local_dev, 0))
                if not prepared.ops:
                    results[key] = TransferStats(key, peer.agent_name, 0, 0, len(ops), 0.0, 0)
                    continue
                jobs.append(_Job(key, peer.agent_name, prepared.ops, len(ops), r_mem, int(r_dev), local_mem,
                                 local_dev, prepared=prepared))

        checked = tuple(job.ops for job in jobs)
        if len(checked) != len(self._disjoint) or any(a is not b for a, b in zip(checked, self._disjoint)):
            try:
                check_local_disjoint([r for job in jobs for r in job.ops])
            except ValueError as exc:
                raise InvalidArgument(f"requests: two peers write the same local bytes: {exc}") from exc
            self._disjoint = checked

        try:
            failed = self._run(jobs, timeout, started, results, abort_check, gone)
        finally:
            for job in jobs:  # only non-None after an unexpected exception (e.g. KeyboardInterrupt)
                self._release(job)
        if failed:
            names = "; ".join(
                f"peer {j.peer_key} (agent {j.agent_name}): {j.last_error} after {j.attempts} attempt(s)"
                for j in failed
            )
            raise TransferError(
                f"agent {self._name}: READ failed from {names}", source_id=failed[0].peer_key,
                failed_sources=tuple(j.peer_key for j in failed), completed_sources=frozenset(results),
            )
        return results

    def _prepare(self, key: str, ops: Sequence[Range], merge: bool, where: tuple[str, int, str, int, int]) -> _Prepared:
        """``ops`` of peer ``key`` checked (coalesced unless ``merge`` is False, every local
        range inside registered memory), or the same list's check of an earlier read: a steady
        cycle does no per-range work here. Called under the lock."""
        where = (*where[:4], self._memory.generation)
        last = self._prepared.get(key)
        if last is not None and last.given is ops and last.where == where and not merge:
            return last
        local_mem, local_dev = where[2], where[3]
        try:
            merged = coalesce(ops) if merge else [(int(r), int(lo), int(n)) for r, lo, n in ops if n]
        except ValueError as exc:
            raise InvalidArgument(f"peer {key}: ops: {exc}") from exc
        for _remote, local, n in merged:
            if not self._memory.covered(local_mem, local_dev, local, n):
                raise InvalidArgument(
                    f"peer {key}: local range {local:#x}+{n} ({local_mem} device {local_dev}) "
                    f"is not inside memory registered with agent {self._name}; register() "
                    "the destination arena first"
                )
        prepared = _Prepared(ops, where, merged, total_bytes(merged))
        self._prepared[key] = prepared
        return prepared

    def _descs(self, job: _Job) -> tuple[Any, Any]:
        """The job's local and remote NIXL descriptor lists, built once per prepared read."""
        prepared = job.prepared
        if prepared is not None and prepared.descs is not None:
            return prepared.descs
        import numpy as np

        arr = np.asarray(job.ops, dtype=np.uint64)
        local = np.empty_like(arr)
        remote = np.empty_like(arr)
        local[:, 0], local[:, 1], local[:, 2] = arr[:, 1], arr[:, 2], job.local_dev
        remote[:, 0], remote[:, 1], remote[:, 2] = arr[:, 0], arr[:, 2], job.remote_dev
        descs = (self._agent.get_xfer_descs(local, job.local_mem), self._agent.get_xfer_descs(remote, job.remote_mem))
        self.descs_built += 1
        if prepared is not None:
            prepared.descs = descs
        return descs

    def _run(self, jobs: list[_Job], timeout: float, started: float, results: dict[str, TransferStats],
             abort_check: Callable[[], None] | None, gone: Callable[[], Collection[str]] | None) -> list[_Job]:
        """Post every job, then poll them all until each is DONE or out of retries; returns the
        failed jobs. Successful ones land in ``results``."""
        failed: list[_Job] = []
        if abort_check is not None:
            abort_check()
        for job in jobs:
            self._post(job, timeout)
        pending = list(jobs)
        sleep_s = _POLL_MIN_S
        while pending:
            if abort_check is not None:
                abort_check()
            dead = gone() if gone is not None else ()
            if dead:
                self._fail_gone(pending, failed, dead)
            now = time.monotonic()
            progressed = False
            for job in list(pending):
                if job.handle is None:  # waiting for a retry slot (or never posted)
                    if job.permanent or job.attempts > self.max_retries:
                        pending.remove(job)
                        failed.append(job)
                    elif now >= job.retry_at:
                        self._post(job, timeout)
                        progressed = True
                    continue
                state = self._state(job)
                if state == "DONE":
                    self._release(job)
                    pending.remove(job)
                    results[job.peer_key] = self._finish(job, started)
                    progressed = True
                elif state == "ERR" or time.monotonic() > job.deadline:
                    if state != "ERR":
                        job.last_error = f"timed out after {timeout:g} s"
                    self._release(job)
                    self._schedule_retry(job)
                    progressed = True
            if pending:
                # Never busy-spin: back off from 0.2 ms to 1 ms while nothing completes.
                sleep_s = _POLL_MIN_S if progressed else min(sleep_s * 2, _POLL_MAX_S)
                time.sleep(sleep_s)
        return failed

    def _fail_gone(self, pending: list[_Job], failed: list[_Job], dead: Collection[str]) -> None:
        """Fail the pending jobs of peers the catalog no longer holds live (a request that
        already reached DONE is left to the loop: its bytes are in place)."""
        for job in [j for j in pending if j.peer_key in dead]:
            if job.handle is not None and self._state(job) == "DONE":
                continue
            self._release(job)
            job.permanent = True
            job.last_error = f"the catalog expired source {job.peer_key}: its heartbeats stopped"
            pending.remove(job)
            failed.append(job)

    def _post(self, job: _Job, timeout: float) -> None:
        """Post ONE request over both descriptor lists (built once per prepared read); on
        failure schedule a retry."""
        job.attempts += 1
        with self._lock:
            if job.agent_name not in self._remote.loaded:
                job.last_error = f"remote agent {job.agent_name} is not loaded (it disconnected)"
                job.permanent = True
                return
            handle = None
            try:
                local_descs, remote_descs = self._descs(job)
                handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, job.agent_name)
                self.transfers += 1
                self.descriptors_posted += len(job.ops)
                state = self._agent.transfer(handle)
            except Exception as exc:
                if handle is not None:
                    job.handle = handle
                    self._release(job)
                job.last_error = f"{type(exc).__name__}: {exc}"
                if type(exc).__name__ in _PERMANENT_ERRORS:
                    job.last_error += " (remote range not registered by the peer, or bad descriptors)"
                    job.permanent = True
                elif type(exc).__name__ == "nixlRemoteDisconnectError":
                    self._drop_disconnected(job)
                self._schedule_retry(job)
                return
            job.handle = handle
            job.deadline = time.monotonic() + timeout
            if state == "ERR":
                job.last_error = "transfer() returned ERR"
                self._release(job)
                self._schedule_retry(job)

    def _state(self, job: _Job) -> str:
        with self._lock:
            try:
                return str(self._agent.check_xfer_state(job.handle))
            except Exception as exc:
                job.last_error = f"{type(exc).__name__}: {exc}"
                if type(exc).__name__ == "nixlRemoteDisconnectError":
                    self._drop_disconnected(job)
                return "ERR"

    def _release(self, job: _Job) -> None:
        """Release the request handle; always called, whatever the outcome (NIXL cancels an
        active request; if it cannot, the handle is parked on the agent's leak list)."""
        handle, job.handle = job.handle, None
        if handle is None:
            return
        with self._lock:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as exc:
                log.warning("peer %s: releasing a transfer handle failed: %s", job.peer_key, exc)

    def _schedule_retry(self, job: _Job) -> None:
        if not job.permanent and job.attempts <= self.max_retries:
            with self._lock:
                self.retries += 1
            delay = min(self.retry_backoff_s * (2 ** (job.attempts - 1)), _BACKOFF_MAX_S)
            job.retry_at = time.monotonic() + delay
            log.info("peer %s: READ attempt %d failed (%s); retrying in %.3f s",
                     job.peer_key, job.attempts, job.last_error, delay)

    def _finish(self, job: _Job, started: float) -> TransferStats:
        nbytes = job.prepared.nbytes if job.prepared is not None else total_bytes(job.ops)
        with self._lock:
            self.bytes_read += nbytes
        return TransferStats(job.peer_key, job.agent_name, nbytes, len(job.ops), job.requested,
                             time.monotonic() - started, job.attempts)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Remove remote agents, deregister memory and drop the agent. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._remote.unload_all()
            self._prepared.clear()
            try:
                self._memory.deregister_all()
            finally:
                self._closed = True
                # The C++ agent is destroyed with its last reference.
                self._agent = self._memory.agent = self._remote.agent = None

    def __enter__(self) -> "NixlTransport":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self._name}: transport is closed")

    def __repr__(self) -> str:
        return (
            f"NixlTransport({self._name!r}, peers={len(self._remote.peers)}, registrations={self.registrations}, "
            f"bytes_read={self.bytes_read}, transfers={self.transfers})"
        )


def _check_mem(field_name: str, mem: str) -> None:
    if mem not in _MEM_TYPES:
        raise InvalidArgument(f"{field_name}: {mem!r} is not one of {_MEM_TYPES}")
