"""The worker side of the ``mx`` backend: vLLM 0.33's ``WeightTransferEngine`` on mx-refit.

One update cycle, as vLLM's worker drives it::

    init_weight_transfer_engine({catalog, model, ...})   # once: catalog reachable? layout known
    start_weight_update()                                # opens a session; touches nothing
    update_weights({"version": N} | [per-rank dicts])    # discover -> lease -> plan -> pull ALL
                                                         # bytes -> release -> check names ->
                                                         # layerwise reload -> load in batches
    finish_weight_update()                               # finalize the layerwise reload

Every byte of a version lands in the receiver's registered arena (reused across cycles) before
the first ``load_weights`` call, and layerwise reload starts only then. So any failure up to that
point (catalog unreachable, version not READY, coverage gap, NIXL error, tensors the model does
not have) leaves the model's weights untouched and the session reset; vLLM's worker also resets
its own session flag when ``update_weights`` raises.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

import mx_refit
from mx_refit.config import DIRECT
from mx_refit.errors import FailedPrecondition, MxRefitError, NotFound, PartiallyUpdated, Unavailable
from mx_refit.types import RefitStats, TargetLayout
from mx_refit_vllm.infos import MxInitInfo, MxUpdateInfo
from mx_refit_vllm.layout import check_names, check_shapes, target_layout, worker_coordinates
from mx_refit_vllm.params import ParamMap

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

    from mx_refit import Catalog, Hooks, Receiver, RefitResult

__all__ = ["MxWeightTransferEngine"]

log = logging.getLogger(__name__)


@dataclass
class _Session:
    """One start -> update* -> finish session."""

    started: float = field(default_factory=time.monotonic)
    layerwise: bool = False  # initialize_layerwise_reload ran on the target model
    staging: tuple[threading.Thread, dict[str, Any]] | None = None  # a phase="stage" pull
    loaded: list[RefitStats] = field(default_factory=list)


def _accelerator_present() -> bool:
    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "is_available"):
        return bool(accel.is_available())
    return torch.cuda.is_available()


class MxWeightTransferEngine(WeightTransferEngine[MxInitInfo, MxUpdateInfo]):
    """vLLM ``WeightTransferEngine`` backend ``"mx"``: pulls published versions over NIXL.

    Created by vLLM (``WeightTransferEngineFactory.create_engine``) after the model loads, one
    per worker. Uses the worker process's shared transport (``mx_refit.shared_transport()``, one
    NIXL agent) and one receiver with its receive arena per catalog model, so cycle 2 onward
    registers no new memory.
    """

    init_info_cls = MxInitInfo
    update_info_cls = MxUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.init_info: MxInitInfo | None = None
        self.layout: TargetLayout | None = None
        self._catalog: Catalog | None = None  # the first receiver's client, shared by the others
        self._transport: Any = None  # mx_refit.shared_transport(), once a receiver exists
        self._hooks: Hooks | None = None
        self._receivers: dict[str, Receiver] = {}
        self._session: _Session | None = None
        self._coords: dict[str, int] = {}
        self.params: ParamMap | None = None  # where rank-local windows land (rank_exact)
        self.last_update: MxUpdateInfo | None = None  # the last update info this worker acted on
        # The last load: bytes placed rank-exactly, tensors handed to vLLM's loader.
        self.last_load: dict[str, int] = {}
        self.last_refit: RefitStats | None = None  # the stats of the last version loaded
        # receive_mode direct: (model, version) whose load failed after its first write; the
        # parameters mix two versions until a refit succeeds (last_refit is None meanwhile).
        self.partially_updated: tuple[str, int | None] | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: MxInitInfo) -> None:
        """Connect to the catalog and fix this worker's target layout.

        Re-initialising (a new trainer, another catalog) drops the previous connection first.
        :raises Unavailable: the catalog cannot be reached at ``init_info.catalog``.
        :raises Unauthenticated: the catalog refused ``init_info.token``.
        """
        if self._session is not None:
            raise RuntimeError("init_transfer_engine called during a weight update; finish it first")
        self.shutdown()
        self._coords = worker_coordinates(self.parallel_config)
        quant_config = getattr(getattr(self, "vllm_config", None), "quant_config", None)
        self.params = None
        whole: tuple[str, ...] | None = None
        if init_info.rank_exact:
            self.params = ParamMap(
                self.model, self._coords["tp_rank"], self._coords["tp_size"], self._coords["ep_size"]
            )
            whole = self._whole_prefixes(self.params)
        # An FP8 engine asks for fp8_block (whole tensors); others for rank-exact windows.
        self.layout = target_layout(self.parallel_config, quant_config, whole)
        self.init_info = init_info
        receiver = self._receiver(init_info.model)  # dials the catalog; later models share it
        try:
            # A cheap, read-only call proves reachability and the token now, not mid-update.
            receiver.client.list_versions(init_info.model)
        except NotFound:
            pass  # reachable; nothing published under this name yet
        except BaseException as exc:
            self.shutdown()
            if isinstance(exc, Unavailable):
                raise Unavailable(f"mx: catalog unreachable at {init_info.catalog}: {exc}") from exc
            raise
        log.info(
            "mx engine ready: catalog %s, model %r, layout tp %d/%d ep %d/%d",
            init_info.catalog,
            init_info.model,
            self.layout.tp_rank,
            self.layout.tp_size,
            self.layout.ep_rank,
            self.layout.ep_size,
        )

    def start_weight_update(self) -> None:
        """Open a session. The model is not touched until every byte of a version has arrived."""
        self._require_init()
        if self._session is not None:
            raise RuntimeError("mx: start_weight_update called while a weight update is active")
        self._session = _Session()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Parse, receive and load one update.

        Accepts vLLM's per-rank list form too (indexed ``data_parallel_index * world_size +
        rank``, as vLLM's worker does) for callers that drive the engine directly. Synchronises
        the accelerator only when one is present, so CPU workers never fail here.
        """
        if isinstance(update_info, list):
            update_info = self._pick_rank_entry(update_info)
        if not isinstance(update_info, dict):
            raise ValueError(
                f"mx: update_info must be a dict or a list of dicts, got {type(update_info).__name__}"
            )
        try:
            typed = self.parse_update_info(update_info)
        except ValueError:
            self._abort_session()
            raise
        self.receive_weights(typed)
        if _accelerator_present():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: MxUpdateInfo) -> None:
        """Pull one published version in full, then place it into the model (``phase="load"``);
        or start pulling it in the background (``"stage"``), or place the staged one
        (``"commit"``).

        :raises Unavailable: catalog unreachable (names the address).
        :raises NotFound / FailedPrecondition: no such version, or not READY (names its state);
            a commit with nothing staged.
        :raises CoverageError / TransferError: the plan or the NIXL reads failed.
        :raises InvalidArgument: the version has tensors the model does not have.
        Any of these leaves the weights untouched and the session reset.
        """
        self._require_init()
        session = self._session
        if session is None:
            raise RuntimeError("mx: start_weight_update must be called before update_weights")
        self.last_update = update_info
        if self._require_init().receive_mode == DIRECT:
            self._direct(session, update_info)
            return
        if update_info.phase == "stage":
            self._stage(session, update_info)
            return
        if update_info.phase == "commit":
            staged = self._join_stage(session)
            result, what = staged
        else:
            self._join_stage(None)  # an unfinished stage would rewrite the arena under this load
            result, what = self._fetch(update_info, stage=False)
        began = time.perf_counter()
        self._load(session, result.tensors, what)
        stats = dataclasses.replace(
            result.stats, phase_seconds={**result.stats.phase_seconds, "commit": time.perf_counter() - began}
        )
        session.loaded.append(stats)
        self.last_refit = stats
        assert self._hooks is not None  # set by _receiver()
        self._hooks.refit_done(stats)  # only now: the model has the weights

    def _direct(self, session: _Session, update_info: MxUpdateInfo) -> None:
        """``receive_mode: direct``: the receiver writes the parameters chunk by chunk through
        its bounded buffer (:meth:`direct_targets`, :meth:`load_direct`); generation is paused
        (``phase="load"``). A failure before the first write leaves the weights untouched; after
        it, ``PartiallyUpdated``: the version is not reported as loaded (``last_refit`` is
        ``None``, ``partially_updated`` names it) and the caller must refit again."""
        init = self._require_init()
        if update_info.phase != "load":
            self._abort_session()
            raise FailedPrecondition(
                f"mx: MxUpdateInfo.phase={update_info.phase!r} needs MxInitInfo.receive_mode='staged' (a "
                f"staging arena); receive_mode 'direct' loads with phase='load', generation paused"
            )
        model_name = update_info.model or init.model
        wait_s = init.ready_timeout_s if update_info.wait_s is None else update_info.wait_s
        try:
            result = self._receiver(model_name).refit(
                update_info.version, min_version=update_info.min_version, wait_s=wait_s, notify=False
            )
        except PartiallyUpdated as exc:
            self.last_refit, self.partially_updated = None, (model_name, exc.version)
            self._abort_session()
            log.error("mx: %s", exc)
            raise
        except BaseException as exc:
            self._abort_session()
            if isinstance(exc, MxRefitError):
                log.warning("mx: direct load of %r not done, weights untouched: %s", model_name, exc)
            raise
        self.partially_updated = None
        session.loaded.append(result.stats)
        self.last_refit = result.stats
        assert self._hooks is not None
        self._hooks.refit_done(result.stats)

    def direct_targets(self, tensors: list[tuple[str, tuple[int, ...], str]]) -> dict[str, Any]:
        """Before a direct refit's first byte: the names checked (``strict_names``) and a row
        writer per rank window placed straight into a parameter (through
        ``mx_refit_direct_targets``)."""
        init = self._require_init()
        tp_size = self.layout.tp_size if self.layout else 1
        if init.strict_names:
            check_shapes(self.model, [(n, s) for n, s, _ in tensors], tp_size=tp_size, what="the version")
        self.last_load = {"placed_bytes": 0, "loader_tensors": 0}
        if self.params is None or self.layout is None or self.layout.full_tensors:
            return {}
        writers = self.params.row_writers(tensors)
        return {name: self._counted(write) for name, write in writers.items()}

    def _counted(self, write: Any) -> Any:
        def counted(first: int, rows: torch.Tensor) -> None:
            write(first, rows)
            self.last_load["placed_bytes"] += rows.numel() * rows.element_size()

        return counted

    def load_direct(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """One chunk's whole tensors (through ``mx_refit_load_weights``): rank windows placed,
        the rest through vLLM's ``load_weights``."""
        session = self._session
        assert session is not None, "a direct refit runs inside a weight-update session"
        placed, rest = 0, tensors
        if self.params is not None and self.layout is not None and not self.layout.full_tensors:
            placed, rest = self.params.place(tensors)
        self.last_load["placed_bytes"] += placed
        self.last_load["loader_tensors"] += len(rest)
        if rest:
            self._vllm_load(session, rest, "a direct refit's chunk")

    def _fetch(self, update_info: MxUpdateInfo, *, stage: bool) -> tuple[RefitResult, str]:
        """Every byte of the version in the arena, names checked; the model untouched."""
        init = self._require_init()
        model_name = update_info.model or init.model
        wait_s = init.ready_timeout_s if update_info.wait_s is None else update_info.wait_s
        what = (
            f"version {update_info.version} of {model_name!r}"
            if update_info.version is not None
            else f"newest READY version >= {update_info.min_version} of {model_name!r}"
        )
        try:
            receiver = self._receiver(model_name)
            pull = receiver.stage if stage else receiver.refit
            kwargs: dict[str, Any] = {} if stage else {"notify": False}
            result = pull(update_info.version, min_version=update_info.min_version, wait_s=wait_s, **kwargs)
            what = f"version {result.version.version} of {model_name!r}"
            if init.strict_names:
                check_names(
                    self.model, result.tensors, tp_size=self.layout.tp_size if self.layout else 1, what=what
                )
        except Unavailable as exc:
            if not stage:  # a stage's error is raised (and the session reset) by the commit
                self._abort_session()
            raise Unavailable(
                f"mx: catalog unreachable at {init.catalog} while fetching {what}: {exc}"
            ) from exc
        except BaseException as exc:
            if not stage:
                self._abort_session()
            if isinstance(exc, MxRefitError):
                log.warning("mx: %s not loaded, weights untouched: %s", what, exc)
            raise
        return result, what

    def _stage(self, session: _Session, update_info: MxUpdateInfo) -> None:
        """Start pulling ``update_info``'s version into the arena on a thread; return at once."""
        self._join_stage(None)
        box: dict[str, Any] = {}

        def pull() -> None:
            try:
                box["result"] = self._fetch(update_info, stage=True)
            except BaseException as exc:  # handed to the commit
                box["error"] = exc

        thread = threading.Thread(target=pull, name="mx-refit-stage", daemon=True)
        session.staging = (thread, box)
        thread.start()

    def _join_stage(self, session: _Session | None) -> tuple[RefitResult, str]:
        """Wait for the background stage; with ``session``, return it (or raise its error)."""
        current = self._session
        staging = current.staging if current is not None else None
        if staging is not None:
            staging[0].join()
            assert current is not None
            current.staging = None
        if session is None:
            return None  # type: ignore[return-value]
        if staging is None:
            self._abort_session()
            raise FailedPrecondition("mx: commit without a staged version (send phase='stage' first)")
        box = staging[1]
        if "error" in box:
            self._abort_session()
            raise box["error"]
        result: tuple[RefitResult, str] = box["result"]
        return result

    def finish_weight_update(self) -> None:
        """Finalize layerwise reload (process + copy into the kernel tensors) and close the session."""
        session = self._session
        if session is None:
            raise RuntimeError("mx: finish_weight_update called without a matching start_weight_update")
        self._session = None
        if session.layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
        for stats in session.loaded:
            log.info(
                "mx: loaded %s v%d: %d tensors, %.1f MB pulled in %.3fs (%.2f GB/s), %d new registrations",
                stats.model,
                stats.version,
                stats.tensors,
                stats.bytes_pulled / 1e6,
                stats.seconds,
                stats.gbps,
                stats.new_registrations,
            )

    def shutdown(self) -> None:
        """Drop the catalog connection, receive arenas and the NIXL agent (inference goes on)."""
        if self._session is not None:
            self._abort_session()
        receivers, self._receivers = self._receivers, {}
        for receiver in receivers.values():
            receiver.close()  # deregisters its arena; the first one also closes the catalog client
        self._catalog = None
        self._transport = None  # the process's shared agent stays for the next init
        self.init_info = None

    # -- internals --------------------------------------------------------------------------
    @property
    def last_stats(self) -> list[RefitStats]:
        """Stats of the versions loaded in the active session (empty outside one)."""
        return list(self._session.loaded) if self._session else []

    @property
    def receivers(self) -> dict[str, Receiver]:
        """One receiver (and receive arena) per catalog model this engine has loaded."""
        return dict(self._receivers)

    def _require_init(self) -> MxInitInfo:
        if self.init_info is None or self._catalog is None:
            raise RuntimeError("mx weight transfer not initialised: call init_weight_transfer_engine first")
        return self.init_info

    def _pick_rank_entry(self, entries: list[Any]) -> Any:
        world = int(getattr(self.parallel_config, "world_size", 1) or 1)
        c = self._coords or worker_coordinates(self.parallel_config)
        rank = c["pp_rank"] * c["tp_size"] + c["tp_rank"]
        index = c["dp_index"] * world + rank
        if not 0 <= index < len(entries):
            raise ValueError(
                f"mx: update_info list has {len(entries)} entries; this worker needs index {index}"
            )
        return entries[index]

    def _receiver(self, model_name: str) -> Receiver:
        receiver = self._receivers.get(model_name)
        if receiver is not None:
            return receiver
        init = self.init_info
        assert init is not None
        c = self._coords
        tag = f"dp{c.get('dp_index', 0)}-pp{c.get('pp_rank', 0)}-tp{c.get('tp_rank', 0)}"
        # One NIXL agent per worker process, shared by every model it receives.
        self._transport = mx_refit.shared_transport()
        if self._hooks is None:
            self._hooks = mx_refit.Hooks()
        receiver = mx_refit.Receiver(
            self._catalog or init.catalog,
            model_name,
            target=self.layout,
            device=init.arena_device or str(self.device),
            reader_id=f"vllm:{socket.gethostname()}:{os.getpid()}:{tag}",
            token=init.token,
            transport=self._transport,
            hooks=self._hooks,
            lease_ttl_s=init.lease_ttl_s,
            transfer_timeout_s=init.transfer_timeout_s,
            load_batch_bytes=init.load_batch_bytes,
            checksums=init.checksums,
            receive_mode=init.receive_mode,
            receive_buffer_bytes=init.receive_buffer_bytes,
            engine=self if init.receive_mode == DIRECT else None,  # direct: the receiver loads chunk by chunk
        )
        if self._catalog is None:
            self._catalog = receiver.client
        self._receivers[model_name] = receiver
        return receiver

    @staticmethod
    def _whole_prefixes(params: ParamMap) -> tuple[str, ...] | None:
        """The modules to pull whole, naming each in a warning; ``None``: pull everything whole."""
        if not params.unproven:
            return ()
        listed = "; ".join(f"{prefix or '<model>'}: {why}" for prefix, why in params.unproven.items())
        if params.renames:  # vLLM names != HF names: no prefix names them reliably
            log.warning("mx: whole HF tensors for every parameter: %d module(s) cannot be placed "
                        "rank-exactly and the model renames HF tensors: %s", len(params.unproven), listed)
            return None
        log.warning("mx: %d module(s) pulled as whole HF tensors and loaded by vLLM's loader "
                    "(their rank-local placement is not proven): %s", len(params.unproven), listed)
        return params.whole_prefixes()

    def _supports_layerwise(self) -> bool:
        # Models built by vLLM's loader had their layout recorded (record_metadata_for_reloading);
        # reloading anything else would restore parameters from empty metadata.
        try:
            from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        except ImportError:  # pragma: no cover - vLLM without layerwise reload
            return False
        info = LAYERWISE_INFO.get(self.model)
        return info is not None and bool(info.restore_metadata[0] or info.restore_metadata[1])

    def _load(self, session: _Session, tensors: list[tuple[str, torch.Tensor]], what: str) -> None:
        """Hand ``tensors`` to ``model.load_weights`` in bounded batches (under layerwise reload)."""
        assert self.init_info is not None and self._hooks is not None
        if self.params is not None and self.layout is not None and not self.layout.full_tensors:
            # Rank-local windows straight into the parameters; vLLM's loader gets the rest.
            placed, tensors = self.params.place(tensors)
            self.last_load = {"placed_bytes": placed, "loader_tensors": len(tensors)}
            log.debug("mx: placed %.1f MB rank-exactly; %d for vLLM's loader", placed / 1e6, len(tensors))
            if not tensors:
                return
        else:
            self.last_load = {"placed_bytes": 0, "loader_tensors": len(tensors)}
        self._vllm_load(session, tensors, what)

    def _vllm_load(self, session: _Session, tensors: list[tuple[str, torch.Tensor]], what: str) -> None:
        """``tensors`` through vLLM's own ``load_weights`` (under layerwise reload), in batches."""
        assert self.init_info is not None and self._hooks is not None
        if not session.layerwise and self._supports_layerwise():
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            session.layerwise = True
        done = 0
        try:
            for batch in mx_refit.batches(tensors, self.init_info.load_batch_bytes):
                # Through the hook so mx-refit wrappers (timing, tracing) see every batch.
                self._hooks.load_weights(self.model, batch)
                done += len(batch)
        except BaseException as exc:
            self._abort_session()
            raise RuntimeError(
                f"mx: loading {what} failed after {done} of {len(tensors)} tensors (every byte had "
                f"arrived; the model rejected a tensor). Layers that received nothing keep their "
                f"previous weights, layers loaded in part were processed with what arrived: {exc}"
            ) from exc

    def _abort_session(self) -> None:
        """Reset the session; if layerwise reload had started, put unloaded layers back."""
        session, self._session = self._session, None
        staging = session.staging if session is not None else None
        if staging is not None and staging[0] is not threading.current_thread():
            staging[0].join()
        if session is not None and session.layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            try:
                finalize_layerwise_reload(self.model, self.model_config)
            except Exception:  # already failing; keep the original error
                log.exception("mx: restoring layers after a failed load raised")
