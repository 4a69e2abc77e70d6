"""One refit, phase by phase: find the version (and lease it, in discovery), plan, lease,
pull, verify, release, then offer, materialise and load.

:class:`RefitCycle` is the receiver's working part: it holds the receive arena and the cached
plans across refits, runs each phase as one method, and times the phases with one stopwatch
(``RefitStats.phase_seconds``). When the lease is taken is a :mod:`~mx_refit.receive.lease_order`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mx_refit.checks import DIRECT, batches
from mx_refit.errors import ChecksumMismatch, TransferError
from mx_refit.receive.delta import DeltaCosts, DeltaPull, DeltaState, apply, changed_only, check_records, plan_delta
from mx_refit.receive.failover import merged_pulls
from mx_refit.receive.lease_order import lease_order
from mx_refit.receive.plans import PlanCache, region_edges
from mx_refit.types import RefitStats, TargetLayout, VersionInfo

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.catalog.api import Catalog
    from mx_refit.checksum_kernels import CopySums
    from mx_refit.checksums import KnownSums, Verification
    from mx_refit.plan import ReceivePlan
    from mx_refit.plugins import Hooks
    from mx_refit.receive.failover import FailoverPull
    from mx_refit.receive.lease import LeaseGuard, LeaseRenewer
    from mx_refit.receive.lease_order import Leased, Requests
    from mx_refit.receive.options import ReceiveOptions
    from mx_refit.receive.replica import ReplicaSource
    from mx_refit.transport.base import Transport

__all__ = ["RefitCycle", "RefitResult"]

log = logging.getLogger(__name__)


@dataclass
class RefitResult:
    """One completed refit. ``tensors`` are views of the receive arena: valid until the next
    refit reuses it (engines copy them into their own parameters)."""

    version: VersionInfo
    plan: "ReceivePlan"
    tensors: list[tuple[str, "torch.Tensor"]]
    stats: RefitStats


class Stopwatch:
    """Wall seconds of each phase of one refit, in the order the phases ran:
    ``with watch("plan"): ...``."""

    __slots__ = ("_began", "_phase", "seconds")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._phase = ""
        self._began = 0.0

    def __call__(self, phase: str) -> "Stopwatch":
        self._phase = phase
        return self

    def __enter__(self) -> None:
        self._began = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds[self._phase] = time.perf_counter() - self._began


class RefitCycle:
    """Runs a receiver's refits; owns its receive arena and plan cache.

    The parts (``client``, ``transport``, ``hooks``, ``target``, ``engine``, ``replica``) and the
    ``options`` are read when a refit runs: the receiver's attributes are these."""

    def __init__(
        self,
        options: "ReceiveOptions",
        *,
        client: "Catalog",
        transport: "Transport",
        hooks: "Hooks",
        target: TargetLayout,
        engine: Any,
        replica: "ReplicaSource | None",
        renewer: "LeaseRenewer",
    ) -> None:
        self.options = options
        self.client = client
        self.transport = transport
        self.hooks = hooks
        self.target = target
        self.engine = engine
        self.replica = replica
        self.arena: "torch.Tensor | None" = None  # registered once, reused every cycle
        self._plans = PlanCache()
        self._delta = DeltaState(options.delta_check_arena)
        self._costs = DeltaCosts()
        self.delta_refused = ""  # why the last refit was not a delta refit (delta "auto" or "on")
        self._estimate: tuple[float, float] | None = None  # (full, delta) seconds of the last choice
        self._copy_sums: "CopySums | None" = None  # the fused copy's hook, per widening
        self._armed: Any = None  # the CUDA IPC transport holding it during a pull
        self.buffer: "torch.Tensor | None" = None  # receive_mode direct: the bounce buffer, reused
        self._order = lease_order(client, options, renewer, self.prime)
        self._expected: "tuple[Requests | None, int]" = (None, 0)  # a pull's requests and their bytes

    def run(
        self, version: int | None, min_version: int, wait_s: float, notify: bool, attempt: list[int],
        load: bool = True,
    ) -> RefitResult:
        """One refit (see :meth:`mx_refit.Receiver.refit`); appends the version to ``attempt``
        once found. Nothing reaches the engine unless the lease is confirmed held. ``load=False``
        stops once the arena holds the version (:meth:`mx_refit.Receiver.stage`)."""
        watch = Stopwatch()
        with watch("discover"):
            info, lease = self._order.find(self.client, version, min_version, wait_s)
        attempt.append(info.version)
        try:
            self._forget_departed(info)
            with watch("plan"):
                plan, requests, widening = self.plan(info)
            registrations_before = self.transport.registrations
            with watch("lease"):
                leased = self.lease(info, requests, lease)
            lease = leased.lease
            if self.options.receive_mode == DIRECT:  # into the parameters, chunk by chunk
                from mx_refit.receive.direct import DirectRefit

                direct = DirectRefit(self, leased, plan)  # every check before the first byte
                direct.write(watch)
                stats = direct.finish(watch, notify, registrations_before)
                return RefitResult(version=leased.info, plan=plan, tensors=[], stats=stats)
            with watch("heartbeat_start"):  # the renewals run already: the arena's allocation
                full_bytes = widening.arena_bytes if widening else plan.arena_bytes
                delta = self._delta_plan(info, plan, self._planned_bytes(requests))
                arena = self._arena_for(max(full_bytes, delta.room if delta else 0))  # grown once for any delta
            self._delta.held = None  # the arena changes from here on
            pulled_by, blocks, delta = self._transfer(watch, leased, arena, widening, delta)
        except BaseException:
            if lease is not None:
                lease.abandon()
            raise
        with watch("release"):
            confirmed_by = self.release(leased)
        with watch("materialize"):
            if self.replica is not None:  # complete, confirmed (and verified): offer it to the next readers
                self.replica.offer(leased.info.version, requests, arena)
            tensors = list(plan.materialize(arena))
        if load:
            with watch("load"):
                requests = self._plans.plan(leased.info, self.target, self.hooks)[1]
                self.load(changed_only(tensors, arena, delta.touched, requests) if delta else tensors)
                if self.options.delta != "off":  # verified bytes: the base of the next delta
                    self._delta.remember(leased.info, self._plans.key, arena, plan.arena_bytes,
                                         proof=not self._costs.last_full_faster)
        else:  # staged: the engine may never get these bytes, so they are no delta base
            self._delta = DeltaState(self.options.delta_check_arena)
        stats = self._stats(leased, plan, tensors, pulled_by, blocks, confirmed_by, watch.seconds,
                            self.transport.registrations - registrations_before)
        if self.options.delta != "off":
            self._costs.learn(watch.seconds["pull"] + watch.seconds["verify"], stats.bytes_pulled, delta,
                              warm=not stats.new_registrations and not stats.handles_opened)
            full_s, delta_s = self._estimate or (0.0, 0.0)
            stats = dataclasses.replace(stats, full_estimate_s=full_s, delta_estimate_s=delta_s)
        if delta is not None:
            stats = dataclasses.replace(stats, kind="delta", bytes_changed=delta.bytes_changed)
        elif self.delta_refused:
            stats = dataclasses.replace(stats, delta_refused=self.delta_refused)
        if notify:
            self.hooks.refit_done(stats)
        log.info(
            "refit %s v%d: %d tensors, %.1f MB in %.3fs (%.2f GB/s) over %s", stats.model, stats.version,
            stats.tensors, stats.bytes_pulled / 1e6, stats.seconds, stats.gbps, stats.transport,
        )
        return RefitResult(version=leased.info, plan=plan, tensors=tensors, stats=stats)

    # -- the phases, in order ---------------------------------------------------------------------
    def _forget_departed(self, info: VersionInfo) -> None:
        live = {s.source_id for s in info.sources}
        for gone in self.transport.known_sources() - live:  # expired or replaced: close its handles
            self.transport.forget(gone)

    def plan(self, info: VersionInfo) -> "tuple[ReceivePlan, Requests, Verification | None]":
        """The plan (cached by layout), the trainer sources' reads it needs (what the arena
        mirrors, in their addresses; widened to whole blocks with checksums) and the widening."""
        plan, requests = self._plans.plan(info, self.target, self.hooks)
        if not self.options.checksums:
            return plan, requests, None
        widening = self._plans.widen(info, plan, requests)
        return plan, widening.requests, widening

    def lease(self, info: VersionInfo, requests: "Requests", held: "LeaseGuard | None") -> "Leased":
        """The lease (held since discovery, or taken now naming where to read)."""
        if held is None and self.replica is not None:
            self.replica.withdraw()  # nobody reads the arena any more before it is written
        return self._order.lease(self.client, info, requests, held)

    def _pull_summing(
        self, leased: "Leased", arena: "torch.Tensor", widening: "Verification | None",
    ) -> "tuple[FailoverPull, CopySums | KnownSums | None]":
        """The pull, and with checksums the block sums taken as the bytes came in: by the CUDA
        IPC copy itself (valid after one read with no failover), or, for a DRAM arena, batch by
        batch on a worker while the next batch transfers (:mod:`mx_refit.receive.overlap`)."""
        if (widening is not None and arena.device.type == "cpu" and len(widening.blocks()[0])
                and leased.requests == widening.requests):  # read from the trainers, not translated to replicas
            from concurrent.futures import ThreadPoolExecutor

            from mx_refit.receive.overlap import pull_and_sum

            with ThreadPoolExecutor(1, thread_name_prefix="mx-refit-checksum") as worker:
                pulls, known = pull_and_sum(widening, arena, lambda batch: self.pull(leased, arena, batch), worker)
            return merged_pulls(pulls), known
        fused = self._arm_copy_sums(widening, arena)
        try:
            pulled = self.pull(leased, arena)
        finally:
            self._disarm_copy_sums()
        return pulled, None if pulled.failed_over else fused

    def _planned_bytes(self, requests: "Requests") -> int:
        """Bytes ``requests`` reads, summed once per requests object (the cached plan's, every
        steady cycle), not once per range per cycle."""
        if self._expected[0] is not requests:
            self._expected = (requests, sum(n for ranges in requests.values() for _, _, n in ranges))
        return self._expected[1]

    def pull(self, leased: "Leased", arena: "torch.Tensor", requests: "Requests | None" = None) -> "FailoverPull":
        """Every planned byte (or those of ``requests``, a batch of them) into ``arena`` from
        the chosen holders; a holder that fails mid-pull has its ranges read from another, or
        the pull fails naming it and the ranges (:mod:`mx_refit.receive.failover`)."""
        from mx_refit.receive.failover import pull_with_failover

        info, lease = leased.info, leased.lease
        requests = leased.requests if requests is None else requests
        lease.watch_sources({*leased.sources, *(s.source_id for s in info.sources)})  # every holder failover may read
        pulled = pull_with_failover(
            self.transport, info, leased.sources, requests, arena, timeout_s=self.options.transfer_timeout_s,
            abort_check=lease.check,  # a lost lease ends the pull at once
            gone=lease.gone_sources,  # a source whose heartbeats stopped fails over at once
            edges=region_edges, label=f"refit of model {self.options.model!r} version {info.version}",
        )
        moved = sum(pulled.report.nbytes.values())
        expected = self._planned_bytes(requests)
        if moved != expected:
            raise TransferError(f"pulled {moved} bytes but the plan needs {expected}")
        return pulled

    def verify(
        self, leased: "Leased", arena: "torch.Tensor", widening: "Verification | None",
        fused: "CopySums | KnownSums | None" = None,
    ) -> int:
        """Every pulled block against its checksum, still under the lease: a reader whose bytes
        fail is not a completed read (``wait_read`` keeps waiting for it), and the publisher's
        buffers are still there for a retry of the same version. ``fused``: the sums taken
        during the pull (:meth:`_pull_summing`). Returns the blocks verified."""
        if widening is None:
            return 0
        from mx_refit.checksums import verify

        return verify(arena, widening, {s.source_id: s for s in leased.info.sources}, fused)

    def _delta_plan(self, info: VersionInfo, plan: "ReceivePlan", full_bytes: int) -> DeltaPull | None:
        """The delta refit's reads when the arena provably holds the delta's base and the delta
        is estimated faster than pulling ``full_bytes`` (:class:`~mx_refit.receive.delta.DeltaCosts`),
        else None (``delta_refused`` says why; :mod:`mx_refit.receive.delta`)."""
        self.delta_refused, self._estimate = "", None
        self._costs.last_full_faster = False
        if self.options.delta == "off":
            return None
        requests = self._plans.plan(info, self.target, self.hooks)[1]
        pull = None
        if self.options.names_sources:
            self.delta_refused = "fan-out and reader caps pull whole versions"
        else:
            self.delta_refused = self._delta.refusal(info, self._plans.key, requests, self.arena)
        if not self.delta_refused:
            pull = plan_delta(info, requests, plan.arena_bytes)
            check_s = self._delta.check_s if self.options.delta_check_arena else 0.0
            refused, self._estimate = self._costs.choose(full_bytes, pull, check_s)  # "on": reported only
            if self.options.delta == "auto":
                self.delta_refused = refused
                self._costs.last_full_faster = self._estimate is not None and bool(refused)
        if not self.delta_refused and self.arena is not None:
            self.delta_refused = self._delta.arena_changed(self.arena, plan.arena_bytes)
        if self.delta_refused:
            log.info("refit %s v%d: full pull: %s", self.options.model, info.version, self.delta_refused)
            return None
        return pull

    def _transfer(
        self, watch: Stopwatch, leased: "Leased", arena: "torch.Tensor", widening: "Verification | None",
        delta: DeltaPull | None,
    ) -> "tuple[FailoverPull, int, DeltaPull | None]":
        """Pull and verify: the delta (applied into the arena), or the whole version; a delta
        whose bytes fail their checksums is dropped, loudly, for a full pull under the same lease."""
        if delta is not None:
            try:
                with watch("pull"):
                    pulled_by = self.pull(dataclasses.replace(leased, requests=delta.requests), arena)
                with watch("verify"):
                    blocks = self.verify(leased, arena, delta.widening)
                    check_records(arena, leased.info, delta)
                    apply(arena, leased.info, self._plans.plan(leased.info, self.target, self.hooks)[1], delta)
                return pulled_by, blocks, delta
            except ChecksumMismatch as exc:
                log.warning("refit %s v%d: the delta failed verification, pulling the version whole: %s",
                            self.options.model, leased.info.version, exc)
                self.delta_refused = f"the delta failed verification: {exc}"
        with watch("pull"):
            pulled_by, sums = self._pull_summing(leased, arena, widening)
        with watch("verify"):
            blocks = self.verify(leased, arena, widening, sums)
        return pulled_by, blocks, None

    def release(self, leased: "Leased") -> str:
        """Every byte is in the arena: this reader is done with the publisher's buffers. The
        lease is confirmed held until now (by the catalog's answer, or by its own deadline when
        every source the pull may have read promised a fence), or LeaseLost: the bytes may have
        been mutated under the pull, and nothing may reach the engine. Returns how it was
        confirmed."""
        fences = [s.lease_fence_s for s in (*leased.sources.values(), *leased.info.sources)]
        return leased.lease.release(completed=True, fence_s=min(fences, default=0.0))

    def load(self, tensors: list[tuple[str, "torch.Tensor"]]) -> None:
        """Into the engine (if any), in batches of at most ``load_batch_bytes``."""
        if self.engine is not None:
            for batch in batches(tensors, self.options.load_batch_bytes):
                self.hooks.load_weights(self.engine, batch)

    # -- helpers ----------------------------------------------------------------------------------
    def _arm_copy_sums(self, widening: "Verification | None", arena: "torch.Tensor") -> "CopySums | None":
        """With checksums on a GPU arena: the CUDA IPC copy checksums the blocks it copies (each
        byte read once, :class:`~mx_refit.checksum_kernels.CopySums`); kept per widening."""
        ipc = getattr(self.transport, "ipc", None)
        if widening is None or ipc is None or arena.device.type != "cuda":
            return None
        from mx_refit import checksum_kernels as kernels

        if not kernels.available(arena):
            return None
        hook = self._copy_sums
        if hook is None or hook.widening is not widening:
            import torch

            hook = self._copy_sums = kernels.CopySums(widening.blocks(), torch.empty(
                len(widening.blocks()[0]), dtype=torch.int64, device=arena.device))
            hook.widening = widening
        hook.launches = 0
        self._armed = ipc()
        self._armed.copy_hook = hook
        return hook

    def _disarm_copy_sums(self) -> None:
        if self._armed is not None:
            self._armed.copy_hook, self._armed = None, None

    def prime(self) -> None:
        """Ready the transport's next read into the arena (run while the catalog answers)."""
        prime = getattr(self.transport, "prime", None)
        if prime is None or self.arena is None:
            return
        try:
            prime(self.arena)
        except Exception as exc:  # an optimisation only: the read does the setup itself
            log.debug("receiver %s: priming the read failed: %s", self.options.reader_id, exc)

    def direct_buffer(self, nbytes: int) -> "torch.Tensor":
        """receive_mode direct: the registered bounce buffer (at most ``receive_buffer_bytes``;
        kept across refits while it is large enough and within the setting). A staged arena
        left from an earlier refit is dropped: it is receive memory outside the parameters."""
        import torch

        self._drop("arena")
        if self.buffer is None or not nbytes <= self.buffer.numel() <= self.options.receive_buffer_bytes:
            from mx_refit.receive.memory import check_arena_fits, device_free_bytes

            self._drop("buffer")
            device = self.options.device
            check_arena_fits(nbytes, device, device_free_bytes(device), reader=self.options.reader_id)
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.transport.register_many([self.buffer], nixl=False)
        return self.buffer

    def _drop(self, part: str) -> None:
        held = getattr(self, part)
        if held is not None:
            setattr(self, part, None)
            self.transport.deregister(held)

    def _arena_for(self, nbytes: int) -> "torch.Tensor":
        """The receive arena: registered once, reused every cycle, grown only when needed."""
        import torch

        self._drop("buffer")  # receive_mode direct's, when the mode changed
        if self.arena is None or self.arena.numel() < nbytes:
            from mx_refit.receive.memory import check_arena_fits, device_free_bytes

            device = self.options.device
            check_arena_fits(nbytes, device, device_free_bytes(device), reader=self.options.reader_id)
            old = self.arena
            self.arena = torch.empty(nbytes, dtype=torch.uint8, device=self.options.device)
            if old is not None:
                self.arena[: old.numel()] = old  # what it holds may be the next delta's base
                self.transport.deregister(old)
            # Pinned now; registered with NIXL only when a source is read over NIXL.
            self.transport.register_many([self.arena], nixl=False)
        return self.arena

    def _stats(
        self, leased: "Leased", plan: "ReceivePlan", tensors: list[Any], pulled_by: "FailoverPull", blocks: int,
        confirmed_by: str, phases: dict[str, float], new_registrations: int,
    ) -> RefitStats:
        report = pulled_by.report
        return RefitStats(
            model=self.options.model,
            version=leased.info.version,
            tensors=len(tensors),
            bytes_pulled=sum(report.nbytes.values()),
            bytes_needed=plan.bytes_needed,
            descriptors=report.descriptors,
            seconds=phases["pull"],
            new_registrations=new_registrations,
            sources=len(leased.requests),
            plan_seconds=phases["plan"],
            transport=report.path,
            handles_opened=report.handles_opened,
            blocks_verified=blocks,
            phase_seconds=phases,
            replicas_read=len(leased.sources.keys() - {s.source_id for s in leased.info.sources}),
            failed_over=pulled_by.failed_over,
            bytes_reread=pulled_by.bytes_reread,
            lease_confirmed_by=confirmed_by,
            compile_target=self._plans.compile_target,
            receive_memory_bytes=self.arena.numel() if self.arena is not None else 0,
        )
