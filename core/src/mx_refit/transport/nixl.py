"""NixlTransport: one NIXL agent per process, cached registrations, batched READs with retries.

Measured constraints this module is shaped by (nixl 1.5.1 / UCX, 2xH200 over NVLink, see
``feasibility.md`` section 11):

* Every descriptor in a request costs about 5 us: 10,000 x 256 KiB descriptors ran at 46 GB/s,
  64 large ones at 354 GB/s. So all ranges are coalesced (adjacent on BOTH sides) before posting,
  and every descriptor of one peer goes into ONE ``initialize_xfer`` request.
* Registering 10,000 regions took 0.43 s, one 2.5 GiB region 0.4 ms. So :meth:`register` pins a
  tensor's whole *storage* (an arena), caches it, and treats any tensor inside an already
  registered region as a hit; :meth:`register_many` registers all new regions in one call.
* STRIDED (Nx5) descriptors report DONE but move the WRONG bytes. They are never used; a column
  window is fetched per row or as a contiguous hull plus a local strided copy
  (:func:`mx_refit.ranges.plan_row_slice`).
* The agent runs without the listen thread: metadata travels through the catalog
  (:meth:`metadata` on the source, :meth:`connect` on the reader). A source must publish its
  metadata AFTER registering, and again whenever it registers more memory; :meth:`connect` reloads
  a peer whenever its metadata bytes change (restart or new registrations).
* ``add_remote_agent`` returns the name as ``bytes``; loading new metadata for an agent name that
  is already loaded fails with ``NIXL_ERR_NOT_ALLOWED`` (the old one must be removed first); a
  transfer to a peer that died raises ``nixlRemoteDisconnectError`` when it is posted.
* Every failed ``add_remote_agent`` of a dead peer leaks a UCX socket that nothing can free (3 per
  source death when reads retried by reloading its metadata). So a peer that disconnected is
  removed at once (``remove_remote_agent`` frees its endpoints) and never reloaded inside a read,
  and an agent whose connection failed is not loaded again with the same metadata for
  ``unreachable_s``: a restarted source brings new metadata (and, from a Publisher, a new name).

Checked on 2xH200 with this module (torch 2.11, VRAM GPU1 -> GPU0): 1 GiB READ 239-329 GB/s; the
dim-1 half of a [8192, 8192] bf16 tensor took 66 ms per-row (8,192 descriptors) and 0.72 ms as a
hull plus local copy. On the CPU CI box (UCX cma + tcp, 2 shared cores) reads run at 1-5 GB/s.

Idle cost: NIXL's Python wrapper (1.5.1) starts UCX's progress thread with ``pthrDelay=0``, so
its ``poll()`` on the workers' event fds never blocks and an idle agent burns 65-100% of a core.
:func:`_create_agent` gives the thread a wake-up period instead (``progress_wake_ms``): it then
sleeps in ``poll()`` until UCX signals an event (a peer's READ arriving over tcp, a wire-up) or
the period passes, costing well under 1% of a core idle with unchanged pull figures
(``benchmarks/bench_idle.py``). The thread is still needed: without it a passive source whose
peer reads over a two-sided transport (tcp) never answers.

Thread safety: the agent is created with NIXL's no-sync mode (no listen thread), so every agent
call here is serialised by one lock; polling releases it between checks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mx_refit.errors import InvalidArgument, NotFound, TransferError
from mx_refit.ranges import Range, RegionIndex, check_local_disjoint, coalesce, total_bytes

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["NixlTransport", "TransferStats"]

log = logging.getLogger(__name__)

_MEM_TYPES = ("DRAM", "VRAM")
# NIXL exception class names that retrying cannot fix (bad descriptors, unknown memory).
_PERMANENT_ERRORS = {
    "nixlNotFoundError", "nixlInvalidParamError", "nixlNotSupportedError", "nixlMismatchError"
}
_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.001  # caps completion-detection lag at 1 ms (0.3% of an 8 GiB NVLink pull)
_BACKOFF_MAX_S = 1.0
# UCX progress thread wake-up period. Events wake it at once; the period only bounds the delay
# after an event that poll() missed (NIXL works around such a UCX bug the same way).
DEFAULT_PROGRESS_WAKE_MS = 20.0
_AGENT_INIT_LOCK = threading.Lock()


def _load_nixl() -> tuple[Any, Any]:
    """Import ``nixl_agent``/``nixl_agent_config``; the meta package first, then a bare variant
    (installing only ``nixl-cu12``/``nixl-cu13`` provides no ``nixl`` module)."""
    from mx_refit.preflight import require_transport

    require_transport()  # without torch or NIXL: MissingExtra, "install `mx-refit[transport]`"
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu13._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
        except ImportError:
            from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
    from mx_refit._logsetup import route_nixl_logs_to_stderr

    route_nixl_logs_to_stderr()  # NIXL logs to stdout by default; stdout belongs to the caller
    return nixl_agent, nixl_agent_config


def _create_agent(name: str, backends: Sequence[str], progress_wake_ms: float | None) -> Any:
    """A NIXL agent without the listen thread, its UCX progress thread waking every
    ``progress_wake_ms`` (``0``: NIXL's default busy poll; ``None``: no progress thread).

    The wrapper exposes no delay option and sets ``pthrDelay = 0`` on the config it builds, so the
    delay is set on that config as it reaches the bindings' ``nixlAgent`` constructor, for the
    duration of this one construction (serialised by a lock)."""
    nixl_agent, nixl_agent_config = _load_nixl()
    config = nixl_agent_config(
        enable_prog_thread=progress_wake_ms is not None, enable_listen_thread=False, backends=list(backends)
    )
    if not progress_wake_ms:
        return nixl_agent(name, config)
    import sys

    bindings: Any = getattr(sys.modules.get(nixl_agent.__module__), "nixlBind", None)
    construct = getattr(bindings, "nixlAgent", None)
    if construct is None:  # a wrapper laid out differently: keep its default, say so
        log.warning("NIXL wrapper %s has no nixlBind.nixlAgent; progress thread left busy-polling",
                    nixl_agent.__module__)
        return nixl_agent(name, config)
    delay_us = max(1, int(progress_wake_ms * 1000))

    def with_wake_period(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = delay_us
        return construct(agent_name, agent_config)

    with _AGENT_INIT_LOCK:
        bindings.nixlAgent = with_wake_period
        try:
            return nixl_agent(name, config)
        finally:
            bindings.nixlAgent = construct


def _as_str(name: str | bytes) -> str:
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def _tensor_location(tensor: "torch.Tensor") -> tuple[str, int]:
    """(NIXL memory type, device id) of a tensor."""
    dev = tensor.device
    if dev.type == "cpu":
        return "DRAM", 0
    if dev.type == "cuda":
        if dev.index is not None:
            return "VRAM", dev.index
        import torch

        return "VRAM", torch.cuda.current_device()
    raise InvalidArgument(f"tensor.device: {dev} is not supported (cpu or cuda only)")


def _tensor_span(tensor: "torch.Tensor") -> tuple[int, int]:
    """(address, nbytes) of the bytes a (possibly non-contiguous) tensor can touch."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), (last + 1) * tensor.element_size()


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
class _Peer:
    agent_name: str
    metadata: bytes


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
        self._agent: Any = _create_agent(name, backends, progress_wake_ms)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransferError(f"agent {name}: NIXL backends {missing} are not available")
        self._name = name
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.retry_backoff_s = retry_backoff_s
        self._lock = threading.RLock()
        self._closed = False
        # Registered regions (mem, dev, addr, nbytes) -> the storage, kept alive while registered
        # (memory freed under a live registration could be reused and served to peers), plus a
        # per-location index for containment checks.
        self._registered: dict[tuple[str, int, int, int], Any] = {}
        self._regions: dict[tuple[str, int], RegionIndex] = {}
        self._peers: dict[str, _Peer] = {}
        self._loaded: dict[str, bytes] = {}  # remote agent name -> metadata loaded for it
        # Agents whose connection failed -> (when, why, their metadata); bounded, oldest first.
        self._unreachable: dict[str, tuple[float, str, bytes]] = {}
        self.unreachable_s = unreachable_s
        self.bytes_read = 0
        self.descriptors_posted = 0
        self.transfers = 0  # NIXL requests posted, retries included
        self.registrations = 0  # real NIXL register_memory calls
        self.remote_loads = 0  # real add_remote_agent calls
        self.retries = 0

    # ------------------------------------------------------------------ identity / metadata
    @property
    def agent_name(self) -> str:
        return self._name

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
        # mem type -> {(storage addr, storage nbytes, device): storage}
        new: dict[str, dict[tuple[int, int, int], Any]] = {}
        with self._lock:
            self._check_open()
            for i, t in enumerate(tensors):
                mem, dev = _tensor_location(t)
                addr, nbytes = _tensor_span(t)
                if nbytes == 0 or self._covered(mem, dev, addr, nbytes):
                    continue
                storage = t.untyped_storage()
                s_addr, s_bytes = storage.data_ptr(), storage.nbytes()
                if not (s_addr <= addr and addr + nbytes <= s_addr + s_bytes):
                    raise InvalidArgument(f"tensors[{i}]: bytes {addr:#x}+{nbytes} lie outside its storage")
                new.setdefault(mem, {})[(s_addr, s_bytes, dev)] = storage
            count = 0
            for mem, regions in new.items():
                # Drop regions contained in another new region of the same batch.
                keys = sorted(regions, key=lambda k: (k[2], k[0], -k[1]))
                kept: list[tuple[int, int, int]] = []
                for a, n, d in keys:
                    if kept and kept[-1][2] == d and a + n <= kept[-1][0] + kept[-1][1]:
                        continue
                    kept.append((a, n, d))
                descs = [(a, n, d, "") for a, n, d in kept]
                try:
                    # The returned reg list is not kept: regions are deregistered individually
                    # later (NIXL accepts any subset of what was registered).
                    self._agent.register_memory(descs, mem)
                except Exception as exc:
                    raise TransferError(
                        f"agent {self._name}: registering {len(descs)} {mem} region(s) "
                        f"({sum(n for _, n, _ in kept)} bytes) failed: {type(exc).__name__}: {exc}"
                    ) from exc
                self.registrations += 1
                for a, n, d in kept:
                    self._registered[(mem, d, a, n)] = regions[(a, n, d)]
                    self._regions.setdefault((mem, d), RegionIndex()).add(a, n)
                count += len(kept)
            return count

    def region_of(self, tensor: "torch.Tensor") -> tuple[int, int]:
        """The registered region ``(addr, nbytes)`` holding ``tensor``'s bytes (register it first)."""
        mem, dev = _tensor_location(tensor)
        addr, nbytes = _tensor_span(tensor)
        with self._lock:
            index = self._regions.get((mem, dev))
            found = index.find(addr, max(nbytes, 1)) if index is not None else None
        if found is None:
            raise InvalidArgument(f"tensor bytes {addr:#x}+{nbytes} ({mem} device {dev}) are not registered")
        return found

    def is_registered(self, addr: int, nbytes: int, mem: str = "DRAM", dev: int = 0) -> bool:
        """Whether local bytes ``[addr, addr + nbytes)`` lie inside registered memory."""
        with self._lock:
            return self._covered(mem, dev, addr, nbytes)

    def deregister(self, tensor: "torch.Tensor") -> int:
        """Deregister every region that contains ``tensor``'s bytes (e.g. an arena being replaced
        by a bigger one) and release its storage. Returns the number of regions removed.

        Peers hold the old metadata until the next :meth:`metadata` is published."""
        mem, dev = _tensor_location(tensor)
        addr, nbytes = _tensor_span(tensor)
        with self._lock:
            self._check_open()
            keys = [
                k for k in self._registered
                if k[0] == mem and k[1] == dev and k[2] <= addr and addr + nbytes <= k[2] + k[3]
            ]
            self._deregister(keys)
            return len(keys)

    def deregister_all(self) -> None:
        """Deregister every region and forget the cache (the storages may be freed afterwards)."""
        with self._lock:
            self._deregister(list(self._registered))

    def _deregister(self, keys: list[tuple[str, int, int, int]]) -> None:
        errors = []
        for mem in sorted({k[0] for k in keys}):
            descs = [(a, n, d, "") for m, d, a, n in keys if m == mem]
            try:
                self._agent.deregister_memory(self._agent.get_reg_descs(descs, mem))
            except Exception as exc:  # keep going: leave as little registered as possible
                errors.append(f"{mem}: {type(exc).__name__}: {exc}")
        for key in keys:
            self._registered.pop(key, None)
            self._regions[(key[0], key[1])].remove(key[2], key[3])
        if errors:
            raise TransferError(f"agent {self._name}: deregistration failed: {'; '.join(errors)}")

    def _covered(self, mem: str, dev: int, addr: int, nbytes: int) -> bool:
        index = self._regions.get((mem, dev))
        return index is not None and index.contains(addr, nbytes)

    # ------------------------------------------------------------------ peers
    def connect(self, peer_key: str, agent_name: str, metadata: bytes) -> str:
        """Make ``peer_key`` readable: load the peer's agent metadata unless exactly these bytes are
        already loaded. Changed metadata (the source restarted or registered more memory) replaces
        the old remote agent. Returns the remote agent name."""
        metadata = bytes(metadata)
        with self._lock:
            self._check_open()
            peer = self._peers.get(peer_key)
            if (
                peer is not None
                and peer.agent_name == agent_name
                and peer.metadata == metadata
                and self._loaded.get(agent_name) == metadata
            ):
                return agent_name
            loaded = self._loaded.get(agent_name)
            if loaded is not None and loaded != metadata:
                # NIXL refuses to load new metadata over a loaded agent (NIXL_ERR_NOT_ALLOWED).
                self._unload(agent_name)
            if agent_name not in self._loaded:
                self._refuse_unreachable(peer_key, agent_name, metadata)
                self._load(peer_key, agent_name, metadata)
            if peer is not None and peer.agent_name != agent_name:
                self._peers.pop(peer_key)
                self._unload_if_unused(peer.agent_name)
            self._peers[peer_key] = _Peer(agent_name, metadata)
            return agent_name

    def disconnect(self, peer_key: str) -> None:
        """Forget ``peer_key``; its remote agent is removed once no other peer key uses it."""
        with self._lock:
            peer = self._peers.pop(peer_key, None)
            if peer is not None:
                self._unload_if_unused(peer.agent_name)

    def _refuse_unreachable(self, peer_key: str, agent_name: str, metadata: bytes) -> None:
        failed = self._unreachable.get(agent_name)
        if failed is None:
            return
        when, why, dead_metadata = failed
        if metadata != dead_metadata or time.monotonic() - when >= self.unreachable_s:
            del self._unreachable[agent_name]
            return
        raise TransferError(
            f"peer {peer_key}: agent {agent_name} is unreachable ({why}); not reloading it for "
            f"{self.unreachable_s:g} s after the failure (a restarted source brings new metadata)",
            source_id=peer_key,
        )

    def _mark_unreachable(self, agent_name: str, why: str, metadata: bytes) -> None:
        self._unreachable.pop(agent_name, None)
        self._unreachable[agent_name] = (time.monotonic(), why, metadata)
        while len(self._unreachable) > 4096:
            del self._unreachable[next(iter(self._unreachable))]

    def _load(self, peer_key: str, agent_name: str, metadata: bytes) -> None:
        try:
            loaded_name = _as_str(self._agent.add_remote_agent(metadata))
        except Exception as exc:
            self._remove_remote(agent_name)  # whatever part of it NIXL kept
            self._mark_unreachable(agent_name, f"loading its metadata failed: {type(exc).__name__}", metadata)
            raise TransferError(
                f"peer {peer_key}: loading metadata of agent {agent_name} ({len(metadata)} bytes) "
                f"failed: {type(exc).__name__}: {exc}",
                source_id=peer_key,
            ) from exc
        self.remote_loads += 1
        if loaded_name != agent_name:
            self._remove_remote(loaded_name)
            raise InvalidArgument(
                f"peer {peer_key}: metadata belongs to agent {loaded_name!r}, not {agent_name!r}"
            )
        self._loaded[agent_name] = metadata

    def _unload(self, agent_name: str) -> None:
        self._loaded.pop(agent_name, None)
        self._remove_remote(agent_name)

    def _unload_if_unused(self, agent_name: str) -> None:
        if all(p.agent_name != agent_name for p in self._peers.values()):
            self._unload(agent_name)

    def _remove_remote(self, agent_name: str) -> None:
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as exc:  # already gone / disconnected: nothing left to undo
            log.debug("remove_remote_agent(%s) failed: %s", agent_name, exc)

    def _drop_disconnected(self, job: _Job) -> None:
        """The peer's endpoint failed (it died, or its link did): the read fails now, without
        retries, and its remote agent is removed, which frees its sockets and NIXL state. The
        peer key stays known, so the caller can still :meth:`disconnect` it; a later
        :meth:`connect` with new metadata (a restarted source) loads afresh."""
        job.permanent = True
        job.last_error += " (the remote agent disconnected: the source died or its link dropped)"
        with self._lock:
            metadata = self._loaded.get(job.agent_name)
            if metadata is not None:
                self._unload(job.agent_name)
                self._mark_unreachable(job.agent_name, "it disconnected", metadata)

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
    ) -> dict[str, TransferStats]:
        """READ from several peers at once: every peer's request is posted before waiting on any,
        so the transfers overlap. ``remote_mem``/``remote_dev`` may be per-peer mappings (each
        trainer rank's GPU). Retry and error semantics are per peer as in :meth:`read`; after all
        peers settle, any that failed raise one :class:`TransferError` naming all of them (its
        ``source_id`` is the first). Everything is validated before anything is posted.

        ``merge=False`` posts ``ops`` as given: for callers that already coalesced them and cut
        them at the remote's registration boundaries, which this transport cannot see.

        ``abort_check`` is called before posting and between polls; whatever it raises (a lost
        lease) ends the read at once: every posted request is released and the error propagates."""
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
                peer = self._peers.get(key)
                if peer is None:
                    raise NotFound(f"peer {key}: not connected (call connect() with its metadata first)")
                r_mem = remote_mem[key] if isinstance(remote_mem, Mapping) else remote_mem
                r_dev = remote_dev[key] if isinstance(remote_dev, Mapping) else remote_dev
                _check_mem(f"remote_mem[{key}]", r_mem)
                try:
                    merged = coalesce(ops) if merge else [(int(r), int(lo), int(n)) for r, lo, n in ops if n]
                except ValueError as exc:
                    raise InvalidArgument(f"peer {key}: ops: {exc}") from exc
                for _remote, local, n in merged:
                    if not self._covered(local_mem, local_dev, local, n):
                        raise InvalidArgument(
                            f"peer {key}: local range {local:#x}+{n} ({local_mem} device {local_dev}) "
                            f"is not inside memory registered with agent {self._name}; register() "
                            "the destination arena first"
                        )
                if not merged:
                    results[key] = TransferStats(key, peer.agent_name, 0, 0, len(ops), 0.0, 0)
                    continue
                jobs.append(
                    _Job(key, peer.agent_name, merged, len(ops), r_mem, int(r_dev), local_mem, local_dev)
                )

        try:
            check_local_disjoint([r for job in jobs for r in job.ops])
        except ValueError as exc:
            raise InvalidArgument(f"requests: two peers write the same local bytes: {exc}") from exc

        try:
            failed = self._run(jobs, timeout, started, results, abort_check)
        finally:
            for job in jobs:  # only non-None after an unexpected exception (e.g. KeyboardInterrupt)
                self._release(job)
        if failed:
            names = "; ".join(
                f"peer {j.peer_key} (agent {j.agent_name}): {j.last_error} after {j.attempts} attempt(s)"
                for j in failed
            )
            raise TransferError(
                f"agent {self._name}: READ failed from {names}", source_id=failed[0].peer_key
            )
        return results

    def _run(self, jobs: list[_Job], timeout: float, started: float,
             results: dict[str, TransferStats], abort_check: Callable[[], None] | None) -> list[_Job]:
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

    def _post(self, job: _Job, timeout: float) -> None:
        """Build both descriptor lists and post ONE request; on failure schedule a retry."""
        import numpy as np

        job.attempts += 1
        with self._lock:
            if job.agent_name not in self._loaded:
                job.last_error = f"remote agent {job.agent_name} is not loaded (it disconnected)"
                job.permanent = True
                return
            arr = np.asarray(job.ops, dtype=np.uint64)
            local = np.empty_like(arr)
            remote = np.empty_like(arr)
            local[:, 0], local[:, 1], local[:, 2] = arr[:, 1], arr[:, 2], job.local_dev
            remote[:, 0], remote[:, 1], remote[:, 2] = arr[:, 0], arr[:, 2], job.remote_dev
            handle = None
            try:
                local_descs = self._agent.get_xfer_descs(local, job.local_mem)
                remote_descs = self._agent.get_xfer_descs(remote, job.remote_mem)
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
        nbytes = total_bytes(job.ops)
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
            for agent_name in list(self._loaded):
                self._unload(agent_name)
            self._peers.clear()
            try:
                self.deregister_all()
            finally:
                self._closed = True
                self._agent = None  # the C++ agent is destroyed with its last reference

    def __enter__(self) -> "NixlTransport":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self._name}: transport is closed")

    def __repr__(self) -> str:
        return (
            f"NixlTransport({self._name!r}, peers={len(self._peers)}, registrations={self.registrations}, "
            f"bytes_read={self.bytes_read}, transfers={self.transfers})"
        )


def _check_mem(field_name: str, mem: str) -> None:
    if mem not in _MEM_TYPES:
        raise InvalidArgument(f"{field_name}: {mem!r} is not one of {_MEM_TYPES}")
