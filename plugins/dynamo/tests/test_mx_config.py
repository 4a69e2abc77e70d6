"""The upstream MX config mapping: every key mapped, refused by name, or unknown with a hint."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mx_refit.errors import InvalidArgument
from mx_refit_dynamo import map_mx_config
from mx_refit_dynamo.mx_config import MAPPING


def test_an_upstream_shaped_config_maps_to_init_and_update_infos() -> None:
    mapped = map_mx_config(
        {
            "enabled": True,
            "mx_server_url": "grpc://10.0.0.5:50551",
            "timeout_seconds": 45,
            "same_rank_only": False,
            "tree_scale_out": False,
            "moe_expert_filter": True,
            "expert_placement": "linear",
            "use_arena": True,
            "buffer_loc": "host",
            "min_version": 3,
            "load_batch_bytes": 1 << 20,
        },
        version=7,
        default_model="qwen3-8b",
    )
    assert mapped.init_info == {
        "catalog": "10.0.0.5:50551",
        "model": "qwen3-8b",
        "transfer_timeout_s": 45,
        "arena_device": "cpu",
        "load_batch_bytes": 1 << 20,
    }
    assert mapped.update_info == {"version": 7, "min_version": 3, "wait_s": 45}


def test_the_payloads_are_valid_mx_infos() -> None:
    from mx_refit_vllm.infos import MxInitInfo, MxUpdateInfo

    mapped = map_mx_config({"mx_server_url": "h:1", "model_name": "m", "timeout_seconds": 5}, version=2)
    assert MxInitInfo(**mapped.init_info).catalog == "h:1"
    assert MxUpdateInfo(**mapped.update_info).wait_s == 5


def test_a_dataclass_config_is_accepted() -> None:
    @dataclass
    class MxConfig:  # the shape of ModelExpress's MxConfig
        enabled: bool = True
        mx_server_url: str = "http://catalog:50551"
        timeout_seconds: float = 30.0
        same_rank_only: bool = False
        tree_scale_out: bool = False
        moe_expert_filter: bool = True
        register_self_buffers: bool | None = None
        nic_pin: str | None = None
        retain_latest_k: int | None = None

    assert map_mx_config(MxConfig(), default_model="m").init_info["catalog"] == "catalog:50551"


@pytest.mark.parametrize("key", sorted(k for k, v in MAPPING.items() if v.startswith("refused")))
def test_keys_without_meaning_here_are_refused_by_name(key) -> None:
    with pytest.raises(InvalidArgument, match=rf"mx_config\.{key}=1: refused"):
        map_mx_config({"mx_server_url": "h:1", "model_name": "m", key: 1})


@pytest.mark.parametrize(
    "config, message",
    [
        ({"enabled": False}, r"mx_config\.enabled=False"),
        ({"same_rank_only": True}, r"mx_config\.same_rank_only=True"),
        ({"tree_scale_out": True}, r"mx_config\.tree_scale_out=True"),
        ({"moe_expert_filter": False}, r"mx_config\.moe_expert_filter=False"),
        ({"use_arena": False}, r"mx_config\.use_arena=False"),
        ({"expert_placement": "round_robin"}, r"mx_config\.expert_placement='round_robin'"),
        ({"buffer_loc": "disk"}, r"mx_config\.buffer_loc='disk'"),
        ({"version": 3}, r"mx_config\.version=3 contradicts version=7"),
        ({"timout_seconds": 1}, "did you mean 'timeout_seconds'"),
        ({"mx_server_url": "grpc://h:1/path"}, "has a path"),
        ({"mx_server_url": None}, "mx_server_url: missing"),
    ],
)
def test_unsupported_values_and_unknown_keys(config, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        map_mx_config({"mx_server_url": "h:1", "model_name": "m", **config}, version=7)


def test_the_model_name_defaults_to_the_worker_s_and_is_required() -> None:
    assert map_mx_config({"mx_server_url": "h:1"}, default_model="served").init_info["model"] == "served"
    with pytest.raises(InvalidArgument, match="model_name: missing"):
        map_mx_config({"mx_server_url": "h:1"})


def test_the_readme_table_is_the_mapping() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for key, meaning in MAPPING.items():
        assert f"| `{key}` | {meaning} |" in readme, key
