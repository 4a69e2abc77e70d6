"""NeMo RL's checkpoint-engine contract, reproduced by hand (NVIDIA-NeMo/RL @ 7ea279a).

NeMo RL cannot be installed here, so the plugin is tested against this reproduction. Each piece
names the upstream file and lines it follows; behaviour that needs a GPU is replaced by its CPU
equivalent and says so. ``CheckpointEngine``/``create_checkpoint_engine`` live at their upstream
import path in ``nemo_rl_repro/``.

Pieces: (b) the refit-config dump, (c) the synchronizer's choreography, (d) the policy mixins and
a Megatron policy worker stand-in with the lazy export generator, (e) the vLLM loading loop,
(f) the recipe loader and ``MasterConfig``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

_MEBIBYTE = 1024 * 1024

# ---------------------------------------------------------------------------------------------
# (b) refit config: nemo_rl/models/generation/vllm/config.py:158-161, 257-301 and
#     nemo_rl/weight_sync/checkpoint_engine_config.py:29-65; the factory rule of
#     nemo_rl/weight_sync/factory.py:77-99.
# ---------------------------------------------------------------------------------------------


def _plugin_config_model() -> Any:
    from typing import Annotated

    from pydantic import BaseModel, Field

    class VllmCheckpointEnginePluginConfig(BaseModel, extra="allow"):
        """config.py:158-161: extra keys allowed; the ratio in (0, 1); ``release_after_refit`` bool."""

        update_weights_bucket_memory_ratio: Annotated[float, Field(gt=0, lt=1)] = 0.05
        release_after_refit: bool = False

    return VllmCheckpointEnginePluginConfig


_BUILTIN_TRANSPORTS = ("vllm_s3_sparse", "vllm_zmq_sparse", "nixl")


def checkpoint_engine_refit_config(generation: dict[str, Any]) -> dict[str, Any] | None:
    """checkpoint_engine_config.py:29-65 over config.py:257-301 (``normalize_vllm_refit_config``):
    ``None`` for a null transport; a ``module:Class`` transport needs ``refit_cfg[transport]``; the
    engine kwargs are that block dumped without the bucket ratio (``release_after_refit`` kept)."""
    if generation.get("checkpoint_engine") is not None:
        raise ValueError("policy.generation.checkpoint_engine was replaced by refit_transport")
    transport = generation.get("refit_transport")
    if transport is None or transport == "nccl_reshard":
        return None
    if transport not in _BUILTIN_TRANSPORTS and ":" not in transport:
        raise ValueError(f"Unknown vLLM refit transport {transport!r}")
    if (generation.get("vllm_cfg") or {}).get("reset_encoder_cache_after_weight_update"):
        raise ValueError("reset_encoder_cache_after_weight_update is not supported with this transport")
    if transport in ("vllm_s3_sparse", "vllm_zmq_sparse"):
        return None
    refit_cfg = generation.get("refit_cfg") or {}
    if transport == "nixl":
        raise NotImplementedError("the built-in nixl engine is not part of this reproduction")
    block = refit_cfg.get(transport)
    if block is None:
        raise ValueError(
            f"Custom checkpoint-engine transport {transport!r} requires policy.generation.refit_cfg[{transport!r}]."
        )
    scoped = _plugin_config_model().model_validate(block)
    return {
        "backend": transport,
        "update_weights_bucket_memory_ratio": scoped.update_weights_bucket_memory_ratio,
        "engine_kwargs": {transport: scoped.model_dump(exclude={"update_weights_bucket_memory_ratio"})},
    }


def check_weight_synchronizer(generation: dict[str, Any]) -> dict[str, Any] | None:
    """factory.py:77-99: a checkpoint engine is refused under colocation and off vLLM."""
    config = checkpoint_engine_refit_config(generation)
    if config is not None:
        if (generation.get("colocated") or {}).get("enabled"):
            raise ValueError("checkpoint-engine refit is only supported for non-colocated generation.")
        if generation.get("backend") != "vllm":
            raise NotImplementedError("checkpoint-engine non-colocated refit is only supported for vLLM")
    return config


# ---------------------------------------------------------------------------------------------
# (f) recipes: nemo_rl/utils/config.py:28-48 (merge_with_override), :51-97 (inheritance),
#     :172-192 (parse_hydra_overrides), :195-204 (resolvers); MasterConfig, algorithms/grpo.py:357.
# ---------------------------------------------------------------------------------------------


def _merge_with_override(base: Any, override: Any) -> Any:
    from omegaconf import OmegaConf

    for key in list(override.keys()):
        node = override[key]
        if OmegaConf.is_dict(node) and node.get("_override_", False):
            node.pop("_override_")
            if key in base:
                base.pop(key)
    return OmegaConf.merge(base, override)


def load_config(path: str | Path, base_dir: Path | None = None) -> Any:
    """``defaults:`` is one path or a list, resolved against the file's folder; parents load
    depth-first, later ones win; ``_override_: true`` replaces a section."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    path = Path(path)
    base_dir = base_dir or path.parent
    config = OmegaConf.load(path)
    assert isinstance(config, DictConfig)
    if "defaults" in config:
        defaults = config.pop("defaults")
        if isinstance(defaults, (str, Path)):
            defaults = [defaults]
        elif isinstance(defaults, ListConfig):
            defaults = [str(d) for d in defaults]
        base = OmegaConf.create({})
        for default in defaults:
            parent = (base_dir / str(default)).resolve()
            base = _merge_with_override(base, load_config(parent, parent.parent))
        config = _merge_with_override(base, config)
    return config


