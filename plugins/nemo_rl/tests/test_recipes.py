"""Every shipped recipe composes through NeMo RL's loader rules, in both branches of the switch.

mx branch: the class-path engine, its ``refit_cfg`` block and the mx vLLM worker are selected,
NeMo RL's refit validation accepts them (no colocation, vLLM backend) and the engine builds from
the exact dump, validating mx-refit's keys. default branch (``weight_sync.method=default`` on the
command line): ``refit_transport: null``, ``worker_cls: auto``, no checkpoint engine, and mx-refit's
keys are not validated.
"""

from __future__ import annotations

from pathlib import Path

import _nemo_rl_contract as nrl
import pytest
from conftest import PLUGIN, compose_recipe

from mx_refit.errors import InvalidArgument
from mx_refit_nemo_rl import ENGINE_CLASS_PATH, VLLM_WORKER_CLASS_PATH

RECIPES = sorted(p.name for p in (PLUGIN / "recipes").glob("grpo-*.yaml"))


def test_the_four_recipes_ship() -> None:
    assert len(RECIPES) == 4
    assert (PLUGIN / "recipes" / "mx-refit.yaml").exists()


@pytest.mark.parametrize("recipe", RECIPES)
def test_mx_branch(recipe: str, configs: Path) -> None:
    from nemo_rl.utils.checkpoint_engines.base import create_checkpoint_engine

    master = compose_recipe(recipe, [], configs)
    generation = master.policy["generation"]
    assert generation["refit_transport"] == ENGINE_CLASS_PATH
    assert generation["vllm_kwargs"]["worker_cls"] == VLLM_WORKER_CLASS_PATH
    assert "nixl" in generation["refit_cfg"], "the parent's blocks are kept"
    config = nrl.check_weight_synchronizer(generation)  # NeMo RL's factory rules pass
    assert config is not None and config["backend"] == ENGINE_CLASS_PATH
    kwargs = config["engine_kwargs"][ENGINE_CLASS_PATH]
    assert set(kwargs) == {"release_after_refit", "weight_sync"}
    engine = create_checkpoint_engine(config["backend"], bucket_size_bytes=64 << 20, engine_kwargs=kwargs)
    assert engine.config.method == "mx" and engine.release_after_refit is False
    assert master.weight_sync["method"] == "mx"  # MasterConfig(extra="allow") keeps the block


@pytest.mark.parametrize("recipe", RECIPES)
def test_default_branch(recipe: str, configs: Path) -> None:
    master = compose_recipe(recipe, ["weight_sync.method=default", "weight_sync.lease_ttl_s=-1"], configs)
    generation = master.policy["generation"]
    assert generation["refit_transport"] is None
    assert generation["vllm_kwargs"]["worker_cls"] == "auto"
    assert nrl.check_weight_synchronizer(generation) is None  # NeMo RL's own refit path


def test_same_node_recipe_switches_placement(configs: Path) -> None:
    name = "grpo-llama3.2-1b-megatron-same-node-mx.yaml"
    mx = compose_recipe(name, [], configs).policy["generation"]["colocated"]
    default = compose_recipe(name, ["weight_sync.method=default"], configs).policy["generation"]["colocated"]
    assert mx == {"enabled": False, "resources": {"gpus_per_node": 2, "num_nodes": None}}
    assert default["enabled"] is True
    # NeMo RL refuses a class-path engine under colocation; the mx branch never asks for it.
    generation = compose_recipe(name, ["policy.generation.colocated.enabled=true"], configs).policy["generation"]
    with pytest.raises(ValueError, match="non-colocated"):
        nrl.check_weight_synchronizer(generation)


def test_standalone_recipe_points_at_the_catalog(configs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MX_REFIT_CATALOG", "catalog.example:50551")
    master = compose_recipe("grpo-llama3.1-8b-megatron-tp2-vllm-tp1-mx-standalone.yaml", [], configs)
    kwargs = nrl.check_weight_synchronizer(master.policy["generation"])["engine_kwargs"][ENGINE_CLASS_PATH]
    from mx_refit_nemo_rl.settings import parse_engine_kwargs

    cfg = parse_engine_kwargs(1 << 20, kwargs).config
    assert (cfg.catalog.mode, cfg.catalog.address) == ("standalone", "catalog.example:50551")


def test_mx_keys_are_validated_in_the_mx_branch(configs: Path) -> None:
    from nemo_rl.utils.checkpoint_engines.base import create_checkpoint_engine

    master = compose_recipe(RECIPES[0], ["weight_sync.lease_ttl_s=-1"], configs)
    config = nrl.check_weight_synchronizer(master.policy["generation"])
    with pytest.raises(InvalidArgument, match=r"weight_sync.lease_ttl_s: -1"):
        create_checkpoint_engine(config["backend"], bucket_size_bytes=1 << 20,
                                 engine_kwargs=config["engine_kwargs"][config["backend"]])


def test_cli_overrides_reach_the_engine_through_weight_sync(configs: Path) -> None:
    master = compose_recipe(RECIPES[0], [
        "weight_sync.nemo_rl.release_after_refit=true",
        "weight_sync.role_overrides=[{role: column, pattern: 'decoder.*.my_proj.weight', shard_axis: 0}]",
    ], configs)
    config = nrl.check_weight_synchronizer(master.policy["generation"])
    kwargs = config["engine_kwargs"][ENGINE_CLASS_PATH]
    from mx_refit_nemo_rl.settings import parse_engine_kwargs

    settings = parse_engine_kwargs(1 << 20, kwargs)
    assert settings.release_after_refit is True
    assert settings.config.role_overrides[0].pattern == "decoder.*.my_proj.weight"
