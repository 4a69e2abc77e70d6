"""Inference side: discover a READY version, lease it, pull exactly what this worker needs.

:class:`Receiver` is the public face: it checks its arguments, builds its parts (catalog client,
transport, plugins, replica) and closes them; each refit runs on its
:class:`~mx_refit.receive.cycle.RefitCycle`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any, overload

from mx_refit.checks import AUTO, DIRECT, NO_FANOUT, STAGED, TREE, check_seconds
from mx_refit.config import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_LOAD_BATCH_BYTES,
    DEFAULT_RECEIVE_BUFFER_BYTES,
    DEFAULT_TRANSFER_TIMEOUT_S,
)
from mx_refit.errors import FailedPrecondition, MxRefitError, PartiallyUpdated, TransferError
from mx_refit.receive.cycle import RefitCycle, RefitResult
from mx_refit.receive.lease import LeaseRenewer
from mx_refit.receive.lease_order import discover
from mx_refit.receive.options import ReceiveOptions
from mx_refit.types import TargetLayout, VersionInfo

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.catalog.api import Catalog
    from mx_refit.catalog.client import CatalogClient
    from mx_refit.config import WeightSyncConfig
    from mx_refit.plugins import Hooks
    from mx_refit.receive.replica import ReplicaSource
    from mx_refit.transport.base import Transport
    from mx_refit.transport.nixl import NixlTransport

__all__ = ["Receiver", "RefitResult"]

log = logging.getLogger(__name__)


class _Kept[T]:
    """A receiver attribute kept on one of its parts (``options`` or ``cycle``): read and set
    there, so a refit started after a change uses the new value."""

    def __init__(self, part: str) -> None:
        self._part = part
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type) -> "_Kept[T]": ...

    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object, owner: type) -> "T | _Kept[T]":
        if obj is None:
            return self
        value: T = getattr(getattr(obj, self._part), self._name)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self._part), self._name, value)


class Receiver:
    """One inference worker's receiving endpoint.

    :param catalog: Catalog address (``host:port``) or any object satisfying the
        :class:`~mx_refit.catalog.api.Catalog` protocol (a ``CatalogClient``, an in-process
        ``CatalogService``, ...).
    :param target: The layout this worker needs; ``None`` asks the plugins (from ``engine``).
    :param engine: Optional engine object; when given, received tensors are loaded into it through
        the ``mx_refit_load_weights`` hook in batches of at most ``load_batch_bytes``.
    :param device: Where the receive arena lives (``"cpu"`` or ``"cuda:N"``).
    :param transport: The transport to pull with; ``None`` makes one for this receiver (closed
        with it). Pass :func:`mx_refit.shared_transport` to share the process's one agent
        between receivers of several models (and publishers).
    :param fanout: ``"none"`` (read every byte from the trainer sources) or ``"tree"``: read from
        the trainer sources and the ready replicas, spread by load, and after each complete
        refit offer the arena as a replica of that version (withdrawn, waiting for its readers,
        before the next refit writes the arena). With ``"tree"`` the returned tensors are
        served to other readers until then: treat them as read-only.
    :param max_readers_per_source: > 0: never read a source that already serves that many
        readers (the catalog enforces it at lease time); wait for a replica instead.
    :param receive_mode: ``"staged"`` (every byte into the receive arena first: a failed pull
        leaves the engine untouched, :meth:`stage`/:meth:`commit` work) or ``"direct"`` (into
        the engine's parameters through a buffer of at most ``receive_buffer_bytes``, chunk by
        chunk; needs ``engine``; generation must be paused; a failure after the first write
        raises :class:`~mx_refit.errors.PartiallyUpdated`; see :mod:`mx_refit.receive.direct`).
    :param receive_buffer_bytes: ``direct``: the buffer's size, the receive memory outside the
        parameters (>= :data:`~mx_refit.checks.MIN_RECEIVE_BUFFER_BYTES`, and one row of the
        widest tensor).
    """

    # Settings (checked by ReceiveOptions) and parts, read by every refit when it starts.
    model: _Kept[str] = _Kept("options")
    reader_id: _Kept[str] = _Kept("options")
    device: _Kept[str] = _Kept("options")
    lease_ttl_s: _Kept[float] = _Kept("options")
    transfer_timeout_s: _Kept[float] = _Kept("options")
    load_batch_bytes: _Kept[int] = _Kept("options")
    checksums: _Kept[bool] = _Kept("options")  # verify every pulled byte against the sources' checksums
    fanout: _Kept[str] = _Kept("options")
    max_readers_per_source: _Kept[int] = _Kept("options")
    delta: _Kept[str] = _Kept("options")  # off | auto | on: delta refits onto the verified version held
    client: _Kept[Catalog] = _Kept("_cycle")
    transport: _Kept[Transport] = _Kept("_cycle")
    hooks: _Kept[Hooks] = _Kept("_cycle")
    target: _Kept[TargetLayout] = _Kept("_cycle")
    engine: _Kept[Any] = _Kept("_cycle")
    replica: _Kept[ReplicaSource | None] = _Kept("_cycle")

    def __init__(
        self,
        catalog: "str | Catalog",
        model: str,
        *,
        target: TargetLayout | None = None,
        engine: Any = None,
        device: str = "cpu",
        reader_id: str | None = None,
        token: str | None = None,
        transport: "Transport | NixlTransport | None" = None,
        hooks: "Hooks | None" = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        load_batch_bytes: int = DEFAULT_LOAD_BATCH_BYTES,
        transport_mode: str = AUTO,
        checksums: bool = False,
        fanout: str = NO_FANOUT,
        max_readers_per_source: int = 0,
        delta: str = "off",
        delta_check_arena: bool = True,
        receive_mode: str = STAGED,
        receive_buffer_bytes: int = DEFAULT_RECEIVE_BUFFER_BYTES,
    ) -> None:
        from mx_refit.catalog.connect import as_catalog
        from mx_refit.plugins import Hooks
        from mx_refit.transport.routing import RoutingTransport

        # Every argument is checked before anything is built, connected or leased.
        self.options = options = ReceiveOptions(
            model, reader_id or f"reader-{os.getpid()}-{uuid.uuid4().hex[:8]}", device, lease_ttl_s,
            transfer_timeout_s, load_batch_bytes, checksums, fanout, max_readers_per_source, delta,
            delta_check_arena, receive_mode, receive_buffer_bytes,
        )
        self._dialled: CatalogClient | None = None  # dialled here from an address: closed here
        client: Catalog
        if isinstance(catalog, str):
            client = self._dialled = as_catalog(catalog, token=token)
        else:
            client = as_catalog(catalog, token=token)
        self._closing = False
        self._staged: RefitResult | None = None  # Receiver.stage -> Receiver.commit
        hooks = hooks or Hooks()
        target = target or hooks.target_layout(engine)
        routing = RoutingTransport.wrap(
            transport, transport_mode, name=f"mx-recv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._owns_transport = routing is not transport  # ours (a given NIXL one stays open)
        self._renewer = LeaseRenewer(f"mx-refit-lease[{options.reader_id}]")  # one thread for every refit's lease
        replica: ReplicaSource | None = None
        if fanout == TREE:
            from mx_refit.receive.replica import ReplicaSource

            replica = ReplicaSource(
                client, routing, model, f"replica-{options.reader_id}",
                ttl_s=lease_ttl_s, withdraw_timeout_s=lease_ttl_s + transfer_timeout_s,
            )
        self._cycle = RefitCycle(
            options, client=client, transport=routing, hooks=hooks, target=target,
            engine=engine, replica=replica, renewer=self._renewer,
        )

    @classmethod
    def from_config(
        cls,
        cfg: "WeightSyncConfig",
        *,
        target: TargetLayout | None = None,
        engine: Any = None,
        device: str = "cpu",
        catalog: "str | Catalog | None" = None,
        **overrides: Any,
    ) -> "Receiver":
        """A receiver for ``cfg.model_name`` with the config's lease TTL, transfer timeout,
        receive mode and buffer, ``full_tensors``, plugin allow-list and role overrides (``Hooks.configure`` receives the
        whole block).

        :param target: Default: the plugins' layout for ``engine`` with ``full_tensors`` from the
            config; an explicit target is used as given.
        :param catalog: Default: ``cfg.catalog.address`` with ``cfg.catalog.token``.
        :param overrides: Any other constructor argument (they win over the config).
        """

        from mx_refit.config import as_dict, catalog_argument

        kwargs: dict[str, Any] = {
            "token": cfg.catalog.token,
            "lease_ttl_s": cfg.lease_ttl_s,
            "transfer_timeout_s": cfg.transfer_timeout_s,
            "transport_mode": cfg.transport,
            "checksums": cfg.checksums,
            "fanout": cfg.fanout,
            "max_readers_per_source": cfg.max_readers_per_source,
            "delta": cfg.delta,
            "receive_mode": cfg.receive_mode,
            "receive_buffer_bytes": cfg.receive_buffer_bytes,
        }
        kwargs.update(overrides)
        if kwargs.get("hooks") is None:
            from mx_refit.plugins import Hooks

            kwargs["hooks"] = Hooks(allow=cfg.plugins)
        hooks = kwargs["hooks"]
        hooks.configure(as_dict(cfg))
        if target is None:
            target = dataclasses.replace(hooks.target_layout(engine), full_tensors=cfg.full_tensors)
        return cls(
            catalog_argument(cfg, catalog), kwargs.pop("model", cfg.model_name),
            target=target, engine=engine, device=device, **kwargs,
        )

    def discover(self, version: int | None = None, *, min_version: int = 0, wait_s: float = 0.0) -> VersionInfo:
        """The exact READY ``version``, or the newest READY one >= ``min_version``.

        With ``wait_s`` > 0, keeps asking until one appears or the time runs out.
        """
        return discover(self.client, self.model, version, min_version, wait_s)

    def refit(
        self, version: int | None = None, *, min_version: int = 0, wait_s: float = 0.0, notify: bool = True
    ) -> RefitResult:
        """Discover, lease, pull every needed byte, release, then materialise and load.

        Nothing reaches the engine until every byte has arrived and been size-checked and the
        lease is known to have been held for the whole pull (the catalog's answer to the
        release, or the lease's own deadline when every source promised a restart fence:
        ``stats.lease_confirmed_by``), so a failed pull leaves the engine's previous weights
        untouched. A lease that was lost (its TTL ran out,
        heartbeats could not reach the catalog, the catalog restarted) raises
        :class:`~mx_refit.errors.LeaseLost` naming the lease and the cause; a renewal that
        finds the lease gone aborts the pull at once. A source that fails mid-pull (killed, its
        NIXL agent disconnected, its reads timing out) has its ranges read from another source
        holding the same bytes (``stats.failed_over``); when none does, the refit raises
        :class:`~mx_refit.errors.TransferError` naming the source and the ranges.

        With ``receive_mode="direct"`` the bytes go into the engine chunk by chunk instead (see
        :mod:`mx_refit.receive.direct`): every check runs before the first write, a failure
        after it raises :class:`~mx_refit.errors.PartiallyUpdated`, and ``result.tensors`` is
        empty (the bytes are in the engine's parameters, not in an arena).

        :param notify: fire ``mx_refit_refit_done`` at the end. Engines that load the returned
            tensors themselves pass ``False`` and call ``hooks.refit_done(result.stats)`` once
            their load finished.

        On any error ``mx_refit_refit_failed`` fires (with the version, when one was found)
        before the error is re-raised.
        """
        return self._run(version, min_version, wait_s, notify, load=True)

    def stage(self, version: int | None = None, *, min_version: int = 0, wait_s: float = 0.0) -> RefitResult:
        """Everything :meth:`refit` does except loading: the version ends up in the receive
        arena (complete, lease confirmed, verified) while the engine keeps serving its current
        weights. :meth:`commit` then loads it in one short step.

        Staging again, or a :meth:`refit`, replaces what was staged (they reuse the arena). A
        failed stage leaves nothing staged and the engine untouched.
        """
        if self.options.receive_mode == DIRECT:
            raise FailedPrecondition(
                f"receiver {self.reader_id!r}: stage() needs receive_mode 'staged' (a staging arena); "
                f"receive_mode 'direct' writes the parameters during refit(), with generation paused"
            )
        self._staged = None  # the arena is about to be rewritten
        result = self._run(version, min_version, wait_s, notify=False, load=False)
        self._staged = result
        return result

    @property
    def receive_mode(self) -> str:
        """``"staged"`` or ``"direct"`` (fixed at construction)."""
        return self.options.receive_mode

    @property
    def receive_buffer_bytes(self) -> int:
        """``direct``: the most bytes the receive buffer holds (fixed at construction)."""
        return self.options.receive_buffer_bytes

    @property
    def staged(self) -> RefitResult | None:
        """The staged, not yet committed version (``None`` when nothing is staged)."""
        return self._staged

    def commit(self) -> RefitResult:
        """Load the staged version into the engine (through ``mx_refit_load_weights``) and fire
        ``mx_refit_refit_done``. ``stats.phase_seconds["commit"]`` is this step's wall time.

        :raises FailedPrecondition: nothing is staged (never staged, already committed, or a
            refit or failed stage replaced it).
        """
        staged, self._staged = self._staged, None
        if staged is None:
            raise FailedPrecondition(f"receiver {self.reader_id!r}: commit() without a staged version")
        began = time.perf_counter()
        try:
            self._cycle.load(staged.tensors)
        except Exception as exc:
            self._report_failure(staged.version.version, exc)
            raise
        phases = {**staged.stats.phase_seconds, "commit": time.perf_counter() - began}
        stats = dataclasses.replace(staged.stats, phase_seconds=phases)
        self.hooks.refit_done(stats)
        return dataclasses.replace(staged, stats=stats)

    def _report_failure(self, version: int | None, error: Exception) -> None:
        try:
            self.hooks.refit_failed(self.model, version, error)
        except Exception:  # a failing observer must not hide the refit's own error
            log.exception("mx_refit_refit_failed hook raised")

    def _run(self, version: int | None, min_version: int, wait_s: float, notify: bool, *, load: bool) -> RefitResult:
        check_seconds(wait_s, "wait_s", allow_zero=True)
        if load:
            self._staged = None  # the refit rewrites the arena the staged tensors view
        attempt: list[int] = []  # the version being refitted, once discovered
        try:
            return self._cycle.run(version, min_version, wait_s, notify, attempt, load)
        except Exception as exc:
            error = exc
            if self._closing and not isinstance(exc, (TransferError, PartiallyUpdated)):
                # Closed under the refit: whichever part noticed first (the lease, the catalog
                # client, the transport), the caller sees one kind of error.
                error = TransferError(f"receiver {self.reader_id!r} was closed during the refit: {exc}")
                error.__cause__ = exc
            self._report_failure(attempt[0] if attempt else version, error)
            if error is exc:
                raise
            raise error from exc

    @property
    def _arena(self) -> "torch.Tensor | None":
        """The receive arena (kept by the cycle across refits), for tests and benchmarks."""
        return self._cycle.arena

    def close(self) -> None:
        """Release what this receiver made: its transport (from a given one only the arena is
        deregistered) and the catalog client it dialled. A replica it offers is withdrawn first
        (waiting, bounded, for its readers). A refit running meanwhile fails with a
        :class:`~mx_refit.errors.TransferError` saying the receiver was closed."""
        self._closing = True
        if self.replica is not None:
            try:
                self.replica.withdraw()
            except MxRefitError as exc:  # closing anyway: its readers will see a transfer error
                log.warning("closing receiver %s: %s", self.reader_id, exc)
            self.replica.stop()
        self._renewer.close()
        if self._owns_transport:
            self.transport.close()
        else:
            for held in (self._cycle.arena, self._cycle.buffer):
                if held is not None:
                    self.transport.deregister(held)
        self._cycle.arena = self._cycle.buffer = None
        if self._dialled is not None:
            self._dialled.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
