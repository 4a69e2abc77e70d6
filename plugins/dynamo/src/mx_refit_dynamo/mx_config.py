"""Upstream MX config -> mx-refit's init and update infos.

Dynamo's development-branch MX refit (``dynamo.vllm.mx_refit``) configures workers with a
ModelExpress ``MxConfig`` (``enabled``, ``mx_server_url``, ``timeout_seconds``,
``same_rank_only``, ``tree_scale_out``, ``moe_expert_filter``, ``register_self_buffers``,
``nic_pin``, ``retain_latest_k``) plus update keys of its native path (``version``,
``min_version``, ``expert_placement``, ``ep_world_size``, ``ep_rank``, ``num_experts``,
``buffer_loc``, ``use_arena``, ``verify_gt_path``). :func:`map_mx_config` turns such a dict into
the ``mx`` backend's ``MxInitInfo``/``MxUpdateInfo`` payloads, so a deployment migrates by
pointing ``mx_server_url`` at an mx-refit catalog. A key that means nothing here, or a value
mx-refit cannot honour, is refused by name; nothing is silently ignored. The table in the
README is generated from :data:`MAPPING`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mx_refit.config import check_count, check_name, check_seconds
from mx_refit.errors import InvalidArgument

__all__ = ["MAPPING", "MappedConfig", "map_mx_config"]

# key -> what happens to it (the README's table).
MAPPING: dict[str, str] = {
    "mx_server_url": "`MxInitInfo.catalog` (`host:port`; a `grpc://`/`http://` prefix is dropped). "
    "Must be an mx-refit catalog, not a ModelExpress server.",
    "model_name": "`MxInitInfo.model`; default: the worker's served model name.",
    "enabled": "must be `true` (`false` is refused: the caller asked for no MX refit).",
    "timeout_seconds": "`MxInitInfo.transfer_timeout_s` and `MxUpdateInfo.wait_s`.",
    "version": "`MxUpdateInfo.version` (must equal the call's `version=` when both are given).",
    "min_version": "`MxUpdateInfo.min_version`.",
    "token": "`MxInitInfo.token` (the catalog's bearer token; mx-refit only).",
    "same_rank_only": "`false` accepted (the planner picks sources by the bytes it needs); `true` refused.",
    "tree_scale_out": "`false` accepted; `true` refused (no tree fan-out: workers read trainer sources).",
    "moe_expert_filter": "`true` accepted (experts are filtered by the worker's own EP rank); "
    "`false` refused.",
    "expert_placement": '`"linear"` accepted (vLLM\'s default placement); anything else refused.',
    "use_arena": "`true` accepted (mx-refit always receives into one registered arena); `false` refused.",
    "buffer_loc": '`"host"`/`"cpu"` -> `MxInitInfo.arena_device="cpu"`; '
    '`"device"`/`"gpu"`/`"cuda"` -> the worker\'s device.',
    "ep_world_size": "refused: derived from the worker's parallel config.",
    "ep_rank": "refused: derived from the worker's parallel config.",
    "num_experts": "refused: derived from the model.",
    "register_self_buffers": "refused: workers never republish what they received.",
    "nic_pin": "refused: pin NICs with `UCX_NET_DEVICES` in the worker's environment.",
    "retain_latest_k": "refused: the trainer retires versions (`Publisher.wait_drained`/`wait_read`).",
    "verify_gt_path": "refused: verify offline with `mx-refit verify`.",
}
# mx-refit's own keys, accepted as they are (init info fields, then update info fields).
NATIVE_INIT = (
    "arena_device",
    "lease_ttl_s",
    "transfer_timeout_s",
    "ready_timeout_s",
    "load_batch_bytes",
    "strict_names",
    "checksums",
)
NATIVE_UPDATE = ("wait_s",)

_REFUSED = {k for k, v in MAPPING.items() if v.startswith("refused")}
_ACCEPTED_ONLY = {
    "same_rank_only": False,
    "tree_scale_out": False,
    "moe_expert_filter": True,
    "use_arena": True,
}


@dataclass(frozen=True)
class MappedConfig:
    """The ``mx`` backend payloads an upstream MX config maps to (plain JSON dicts)."""

    init_info: dict[str, Any]
    update_info: dict[str, Any]


def map_mx_config(
    mx_config: Mapping[str, Any] | Any | None,
    *,
    version: int | None = None,
    default_model: str | None = None,
) -> MappedConfig:
    """Map an upstream MX config (a dict, or a dataclass such as ModelExpress's ``MxConfig``)
    to ``MxInitInfo``/``MxUpdateInfo`` dicts; refuse unknown or unsupported keys by name."""
    config = _as_dict(mx_config)
    known = set(MAPPING) | set(NATIVE_INIT) | set(NATIVE_UPDATE)
    for key in config:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidArgument(f"mx_config.{key}: unknown key{hint}; known keys: {sorted(known)}")
        if key in _REFUSED and config[key] is not None:
            raise InvalidArgument(f"mx_config.{key}={config[key]!r}: {MAPPING[key]}")
    for key, accepted in _ACCEPTED_ONLY.items():
        if key in config and config[key] is not None and config[key] is not accepted:
            raise InvalidArgument(f"mx_config.{key}={config[key]!r}: {MAPPING[key]}")
    if config.get("enabled", True) is not True:
        raise InvalidArgument(f"mx_config.enabled={config['enabled']!r}: {MAPPING['enabled']}")
    placement = config.get("expert_placement", "linear")
    if placement != "linear":
        raise InvalidArgument(f"mx_config.expert_placement={placement!r}: {MAPPING['expert_placement']}")

    init: dict[str, Any] = {k: config[k] for k in NATIVE_INIT if config.get(k) is not None}
    update: dict[str, Any] = {k: config[k] for k in NATIVE_UPDATE if config.get(k) is not None}
    if config.get("mx_server_url") is None:
        raise InvalidArgument(
            "mx_config.mx_server_url: missing; point it at the mx-refit catalog (host:port)"
        )
    init["catalog"] = _catalog_address(config["mx_server_url"])
    model = config.get("model_name") or default_model
    if not model:
        raise InvalidArgument("mx_config.model_name: missing, and the worker has no model name to default to")
    init["model"] = check_name(model, "mx_config.model_name")
    if config.get("token") is not None:
        init["token"] = check_name(config["token"], "mx_config.token")
    timeout = config.get("timeout_seconds")
    if timeout is not None:
        check_seconds(timeout, "mx_config.timeout_seconds")
        init.setdefault("transfer_timeout_s", timeout)
        update.setdefault("wait_s", timeout)
    location = config.get("buffer_loc")
    if location is not None:
        if location in ("host", "cpu"):
            init["arena_device"] = "cpu"
        elif location not in ("device", "gpu", "cuda"):
            raise InvalidArgument(
                f"mx_config.buffer_loc={location!r}: expected 'host', 'cpu', 'device', 'gpu' or 'cuda'"
            )
    configured = config.get("version")
    if configured is not None:
        check_count(configured, "mx_config.version", minimum=0)
    if version is not None and configured is not None and configured != version:
        raise InvalidArgument(f"mx_config.version={configured!r} contradicts version={version!r}")
    chosen = version if version is not None else configured
    if chosen is not None:
        update["version"] = chosen
    if config.get("min_version") is not None:
        update["min_version"] = check_count(config["min_version"], "mx_config.min_version", minimum=0)
    return MappedConfig(init_info=init, update_info=update)


def _as_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    raise InvalidArgument(f"mx_config: expected a dict or a dataclass, got {type(config).__name__}")


def _catalog_address(url: Any) -> str:
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgument(f"mx_config.mx_server_url: expected 'host:port', got {url!r}")
    text = url.strip()
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme not in ("grpc", "http", "https") or not parts.hostname or not parts.port:
            raise InvalidArgument(
                f"mx_config.mx_server_url: expected 'host:port' or 'grpc://host:port', got {url!r}"
            )
        if parts.path.strip("/"):
            raise InvalidArgument(
                f"mx_config.mx_server_url: {url!r} has a path; an mx-refit catalog is host:port"
            )
        return parts.netloc
    return text