def parse_hydra_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Struct mode for command-line overrides only (new keys need ``+``), applied by Hydra's own
    override parser and loader, as NeMo RL does."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    OmegaConf.set_struct(cfg, True)
    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    ConfigLoaderImpl._apply_overrides_to_config(overrides=parsed, cfg=cfg)
    return cfg


def register_omegaconf_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, fn in {
        "add": lambda a, b: a + b,
        "mul": lambda a, b: a * b,
        "div": lambda a, b: a / b,
        "max": lambda a, b: max(a, b),
    }.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def master_config(config: Any) -> Any:
    """examples/run_grpo.py:86-96 resolves the config to a container and builds
    ``MasterConfig(**config)``; grpo.py:357: ``extra="allow"`` keeps a top-level ``weight_sync``."""
    from omegaconf import OmegaConf
    from pydantic import BaseModel

    class MasterConfig(BaseModel, extra="allow"):
        policy: dict[str, Any]
        cluster: dict[str, Any]

    return MasterConfig(**OmegaConf.to_container(config, resolve=True))


# ---------------------------------------------------------------------------------------------
# (d) policy side: nemo_rl/models/policy/workers/checkpoint_engine.py:83-173 and the Megatron
#     worker's refit pieces, megatron_policy_worker.py:2136-2145, 2256-2297, 2328-2401.
# ---------------------------------------------------------------------------------------------


