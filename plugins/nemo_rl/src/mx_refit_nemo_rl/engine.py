"""``MxCheckpointEngine``: NeMo RL's class-path checkpoint engine, on mx-refit's data plane.

NeMo RL builds one engine in every Megatron policy worker and one in every vLLM worker
(``weight_sync/checkpoint_engine_weight_synchronizer.py:150-207``), then per refit calls
``send_weights`` on every policy rank and ``receive_weight_batches`` on every vLLM rank together,
and waits for both (``:209-245``). This engine:

- **policy side**: closes NeMo RL's HF-export generator unstarted on every rank (no gather, no
  conversion on the trainer) and publishes the rank's live Megatron shards in place, with roles
  and sidecar, from the worker's cached Bridge conversion tasks. The previous version is retired
  at the next send: NeMo RL's own barrier (it waits for every vLLM worker's load) guarantees
  nobody reads it any more. When the export carries what shards do not, or the shards are not
  the weights to load (quantisation) or cannot be classified (see ``fallback.py``), every rank
  decides so before touching the generator, consumes the stream instead, and rank 0 publishes
  whole HF tensors, loudly.
- **rollout side**: each vLLM worker pulls whole HF tensors (vLLM's loaders narrow them to the
  rank) into a receive arena on its own device (``weight_sync.nemo_rl.arena_device``),
  EP-filtered where vLLM places experts linearly, and yields them in batches of ``bucket_size``
  bytes to NeMo RL's loading loop.

The catalog is either standalone (``weight_sync.catalog.mode: standalone``) or embedded in policy
rank 0, whose address travels to every worker in the ``prepare()`` metadata NeMo RL exchanges.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mx_refit import batches
from mx_refit.config import STANDALONE
from mx_refit.errors import FailedPrecondition, InvalidArgument
from mx_refit_nemo_rl import owner as owners
from mx_refit_nemo_rl.fallback import HfStage, fallback_reasons
from mx_refit_nemo_rl.settings import parse_engine_kwargs

if TYPE_CHECKING:  # pragma: no cover
    import torch

try:  # the real base class inside NeMo RL's worker environments
    from nemo_rl.utils.checkpoint_engines.base import (  # type: ignore[import-not-found]
        CheckpointEngine as _CheckpointEngineBase,
    )
except ImportError:  # pragma: no cover - NeMo RL absent: same methods, no base class to satisfy
    _CheckpointEngineBase = object

__all__ = ["MxCheckpointEngine", "SendReport"]

log = logging.getLogger(__name__)

POLICY, ROLLOUT = "policy", "rollout"
_METADATA_KEY = "mx_refit"


@dataclass
class SendReport:
    """What one ``send_weights`` did on this rank."""

    version: int
    mode: str  # "native" | "hf_fallback"
    owner_strategy: str
    published: bool
    reasons: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    new_registrations: int = 0


class MxCheckpointEngine(_CheckpointEngineBase):  # type: ignore[misc,valid-type]
    """Selected by ``policy.generation.refit_transport: "mx_refit_nemo_rl.engine:MxCheckpointEngine"``.

    :param bucket_size: NeMo RL's bucket size in bytes: the rollout side's batch size.
    :param release_after_refit: NeMo RL finalizes both sides after every refit and prepares
        them again before the next one.
    :param weight_sync: mx-refit's ``weight_sync`` block (the recipes interpolate it).
    """

    # Read by NeMo RL's vLLM mixin (models/generation/vllm/checkpoint_engine.py:93, 116): the
    # engine yields whole HF tensors, never pre-sliced expert windows.
    shard_expert_weights = False

    def __init__(self, bucket_size: int, **engine_kwargs: Any) -> None:
        settings = parse_engine_kwargs(bucket_size, engine_kwargs)
        self.bucket_size = settings.bucket_size
        self.release_after_refit = settings.release_after_refit
        self.config = settings.config
        if self.config.receive_mode != "staged":
            raise InvalidArgument(
                f"weight_sync.receive_mode: {self.config.receive_mode!r} is not supported by the NeMo RL "
                f"checkpoint engine (it hands NeMo RL's loader the received tensors in batches, from the "
                f"receive arena); use 'staged'"
            )
        self.arena_device = settings.arena_device
        self.side: str | None = None
        self.policy_worker: Any = owners.find_in_stack(skip=1)
        self.version = 0  # last version sent (policy) or received (rollout); survives finalize
        self.last_send: SendReport | None = None
        self.last_stats: Any = None
        self._catalog_server: Any = None
        self._address: str | None = None
        self._publisher: Any = None
        self._hf_publisher: Any = None
        self._retire: tuple[Any, int] | None = None
        self._receiver: Any = None
        self._stage = HfStage()
        self._transport: Any = None
        self._bridged: tuple[tuple[int, int], Any] | None = None
        self._prepared = False

    # -- NeMo RL's lifecycle ------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Find the side; policy rank 0 starts the embedded catalog. Metadata: ``{"mx_refit": ...}``."""
        import mx_refit

        self.side = self._find_side()
        self._transport = mx_refit.shared_transport()  # one NIXL agent per process
        meta: dict[str, Any] = {"side": self.side, "model": self.config.model_name, "catalog": None}
        if self.config.catalog.mode == STANDALONE:
            self._address = self.config.catalog.address
        elif self.side == POLICY and self._policy_rank() == 0:
            if self._catalog_server is None:
                self._catalog_server = mx_refit.start_catalog(config=self.config)
            meta["catalog"] = self._address = self._catalog_server.address
        self._prepared = True
        return {_METADATA_KEY: meta}

    def init_policy_process_group(
        self, *, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        """Build this rank's publisher: on the first data-parallel replica of each dense position
        and the first expert-data-parallel replica of each expert position (``is_publishing_rank``),
        expecting as many sources as the core's rule counts (``mx_refit.expected_sources``)."""
        import mx_refit

        self._require_prepared("init_policy_process_group")
        self.side = POLICY
        self._address = self._catalog_address(metadata)
        if self._publisher is None and mx_refit.is_publishing_rank():
            mesh = mx_refit.mesh_position()
            self._publisher = mx_refit.Publisher.from_config(
                self.config,
                mesh=mesh,
                expected_sources=mx_refit.expected_sources(mesh=mesh),
                catalog=self._address,
                transport=self._transport,
            )

    def init_rollout_process_group(
        self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        """Build this vLLM worker's receiver: whole HF tensors, EP-filtered."""
        import mx_refit
        from mx_refit_nemo_rl.rollout import target_layout, worker_device
        from mx_refit_nemo_rl.settings import resolve_arena_device

        self._require_prepared("init_rollout_process_group")
        self.side = ROLLOUT
        self._address = self._catalog_address(metadata)
        if self._receiver is None:
            self._receiver = mx_refit.Receiver.from_config(
                self.config,
                target=target_layout(full_tensors=True),
                catalog=self._address,
                transport=self._transport,
                load_batch_bytes=self.bucket_size,
                device=resolve_arena_device(self.arena_device, worker_device(owners.rollout_worker())),
            )

    def get_target_weight_layout(self) -> None:
        """No destination slicing of the HF stream (``policy/workers/checkpoint_engine.py:90``):
        NeMo RL then hands ``send_weights`` its export generator itself."""
        return None

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        """Publish this rank's shards; the export generator is closed unstarted (or, in the
        fallback, consumed by every rank together).

        The fallback is decided before the generator is touched, from the worker's config and
        its conversion tasks, and agreed over the policy ranks: a rank that closed the export
        while another consumed it would leave the export's collectives waiting forever.
        """
        found = owners.from_weights(weights)
        if found is None and owners.is_policy_worker(self.policy_worker):
            found = owners.PolicyOwner(self.policy_worker, "stack")
        tasks = None
        reasons: list[str] = []
        if found is not None:
            tasks = _conversion_tasks(found.worker)
            reasons = _agreed_over_ranks(fallback_reasons(found.worker, found.kv_scales, tasks))
        if not reasons:
            _close(weights)  # before anything can raise: a rank that started it would deadlock
        if found is None:
            raise FailedPrecondition(
                "MxCheckpointEngine.send_weights: cannot find the owning Megatron policy worker "
                f"(neither the export generator's frame nor the call stack holds one; got "
                f"{owners.describe(weights)})"
            )
        self.policy_worker = found.worker
        self._require_ready("send_weights")
        self.version += 1
        if reasons:
            self.last_send = self._send_hf_stream(weights, reasons, found.strategy)
        else:
            self.last_send = self._send_native(found.worker, found.strategy, tasks)

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Pull the next version and yield it in batches of at most ``bucket_size`` bytes."""
        self._require_ready("receive_weight_batches")
        result = self._receiver.refit(min_version=self.version + 1, wait_s=self.config.transfer_timeout_s)
        self.version = result.version.version
        self.last_stats = result.stats
        for batch in batches(result.tensors, self.bucket_size):
            yield batch

    def finalize(self) -> None:
        """Release endpoints and the embedded catalog; ``prepare`` may run again afterwards."""
        for endpoint in (self._publisher, self._hf_publisher, self._receiver):
            if endpoint is not None:
                endpoint.close()
        self._publisher = self._hf_publisher = self._receiver = None
        self._retire = None
        if self._catalog_server is not None:
            self._catalog_server.stop()
            self._catalog_server = None
        self._prepared = False

    # -- policy side --------------------------------------------------------------------------
    def _send_native(self, worker: Any, strategy: str, tasks: list[Any] | None) -> SendReport:
        report = SendReport(self.version, "native", strategy, published=self._publisher is not None)
        if self._publisher is None:
            return report  # another data-parallel replica publishes
        model = self._bridged_model(worker, tasks)
        self._retire_previous()
        before = self._transport.registrations
        self._publisher.publish(self.version, model=model)
        report.new_registrations = self._transport.registrations - before
        self._retire = (self._publisher, self.version)
        return report

    def _bridged_model(self, worker: Any, tasks: list[Any] | None) -> Any:
        """The worker's model as the core's ``BridgedModel``, kept while the worker's model and
        conversion tasks are the same objects (the plugin then reuses what it derived from them)."""
        import mx_refit

        key = (id(worker.model), id(tasks))
        if self._bridged is None or self._bridged[0] != key:
            bridge = worker.megatron_bridge
            live = None if tasks is None else [task for task in tasks if task is not None]
            model = mx_refit.BridgedModel(bridge, [worker.model], bridge.hf_pretrained.config, conversion_tasks=live)
            self._bridged = (key, model)
        return self._bridged[1]

    def _send_hf_stream(self, weights: Any, reasons: list[str], strategy: str) -> SendReport:
        import mx_refit

        keep = self._policy_rank() == 0
        if keep:
            message = (
                f"mx-refit: refit v{self.version} falls back to NeMo RL's gathered HF export stream "
                f"(all-gather and conversion on the trainer) because {'; '.join(reasons)}"
            )
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            log.warning(message)
        count, nbytes = self._stage.fill(weights, keep=keep)  # every rank: the export's collectives
        report = SendReport(self.version, "hf_fallback", strategy, keep, list(reasons), count, nbytes)
        if not keep:
            return report
        if self._hf_publisher is None:
            self._hf_publisher = mx_refit.Publisher.from_config(
                self.config,
                mesh=None,
                expected_sources=1,
                catalog=self._address,
                transport=self._transport,
                source_id=f"{self.config.model_name}/hf-export",
            )
        self._retire_previous()
        before = self._transport.registrations
        tensors = [mx_refit.PublishedTensor(name=n, tensor=t) for n, t in self._stage.buffers.items()]
        self._hf_publisher.publish(self.version, tensors)
        report.new_registrations = self._transport.registrations - before
        self._retire = (self._hf_publisher, self.version)
        return report

    def _retire_previous(self) -> None:
        """Retire the version before this one; NeMo RL's barrier already saw every reader load it."""
        if self._retire is None:
            return
        publisher, version = self._retire
        self._retire = None
        publisher.wait_drained(version, timeout_s=self.config.drain_timeout_s)

    # -- helpers ------------------------------------------------------------------------------
    def _find_side(self) -> str:
        if self.side is not None:
            return self.side
        if owners.is_policy_worker(self.policy_worker):
            return POLICY
        worker = owners.find_in_stack(skip=3)
        if worker is not None:
            self.policy_worker = worker
            return POLICY
        if owners.rollout_worker() is not None:
            return ROLLOUT
        raise FailedPrecondition(
            "MxCheckpointEngine.prepare: this process holds neither a Megatron policy worker (none "
            "on the call stack) nor an mx vLLM worker; set policy.generation.vllm_kwargs.worker_cls "
            "to mx_refit_nemo_rl.vllm_worker.MxVllmWorker (the recipes do)"
        )

    def _policy_rank(self) -> int:
        rank = getattr(self.policy_worker, "rank", None)
        if isinstance(rank, int):
            return rank
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _catalog_address(self, metadata: list[Any]) -> str:
        if self.config.catalog.mode == STANDALONE:
            assert self.config.catalog.address is not None  # validated by load_config
            return self.config.catalog.address
        ours = [m[_METADATA_KEY] for m in metadata if isinstance(m, dict) and _METADATA_KEY in m]
        if len(ours) != len(metadata):
            raise InvalidArgument(
                f"checkpoint-engine metadata: {len(metadata) - len(ours)} of {len(metadata)} workers "
                "run another engine; policy and generation must both use MxCheckpointEngine"
            )
        models = {m["model"] for m in ours}
        if models != {self.config.model_name}:
            raise InvalidArgument(f"weight_sync.model_name differs between workers: {sorted(models)}")
        addresses = {m["catalog"] for m in ours if m["catalog"]}
        if len(addresses) != 1:
            raise FailedPrecondition(
                f"expected exactly one embedded catalog (policy rank 0), found {sorted(addresses)}"
            )
        return addresses.pop()

    def _require_prepared(self, what: str) -> None:
        if not self._prepared:
            raise FailedPrecondition(f"MxCheckpointEngine.{what}: call prepare() first (and again after finalize())")

    def _require_ready(self, what: str) -> None:
        endpoint = self._receiver if what == "receive_weight_batches" else self._address
        if not self._prepared or endpoint is None:
            raise FailedPrecondition(
                f"MxCheckpointEngine.{what}: not initialised (prepare and init_*_process_group first)"
            )


def _close(weights: Any) -> None:
    """Close NeMo RL's generator and any generator it wraps, without running their bodies."""
    inner = owners.unwrap_generator(weights)
    for gen in {id(weights): weights, id(inner): inner}.values():
        close = getattr(gen, "close", None)
        if close is not None:
            close()


def _conversion_tasks(worker: Any) -> list[Any] | None:
    """The worker's cached conversion tasks (``megatron_policy_worker.py:2297``, set by
    ``prepare_refit_info``), else built as NeMo RL builds them (``:2265-2281``; a PP collective,
    run by every policy rank in the same ``send_weights``) and cached the same way. ``None``
    only for a worker that can do neither."""
    tasks = getattr(worker, "refit_conversion_tasks", None)
    if tasks is None:
        build = getattr(worker, "_build_refit_conversion_tasks", None)
        if callable(build):
            tasks = worker.refit_conversion_tasks = build()
    return tasks


def _agreed_over_ranks(reasons: list[str]) -> list[str]:
    """The union of every policy rank's fallback reasons (in rank order), so all ranks take the
    same path; a rank's own reasons when torch.distributed is not initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return reasons
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, reasons)
    union: list[str] = []
    for rank_reasons in gathered:
        union.extend(r for r in rank_reasons or () if r not in union)
    return union
