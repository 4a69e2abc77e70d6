"""The engine against NeMo RL's construction contract and the owner-discovery strategies
(in-process; no model needed: discovery looks only at frames and attributes)."""

from __future__ import annotations

import asyncio
import inspect

import _nemo_rl_contract as nrl
import pytest

from mx_refit.errors import FailedPrecondition, InvalidArgument
from mx_refit_nemo_rl import ENGINE_CLASS_PATH, owner


def dump(**extra) -> dict:
    """What checkpoint_engine_refit_config hands the constructor for a recipe block."""
    block = {"update_weights_bucket_memory_ratio": 0.05, "weight_sync": {"model_name": "m"}, **extra}
    generation = {"backend": "vllm", "refit_transport": ENGINE_CLASS_PATH, "refit_cfg": {ENGINE_CLASS_PATH: block}}
    return nrl.checkpoint_engine_refit_config(generation)["engine_kwargs"][ENGINE_CLASS_PATH]


def test_class_path_constructs_and_satisfies_the_abc() -> None:
    from nemo_rl.utils.checkpoint_engines.base import CheckpointEngine, create_checkpoint_engine

    kwargs = dump()
    assert kwargs == {"release_after_refit": False, "weight_sync": {"model_name": "m"}}
    engine = create_checkpoint_engine(ENGINE_CLASS_PATH, bucket_size_bytes=32 << 20, engine_kwargs=kwargs)
    assert isinstance(engine, CheckpointEngine)
    assert not inspect.isabstract(type(engine))
    assert engine.bucket_size == 32 << 20 and engine.shard_expert_weights is False
    assert engine.get_target_weight_layout() is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"release_after_refit": "yes"}, r"release_after_refit: 'yes'"),
        ({"transport": "UCX"}, r"unknown keys \['transport'\]"),
        ({"weight_sync": {"catalog": {"mode": "standalone", "address": "nowhere"}}}, r"catalog.address: 'nowhere'"),
        (
            {"weight_sync": {"nemo_rl": {"engine_by_methd": {}}}},
            r"weight_sync.nemo_rl: unknown keys \['engine_by_methd'\]",
        ),
        (
            {"weight_sync": {"nemo_rl": {"arena_device": "host"}}},
            r"weight_sync.nemo_rl.arena_device: 'host' \(expected one of \['worker', 'gpu', 'cpu'\]\)",
        ),
        (
            {"weight_sync": {"receive_mode": "direct"}},
            r"weight_sync.receive_mode: 'direct' is not supported by the NeMo RL checkpoint engine",
        ),
    ],
)
def test_bad_engine_kwargs_name_the_field(kwargs: dict, message: str) -> None:
    from mx_refit_nemo_rl.engine import MxCheckpointEngine

    with pytest.raises(InvalidArgument, match=message):
        MxCheckpointEngine(bucket_size=1 << 20, **kwargs)


def worker() -> nrl.MegatronPolicyWorker:
    return nrl.MegatronPolicyWorker(rank=0, model=object(), bridge=object(), cfg={})


def test_owner_from_the_export_generator() -> None:
    w = worker()
    gen = w._iter_params_with_optional_kv_scales(kv_scales={"k": 2.0})
    found = owner.from_weights(gen)
    assert found is not None and found.worker is w and found.strategy == "generator"
    assert found.kv_scales == {"k": 2.0}
    assert inspect.getgeneratorstate(gen) == inspect.GEN_CREATED  # looking does not start it


def test_owner_through_the_target_layout_genexpr() -> None:
    w = worker()

    class LayoutEngine:
        def get_target_weight_layout(self):
            return {"some": "layout"}

    w.checkpoint_engine = LayoutEngine()
    wrapped = w._checkpoint_engine_weight_iterator()
    assert inspect.isgenerator(wrapped) and wrapped is not w.generators[-1]
    assert owner.unwrap_generator(wrapped) is w.generators[-1]
    assert owner.from_weights(wrapped).worker is w


def test_owner_from_the_call_stack_at_construction() -> None:
    w = worker()
    asyncio.run(w.checkpoint_engine_rpc("init_checkpoint_engine", {
        "backend": ENGINE_CLASS_PATH, "bucket_size_bytes": 1 << 20, "engine_kwargs": dump()}))
    assert w.checkpoint_engine.policy_worker is w


def test_no_owner_closes_the_generator_and_says_so() -> None:
    from mx_refit_nemo_rl.engine import MxCheckpointEngine

    engine = MxCheckpointEngine(bucket_size=1 << 20, **dump())

    def plain():
        yield "x", None

    gen = plain()
    with pytest.raises(FailedPrecondition, match="owning Megatron policy worker"):
        asyncio.run(engine.send_weights(gen))
    assert inspect.getgeneratorstate(gen) == inspect.GEN_CLOSED


def test_prepare_outside_any_worker_is_refused() -> None:
    from mx_refit_nemo_rl.engine import MxCheckpointEngine

    engine = MxCheckpointEngine(bucket_size=1 << 20, **dump())
    with pytest.raises(FailedPrecondition, match="worker_cls"):
        engine.prepare()


def test_fallback_reasons_follow_the_worker_config() -> None:
    from mx_refit_nemo_rl.fallback import fallback_reasons

    w = worker()
    assert fallback_reasons(w, None) == []
    w.draft_model = object()
    w.cfg = {"generation": {"backend": "vllm", "vllm_cfg": {"kv_cache_dtype": "fp8_e4m3"}}}
    w.fp8_cfg = {"fp8_param": True, "fp8_recipe": "blockwise"}
    reasons = fallback_reasons(w, None)
    assert len(reasons) == 3 and "draft" in reasons[0] and "FP8 KV" in reasons[1] and "FP8 param" in reasons[2]
    w.cfg = {"quant_cfg": "FP8_DEFAULT_CFG"}
    assert fallback_reasons(w, None)[0].startswith("ModelOpt quantisation is on (policy.quant_cfg='FP8_DEFAULT_CFG')")


def test_the_arena_lives_on_the_workers_device_unless_told_otherwise() -> None:
    import torch

    from mx_refit_nemo_rl.engine import MxCheckpointEngine
    from mx_refit_nemo_rl.settings import resolve_arena_device

    assert MxCheckpointEngine(bucket_size=1 << 20, **dump()).arena_device == "worker"
    # vLLM's GPU worker sets worker.device = torch.device(f"cuda:{i}"), its CPU worker "cpu".
    assert resolve_arena_device("worker", torch.device("cuda", 3)) == "cuda:3"
    assert resolve_arena_device("gpu", torch.device("cuda", 1)) == "cuda:1"
    assert resolve_arena_device("worker", torch.device("cpu")) == "cpu"
    assert resolve_arena_device("cpu", torch.device("cuda", 3)) == "cpu"
    with pytest.raises(InvalidArgument, match=r"arena_device: 'gpu', but this vLLM worker runs on 'cpu'"):
        resolve_arena_device("gpu", torch.device("cpu"))
    with pytest.raises(InvalidArgument, match=r"arena_device: 'worker', but this vLLM worker's device is unknown"):
        resolve_arena_device("worker", None)


def test_import_is_light() -> None:
    """NeMo RL imports the class path in every worker; the package itself loads no framework."""
    import subprocess
    import sys

    code = (
        "import sys, mx_refit_nemo_rl, mx_refit_nemo_rl.settings, mx_refit_nemo_rl.owner;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'nixl', 'vllm', 'megatron', 'grpc'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