def total_memory_bytes() -> int:
    """``checkpoint_engine_total_memory_bytes`` asks torch.cuda for the device's memory
    (checkpoint_engine.py:142-144); on CPU: the machine's memory."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class PolicyCheckpointEngineMixin:
    """checkpoint_engine.py:107-173."""

    checkpoint_engine: Any
    rank: int

    def _prepare_checkpoint_engine_weight_send(self) -> None:
        pass

    def _finalize_checkpoint_engine_weight_send(self) -> None:
        pass

    async def send_weights_via_checkpoint_engine(self, kv_scales: dict[str, float] | None = None) -> None:
        import torch

        self._prepare_checkpoint_engine_weight_send()
        try:
            with torch.no_grad():
                await self.checkpoint_engine.send_weights(self._checkpoint_engine_weight_iterator(kv_scales=kv_scales))
        finally:
            self._finalize_checkpoint_engine_weight_send()

    async def checkpoint_engine_rpc(self, checkpoint_method: str, method_kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = method_kwargs or {}
        if checkpoint_method == "checkpoint_engine_total_memory_bytes":
            return total_memory_bytes()
        if checkpoint_method == "init_checkpoint_engine":
            if getattr(self, "checkpoint_engine", None) is None:
                from nemo_rl.utils.checkpoint_engines.base import create_checkpoint_engine

                self.checkpoint_engine = create_checkpoint_engine(
                    kwargs["backend"],
                    bucket_size_bytes=kwargs["bucket_size_bytes"],
                    engine_kwargs=kwargs["engine_kwargs"],
                )
            return None
        if checkpoint_method == "prepare_checkpoint_engine":
            metadata = self.checkpoint_engine.prepare()
            return {**metadata, "rank": self.rank} if isinstance(metadata, dict) else metadata
        if checkpoint_method == "init_checkpoint_engine_process_group":
            return self.checkpoint_engine.init_policy_process_group(worker_rank=self.rank, **kwargs)
        if checkpoint_method == "send_weights_via_checkpoint_engine":
            return await self.send_weights_via_checkpoint_engine(**kwargs)
        if checkpoint_method == "finalize_checkpoint_engine":
            engine = getattr(self, "checkpoint_engine", None)
            if engine is not None:
                engine.finalize()
            return None
        return getattr(self.checkpoint_engine, checkpoint_method)(**kwargs)


class MegatronCheckpointEngineSendMixin:
    """checkpoint_engine.py:83-104: the raw generator when the engine wants no target layout,
    else a generator expression that selects per destination (selection itself not reproduced:
    identity)."""

    def _checkpoint_engine_weight_iterator(self, kv_scales: dict[str, float] | None = None) -> Iterator[Any]:
        weights = self._iter_params_with_optional_kv_scales(kv_scales=kv_scales)
        target_layout = self.checkpoint_engine.get_target_weight_layout()
        if target_layout is None:
            return weights
        return ((name, selected) for name, tensor in weights if (selected := tensor) is not None)


def export_eagle_weights_to_hf(draft_model: Any) -> Iterator[tuple[str, Any]]:
    """nemo_rl/models/megatron/draft.py's export, reduced: the draft module's parameters."""
    for name, param in draft_model.named_parameters():
        yield name, param.detach()


class MegatronPolicyWorker(PolicyCheckpointEngineMixin, MegatronCheckpointEngineSendMixin):
    """The refit-relevant state and methods of ``MegatronPolicyWorkerImpl`` on a real Megatron
    model and a real Megatron-Bridge ``AutoBridge``: ``model`` (one module), ``megatron_bridge``,
    ``cfg``, ``draft_model``, ``fp8_cfg``, ``rank`` and the cached ``refit_conversion_tasks``.
    ``export_calls`` counts calls of the bridge's ``export_hf_weights``."""

    def __init__(self, *, rank: int, model: Any, bridge: Any, cfg: dict[str, Any], draft_model: Any = None,
                 fp8_cfg: dict[str, Any] | None = None) -> None:
        self.rank = rank
        self.model = model
        self.megatron_bridge = bridge
        self.cfg = cfg
        self.draft_model = draft_model
        self.fp8_cfg = fp8_cfg or {}
        self.export_calls = 0
        self.generators: list[Any] = []
        self.refit_conversion_tasks: list[Any] | None = None

    def _is_fp8_export(self) -> bool:
        """megatron_policy_worker.py:2256-2263."""
        return bool(self.fp8_cfg.get("fp8_param", False) and self.fp8_cfg.get("fp8_recipe") == "blockwise")

    def _build_refit_conversion_tasks(self) -> list[Any]:
        """:2265-2281. FP8 parameters cannot be built on CPU: with ``fp8_param`` set the standard
        tasks are kept (the case checks the engine's decision and the stream path)."""
        return [t for t in self.megatron_bridge.get_conversion_tasks([self.model]) if t is not None]

    def prepare_refit_info(self) -> dict[str, tuple[Any, Any]]:
        """:2136-2145 with :2297: cache the tasks, then iterate the full export once for shapes."""
        self.refit_conversion_tasks = self._build_refit_conversion_tasks()
        return {name: (t.shape, t.dtype) for name, t in self._iter_params_with_optional_kv_scales()}

    def _iter_params_with_optional_kv_scales(self, kv_scales: dict[str, float] | None = None,
                                             conversion_tasks: Any = None) -> Iterator[tuple[str, Any]]:
        """:2328-2401, a generator function: the bridge's export, then ``draft.*``, then KV/Q
        scales when vLLM's KV cache is FP8 (on CPU, not ``device="cuda"``)."""
        gen = self._export_body(kv_scales, conversion_tasks)
        self.generators.append(gen)
        return gen

    def _export_body(self, kv_scales: dict[str, float] | None, conversion_tasks: Any) -> Iterator[tuple[str, Any]]:
        import torch

        if conversion_tasks is None:
            conversion_tasks = self.refit_conversion_tasks
        self.export_calls += 1
        base_iter = self.megatron_bridge.export_hf_weights([self.model], show_progress=False,
                                                           conversion_tasks=conversion_tasks)
        for name, tensor in base_iter:
            yield name, tensor
        if self.draft_model is not None:
            for name, tensor in export_eagle_weights_to_hf(self.draft_model):
                yield f"draft.{name}", tensor
        generation = self.cfg.get("generation") or {}
        fp8_kv = generation.get("backend") == "vllm" and str(
            (generation.get("vllm_cfg") or {}).get("kv_cache_dtype", "")).startswith("fp8")
        if not fp8_kv:
            return
        num_layers = self.megatron_bridge.transformer_config.num_layers
        for layer in range(num_layers):
            for kind in ("q_scale", "k_scale", "v_scale"):
                key = f"model.layers.{layer}.self_attn.attn.{kind}"
                value = kv_scales[key] if kv_scales and key in kv_scales else 1.0
                yield key, torch.tensor(value, dtype=torch.float32).reshape(1)


