"""Every recipe composes through Hydra and validates; bad values name the field."""

from __future__ import annotations

import pytest

from mx_refit.config import RECIPES_DIR, load_recipe
from mx_refit.errors import InvalidArgument

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_recipes_exist():
    assert "config" in RECIPES and len(RECIPES) >= 3


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_validates(name):
    cfg = load_recipe(name)
    assert cfg.method == "mx"
    assert cfg.model_name


def test_recipe_values_reach_the_schema():
    cfg = load_recipe("grpo-qwen3-30b-a3b-megatron-tp4-vllm-tp2")
    assert (cfg.catalog.mode, cfg.catalog.address, cfg.full_tensors) == ("standalone", "catalog.internal:50551", False)
    assert cfg.model_name == "qwen3-30b-a3b" and cfg.plugins == ["vllm"]
    llama = load_recipe("grpo-llama-8b-megatron-tp2-vllm-tp1")
    (rule,) = llama.role_overrides
    assert (rule.role, rule.shard_axis) == ("row", 1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["weight_sync.method=nccl"], r"weight_sync.method: 'nccl'"),
        (["catalog=standalone"], r"weight_sync.catalog.address"),
        (["catalog=standalone", "weight_sync.catalog.address=nohostport"], r"address: 'nohostport'"),
        (["weight_sync.catalog.mode=cloud"], r"weight_sync.catalog.mode: 'cloud'"),
        (["weight_sync.lease_ttl_s=0"], r"weight_sync.lease_ttl_s: 0"),
        (["weight_sync.transfer_timeout_s=fast"], r"weight_sync.transfer_timeout_s"),
        (["+weight_sync.unknown_key=1"], r"unknown_key"),
        (["weight_sync.role_overrides=[{role: diagonal, pattern: x}]"], r"role_overrides\[0\].role: 'diagonal'"),
        (["weight_sync.role_overrides=[{role: row}]"], r"role_overrides\[0\]: give exactly one"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(InvalidArgument, match=message):
        load_recipe("config", overrides)
