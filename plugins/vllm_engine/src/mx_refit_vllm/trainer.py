"""The trainer side of the ``mx`` backend: vLLM's ``TrainerWeightTransferEngine`` on mx-refit.

For trainers that use vLLM's own RL API (plain PyTorch, FSDP, DTensor)::

    info = MxTrainerInitInfo(catalog="10.0.0.5:50051", model="qwen", world_size=W, rank=r)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    for step in ...:
        train_step()
        engine.send_weights()        # every rank; returns once inference no longer reads

Every rank publishes the pieces it holds (``WeightSource.iter_local`` shaped by the
``ParamMeta`` placements, registered in place, never gathered); rank 0 then drives the vLLM
client: ``start_weight_update`` -> ``update_weights({"version": v})`` -> ``finish_weight_update``,
and each inference worker pulls exactly the bytes it needs over NIXL. ``send_weights`` returns on
every rank only after the version has drained (no reader still holds a lease), so the optimizer
may then mutate the published parameters in place.

Pinned to vLLM 0.33's trainer API (``WeightSource.metadata`` as a cached property,
``iter_local``/``iter_full``, ``ParamMeta`` placements); vLLM 0.31's different ``WeightSource``
is not supported, and importing this module without that API raises one ImportError naming the
supported range (:data:`mx_refit_vllm.SUPPORTED_VLLM`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch

import mx_refit
from mx_refit.config import DEFAULT_SOURCE_TTL_S, DIRECT, check_count, check_flag, check_mode
from mx_refit.errors import InvalidArgument
from mx_refit.types import MeshPosition, PublishedTensor, Role
from mx_refit_vllm import BACKEND, SUPPORTED_VLLM, register

try:
    from vllm.distributed.weight_transfer.base import (
        ParamMeta,
        Replicate,
        Shard,
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        VLLMWeightSyncClient,
        WeightSource,
    )
except ImportError as exc:  # no vLLM, or one without (or with another) trainer weight-transfer API
    import importlib.metadata

    try:
        _installed = f"vllm {importlib.metadata.version('vllm')} is installed"
    except importlib.metadata.PackageNotFoundError:
        _installed = "vllm is not installed"
    raise ImportError(
        f"mx_refit_vllm.trainer needs vLLM {SUPPORTED_VLLM} (its trainer weight-transfer API); "
        f"{_installed} ({exc})"
    ) from exc

from mx_refit_vllm.infos import MxInitInfo, MxUpdateInfo

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit import Catalog, Publisher

__all__ = ["MxTrainerInitInfo", "MxTrainerWeightTransferEngine", "local_piece"]

log = logging.getLogger(__name__)

PAUSE_MODES = ("wait", "abort", "keep")  # vLLM's PauseMode


@dataclass
class MxTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``mx`` backend (``rank`` is keyword-only; rank 0 sends).

    :param catalog: Catalog address ``host:port`` (trainers and workers use the same one).
    :param model: The model name versions are published under.
    :param world_size: Number of trainer ranks that call ``send_weights`` (each one publishes).
    :param first_version: Version number of the first ``send_weights``; later calls add one.
        Every rank must agree; pick e.g. the training step when resuming.
    :param worker: Extra :class:`~mx_refit_vllm.infos.MxInitInfo` fields forwarded to the
        workers at ``init_weight_transfer_engine`` (``arena_device``, ``load_batch_bytes``, ...).
    :param staged: Start the workers' pull (``phase="stage"``) before pausing generation; the
        pause then covers the commit (the rest of the pull, if any, and the placement), and the
        pull overlaps the pause's drain of in-flight requests. ``False``: one ``phase="load"``
        inside the pause. Workers with ``worker={"receive_mode": "direct"}`` have no staging
        arena: their load is always one ``phase="load"`` inside the pause (``staged`` is set
        ``False``).
    :param pause: Pause generation around the load (or the commit) so no request sees a mix of
        versions: through the client's ``pause_generation(mode=...)`` / ``resume_generation()``
        when it has them (a wrapper around vLLM's engine client), or vLLM's ``/pause`` and
        ``/resume`` routes for ``HTTPVLLMWeightSyncClient``. A client that can do neither is
        refused at ``trainer_init``; set ``False`` only when nothing generates during refits.
    :param pause_mode: vLLM's pause mode: ``"wait"`` (in-flight requests finish first),
        ``"abort"`` or ``"keep"`` (frozen in the queue, resumed after).
    """

    backend: ClassVar[str] = BACKEND

    catalog: str
    model: str
    world_size: int = 1
    token: str | None = None
    first_version: int = 1
    ready_timeout_s: float = 300.0
    drain_timeout_s: float = 300.0
    update_timeout_s: float = 600.0
    source_ttl_s: float = DEFAULT_SOURCE_TTL_S
    worker: dict[str, Any] = field(default_factory=dict)
    staged: bool = True
    pause: bool = True
    pause_mode: str = "wait"

    def __post_init__(self) -> None:
        check_flag(self.staged, "MxTrainerInitInfo.staged")
        check_flag(self.pause, "MxTrainerInitInfo.pause")
        check_mode(self.pause_mode, "MxTrainerInitInfo.pause_mode", PAUSE_MODES)
        check_count(self.world_size, "MxTrainerInitInfo.world_size", minimum=1)
        if check_count(self.rank, "MxTrainerInitInfo.rank", minimum=0) >= self.world_size:
            raise InvalidArgument(
                f"MxTrainerInitInfo.rank: expected 0 <= rank < {self.world_size}, got {self.rank!r}"
            )
        check_count(self.first_version, "MxTrainerInitInfo.first_version", minimum=0)
        if not isinstance(self.worker, dict):
            raise InvalidArgument(
                f"MxTrainerInitInfo.worker: expected a dict, got {type(self.worker).__name__}"
            )
        # Build (and so validate) the worker payload now, on every rank, not at the first RPC.
        if self.worker_init_info().receive_mode == DIRECT:
            self.staged = False  # no staging arena: one phase="load" inside the pause

    def worker_init_info(self) -> MxInitInfo:
        """The init info every inference worker receives."""
        clash = {"catalog", "model", "token"} & set(self.worker)
        if clash:
            raise InvalidArgument(
                f"MxTrainerInitInfo.worker: {sorted(clash)} are set by the trainer info itself"
            )
        try:
            return MxInitInfo(catalog=self.catalog, model=self.model, token=self.token, **self.worker)
        except TypeError as exc:
            raise InvalidArgument(f"MxTrainerInitInfo.worker: {exc}") from exc