# ``_export_body`` keeps ``self`` and ``kv_scales`` in the generator's frame exactly like the
# upstream generator function does; ``_iter_params_with_optional_kv_scales`` only records it.


# ---------------------------------------------------------------------------------------------
# (e) rollout side: nemo_rl/models/generation/vllm/checkpoint_engine.py:75-185 and the loading
#     entry points of vllm_backend.py:199-207, 574-594.
# ---------------------------------------------------------------------------------------------


def resolve_rollout_rank(rank_prefix: int, rollout_world_size: int) -> int:
    """checkpoint_engine.py:75-80."""
    import torch.distributed as dist

    rank = dist.get_rank()
    return rank if dist.get_world_size() == rollout_world_size else rank_prefix + rank


class VllmCheckpointEngineMixin:
    """checkpoint_engine.py:83-173 plus ``_load_weights`` (vllm_backend.py:574-594, draft split;
    Gemma3 and MTP branches not reproduced) and ``_load_hf_weights`` (:199-207,
    ``model_runner.model.load_weights(weights=...)``). ``draft_weights`` collects ``draft.*``."""

    checkpoint_engine: Any = None

    def checkpoint_engine_total_memory_bytes(self) -> int:
        return total_memory_bytes()

    def _load_hf_weights(self, policy_weights: list[tuple[str, Any]]) -> None:
        if self.checkpoint_engine.shard_expert_weights:
            raise NotImplementedError("the sharded-expert loader is not reproduced")
        self.model_runner.model.load_weights(weights=policy_weights)

    def _load_weights(self, weights: list[tuple[str, Any]]) -> None:
        policy = [(n, t) for n, t in weights if not n.startswith("draft.")]
        draft = [(n.removeprefix("draft."), t) for n, t in weights if n.startswith("draft.")]
        if policy:
            self._load_hf_weights(policy)
        for name, tensor in draft:
            self.draft_weights[name] = tensor.clone()

    def init_checkpoint_engine(self, backend: str, bucket_size_bytes: int, engine_kwargs: dict[str, Any]) -> None:
        if getattr(self, "checkpoint_engine", None) is not None:
            return
        from nemo_rl.utils.checkpoint_engines.base import create_checkpoint_engine

        self.checkpoint_engine = create_checkpoint_engine(backend, bucket_size_bytes=bucket_size_bytes,
                                                          engine_kwargs=engine_kwargs)

    def prepare_checkpoint_engine(self) -> Any:
        import torch.distributed as dist

        metadata = self.checkpoint_engine.prepare()
        if isinstance(metadata, dict):
            metadata = {**metadata, "rank": dist.get_rank()}
        return metadata

    def init_checkpoint_engine_process_group(self, rank_prefix: int, train_world_size: int,
                                             rollout_world_size: int, metadata: list[Any]) -> None:
        self.checkpoint_engine.init_rollout_process_group(
            rollout_rank=resolve_rollout_rank(rank_prefix, rollout_world_size),
            train_world_size=train_world_size, rollout_world_size=rollout_world_size, metadata=metadata)

    def finalize_checkpoint_engine(self) -> None:
        engine = getattr(self, "checkpoint_engine", None)
        if engine is not None:
            engine.finalize()

    async def _update_weights_from_checkpoint_engine_async(self) -> bool:
        self.loaded = {"tensors": 0, "bytes": 0, "batches": 0}
        async for batch in self.checkpoint_engine.receive_weight_batches():
            self.loaded["batches"] += 1
            self.loaded["tensors"] += len(batch)
            self.loaded["bytes"] += sum(t.nbytes for _n, t in batch)
            self._load_weights(batch)
            del batch
        return True

    def update_weights_from_checkpoint_engine(self) -> bool:
        return asyncio.run(self._update_weights_from_checkpoint_engine_async())