def pause_controls(client: Any, mode: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(pause, resume)`` for ``client``: nothing for a client that says it pauses around its
    own update session (``pauses_generation``, e.g. Dynamo's), its own ``pause_generation`` /
    ``resume_generation`` methods, else vLLM's ``/pause?mode=`` and ``/resume`` routes for its
    HTTP client.

    :raises InvalidArgument: the client can do neither (names ``pause=False``).
    """
    if getattr(client, "pauses_generation", False):  # it pauses around its own update session
        return (lambda: None), (lambda: None)
    own_pause = getattr(client, "pause_generation", None)
    own_resume = getattr(client, "resume_generation", None)
    if callable(own_pause) and callable(own_resume):
        return (lambda: own_pause(mode=mode)), own_resume
    post = getattr(client, "_post", None)
    if type(client).__name__ == "HTTPVLLMWeightSyncClient" and callable(post):
        return (lambda: post(f"pause?mode={mode}&clear_cache=false")), (lambda: post("resume"))
    raise InvalidArgument(
        f"MxTrainerInitInfo.pause: {type(client).__name__} cannot pause generation (no "
        "pause_generation/resume_generation methods, not vLLM's HTTP client); give a client that "
        "can, or set pause=False if nothing generates while the weights are loaded"
    )


def _coordinate(index: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major coordinate of the ``index``-th owner in ``mesh_shape``."""
    coord = []
    for size in reversed(mesh_shape):
        coord.append(index % size)
        index //= size
    return tuple(reversed(coord))


def local_piece(
    meta: ParamMeta, rank: int, *, index: int = 0, world_size: int = 1
) -> tuple[int, int, int] | None:
    """Where ``rank``'s ``iter_local`` piece of ``meta`` sits in the full tensor.

    Returns ``(axis, start, length)`` (``axis == -1``: the whole tensor), or ``None`` when this
    rank should not publish it: it owns nothing, or it is a replica (a non-zero coordinate on a
    replicate axis publishes nothing, so each distinct piece is published exactly once). A
    parameter every rank holds whole (``owners is None``) goes out from rank ``index %
    world_size``, spreading those bytes over the trainer ranks.
    ``Shard`` splits like ``torch.chunk``, outer mesh axis first when several shard one dim.
    """
    owners = meta.owners
    if owners is None:
        return (-1, 0, 0) if rank == index % world_size else None
    if rank not in owners:
        return None
    mesh_shape = tuple(meta.mesh_shape or (len(owners),))
    coord = _coordinate(owners.index(rank), mesh_shape)
    placements = meta.placements or tuple(Replicate() for _ in mesh_shape)
    if any(isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coord, strict=True)):
        return None
    dims = {p.dim for p in placements if isinstance(p, Shard)}
    if not dims:
        return (-1, 0, 0)
    if len(dims) > 1:
        raise InvalidArgument(
            f"parameter {meta.name!r}: placements {placements} shard tensor dims {sorted(dims)}; "
            "mx publishes one shard axis per tensor (shard one dim, or gather the rest first)"
        )
    (axis,) = dims
    start, length = 0, int(meta.shape[axis])
    for p, c, k in zip(placements, coord, mesh_shape, strict=True):
        if isinstance(p, Shard):
            chunk = math.ceil(length / k) if length else 0
            lo = min(c * chunk, length)
            start, length = start + lo, min(lo + chunk, length) - lo
    return axis, start, length


class MxTrainerWeightTransferEngine(TrainerWeightTransferEngine[MxTrainerInitInfo]):
    """Publishes each rank's local pieces through mx-refit and drives vLLM's update RPCs."""

    init_info_cls = MxTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        info: MxTrainerInitInfo,
        publisher: Publisher,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender, rank=info.rank)
        self.info = info
        self.publisher = publisher
        self.catalog: Catalog = publisher.client
        self.next_version = info.first_version
        # Copies for pieces that cannot be published in place (non-contiguous, other dtype,
        # gathered by iter_full): allocated once, registered once, refreshed every round.
        self._staging: dict[str, torch.Tensor] = {}

    @classmethod
    def trainer_init(
        cls,
        init_info: MxTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """Open this rank's publisher; on rank 0, initialise every worker's ``mx`` engine."""
        if source is None:
            raise ValueError("the mx trainer engine publishes a WeightSource; pass source=...")
        if not (source.implements_iter_local() or source.implements_iter_full()):
            raise TypeError(f"{type(source).__name__} implements neither iter_local() nor iter_full()")
        publisher = mx_refit.Publisher(
            init_info.catalog,
            init_info.model,
            token=init_info.token,
            mesh=MeshPosition(tp_rank=init_info.rank, tp_size=init_info.world_size),
            expected_sources=init_info.world_size,
            source_id=f"{init_info.model}/trainer-rank{init_info.rank}",
            ttl_s=init_info.source_ttl_s,
            drain_timeout_s=init_info.drain_timeout_s,
            # Covers the workers' leases, so they load without waiting for their release's answer.
            lease_fence_s=init_info.worker_init_info().lease_ttl_s,
        )
        if init_info.pause and init_info.is_sender:
            pause_controls(client, init_info.pause_mode)  # refuse a client that cannot pause now
        engine = cls(client=client, source=source, info=init_info, publisher=publisher)
        if engine.is_sender:
            client.init_weight_transfer_engine(init_info.worker_init_info().to_dict())
        return engine

    # -- one round --------------------------------------------------------------------------
    def send_weights(self, version: int | None = None) -> None:
        """Publish this rank's pieces as ``version`` (default: the next one) and, on rank 0,
        have every worker load it. Returns on every rank once no worker reads it any more."""
        v = self.next_version if version is None else version
        pieces = self._collect()
        self.publisher.publish(v, pieces)
        if self.is_sender:
            try:
                self.publisher.wait_ready(v, timeout_s=self.info.ready_timeout_s)
                self._drive_workers(v)
            except BaseException:
                # No worker may lease a version whose update failed; keep the original error.
                try:
                    self.publisher.wait_drained(v, timeout_s=self.info.drain_timeout_s)
                except Exception:
                    log.exception("mx: retiring version %d after a failed update also failed", v)
                raise
            self.publisher.wait_drained(v, timeout_s=self.info.drain_timeout_s)
        else:
            # Covers rank 0's whole round: READY wait, the workers' pull and load, then the drain.
            info = self.info
            self.publisher.wait_retired(
                v, timeout_s=info.ready_timeout_s + info.update_timeout_s + info.drain_timeout_s
            )
        self.next_version = v + 1

    def _drive_workers(self, v: int) -> None:
        """Rank 0: have every worker load ``v``, generation paused around the load (or staged
        unpaused first, then paused around the commit). Update infos are plain dicts: they
        travel as JSON over HTTP, Ray or Dynamo's engine routes."""
        client = self.client
        if self.info.staged:
            client.start_weight_update()
            client.update_weights(MxUpdateInfo(version=v, phase="stage").to_dict())  # returns at once
            with self._paused():
                client.update_weights(MxUpdateInfo(phase="commit").to_dict())
                client.finish_weight_update(str(v))
        else:
            with self._paused():
                client.start_weight_update()
                client.update_weights(MxUpdateInfo(version=v).to_dict())
                client.finish_weight_update(str(v))

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """Generation paused for the block (a no-op with ``pause=False``); resumed even when the
        block raises, so a failed update never leaves the server paused."""
        if not self.info.pause:
            yield
            return
        pause, resume = pause_controls(self.client, self.info.pause_mode)
        pause()
        try:
            yield
        finally:
            resume()

    def _collect(self) -> list[PublishedTensor]:
        assert self.source is not None
        # Positions in metadata are identical on every rank (unlike positions in each rank's own
        # iteration, which skips names it does not own), so ranks agree on who publishes what.
        metas = {m.name: (i, m) for i, m in enumerate(self.source.metadata)}
        local = self.source.implements_iter_local()
        stream = self.source.iter_local() if local else self.source.iter_full()
        out: list[PublishedTensor] = []
        for name, tensor in stream:
            if name not in metas:
                raise InvalidArgument(f"WeightSource yielded {name!r}, which its metadata does not declare")
            index, meta = metas[name]
            if local:
                piece = local_piece(meta, self.rank, index=index, world_size=self.info.world_size)
            else:
                # Full tensors: the index-th parameter goes out from one owner, spread round-robin.
                owners = meta.owners or tuple(range(self.info.world_size))
                piece = (-1, 0, 0) if owners[index % len(owners)] == self.rank else None
            if piece is None:
                continue
            axis, start, length = piece
            expected = list(meta.shape)
            if axis >= 0:
                expected[axis] = length
                if length == 0:
                    continue  # torch.chunk leaves trailing ranks empty
            if tuple(tensor.shape) != tuple(expected):
                raise InvalidArgument(
                    f"parameter {name!r}: rank {self.rank} holds shape {tuple(tensor.shape)}, but its "
                    f"ParamMeta placements say {tuple(expected)}"
                )
            out.append(
                PublishedTensor(
                    name=name,
                    tensor=self._publishable(name, tensor, meta.dtype, in_place=local),
                    role=Role.REPLICATED if axis < 0 else (Role.COLUMN if axis == 0 else Role.ROW),
                    global_shape=tuple(meta.shape),
                    shard_axis=axis,
                    shard_offset=start if axis >= 0 else 0,
                )
            )
        return out

    def _publishable(
        self, name: str, tensor: torch.Tensor, dtype: torch.dtype, *, in_place: bool
    ) -> torch.Tensor:
        tensor = tensor.detach()
        if in_place and tensor.is_contiguous() and tensor.dtype == dtype:
            return tensor  # the live parameter's storage, registered as is
        buf = self._staging.get(name)
        if buf is None or buf.shape != tensor.shape or buf.dtype != dtype or buf.device != tensor.device:
            buf = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
            self._staging[name] = buf
        buf.copy_(tensor)
        return buf

    def shutdown(self) -> None:
        """Stop heartbeats and release this rank's NIXL agent and registrations."""
        self.publisher.close()  # also closes the catalog client it dialled
        self._staging.clear()


# Importing this module is how a trainer gets here (to build MxTrainerInitInfo); make sure the
# factory knows the backend even in processes where vLLM never loaded its general plugins.
register()