def collective_rpc_result(method: str, results: list[Any]) -> Any:
    """VllmCheckpointEngineRpcMixin.checkpoint_engine_rpc (checkpoint_engine.py:179-185): the
    rank-0 actor's ``llm.collective_rpc`` runs the method on every vLLM worker; an update
    succeeds only when every worker's result is truthy."""
    if method == "update_weights_from_checkpoint_engine":
        return all(item for item in results if item is not None)
    return results


# ---------------------------------------------------------------------------------------------
# (c) the choreography: nemo_rl/weight_sync/checkpoint_engine_weight_synchronizer.py:69-254.
#     ``run_policy(method, kwargs)`` and ``run_generation(method, args)`` start the call on every
#     policy worker / the generation engine's rank 0 (which fans out) and return a handle;
#     ``get(handles)`` waits for all of them together, like ``ray.get``.
# ---------------------------------------------------------------------------------------------


class CheckpointEngineWeightSynchronizer:
    def __init__(self, *, run_policy: Callable[[str, dict[str, Any]], Any],
                 run_generation: Callable[[str, tuple[Any, ...]], Any],
                 get: Callable[[list[Any]], list[list[Any]]], config: dict[str, Any],
                 prepare_refit_info: Callable[[], Any] | None = None) -> None:
        self._run_policy_fn = run_policy
        self._run_generation_fn = run_generation
        self._get = get
        self._config = config
        self._prepare_refit_info = prepare_refit_info
        self._ready = False
        self._bucket_size_bytes: int | None = None
        self.stale = True
        self.calls: list[str] = []

    def _run_policy(self, method: str, **kwargs: Any) -> Any:
        self.calls.append(f"policy:{method}")
        return self._run_policy_fn(method, kwargs)

    def _run_generation(self, method: str, args: tuple[Any, ...] = ()) -> Any:
        self.calls.append(f"generation:{method}")
        return self._run_generation_fn(method, args)

    def init_communicator(self) -> None:
        """:69-71: ``prepare_refit_info`` (tasks cached, one full export for shapes), then ready."""
        if self._prepare_refit_info is not None:
            self._prepare_refit_info()
        self._ensure_ready()

    def _bucket_size(self) -> int:
        """:107-148: the smallest device memory of all workers times the ratio, in whole MiB."""
        if self._bucket_size_bytes is None:
            ratio = float(self._config["update_weights_bucket_memory_ratio"])
            memory = _flatten(self._get([self._run_policy("checkpoint_engine_total_memory_bytes"),
                                         self._run_generation("checkpoint_engine_total_memory_bytes")]))
            size = int(min(int(m) for m in memory) * ratio) // _MEBIBYTE * _MEBIBYTE
            if size < _MEBIBYTE:
                raise ValueError("Checkpoint-engine bucket sizing produced less than 1 MiB per buffer.")
            self._bucket_size_bytes = size
        return self._bucket_size_bytes

    def _ensure_ready(self) -> None:
        """:150-207: init both sides together, prepare both together, then connect with every
        rank's metadata (policy ranks first, sorted by rank)."""
        if self._ready:
            return
        backend = self._config["backend"]
        size = self._bucket_size()
        kwargs = self._config["engine_kwargs"][backend]
        self._get([self._run_policy("init_checkpoint_engine", backend=backend, bucket_size_bytes=size,
                                    engine_kwargs=kwargs),
                   self._run_generation("init_checkpoint_engine", (backend, size, kwargs))])
        policy_meta, generation_meta = self._get([self._run_policy("prepare_checkpoint_engine"),
                                                  self._run_generation("prepare_checkpoint_engine")])
        policy_meta = sorted(_flatten([policy_meta]), key=lambda m: m.get("rank", 0) if isinstance(m, dict) else 0)
        generation_meta = _flatten([generation_meta])
        topology = {"metadata": policy_meta + generation_meta, "train_world_size": len(policy_meta),
                    "rollout_world_size": len(generation_meta)}
        self._get([self._run_policy("init_checkpoint_engine_process_group", **topology),
                   self._run_generation("init_checkpoint_engine_process_group",
                                        (0, topology["train_world_size"], topology["rollout_world_size"],
                                         topology["metadata"]))])
        self._ready = True

    def sync_weights(self, *, kv_scales: dict[str, float] | None = None) -> float:
        """:209-245: send and update issued together, waited on together; then finalize when
        ``release_after_refit``. Returns the wall time of the send+update."""
        self.stale = True
        self._ensure_ready()
        try:
            started = time.perf_counter()
            policy = self._run_policy("send_weights_via_checkpoint_engine", kv_scales=kv_scales)
            generation = self._run_generation("update_weights_from_checkpoint_engine")
            _policy_results, generation_results = self._get([policy, generation])
            elapsed = time.perf_counter() - started
            if not all(r for r in _flatten([generation_results]) if r is not None):
                raise RuntimeError("Weight transfer failed during checkpoint-engine sync.")
            self.stale = False
            return elapsed
        finally:
            backend = self._config["backend"]
            if self._config["engine_kwargs"][backend]["release_after_refit"]:
                self.shutdown()

    def shutdown(self) -> None:
        """:247-254."""
        if not self._ready:
            return
        self._get([self._run_policy("finalize_checkpoint_engine"),
                   self._run_generation("finalize_checkpoint_engine")])
        self._ready = False


def _flatten(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if isinstance(value, list):
            out.extend(_flatten(value))
        else:
            out.append(value)
    return out


def drain(gen: Generator[Any, None, None]) -> int:
    return sum(1 for _ in gen)
