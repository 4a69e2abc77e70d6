"""Typed configuration for Hydra recipes (``weight_sync.method: mx``) and its validation.

The schema is plain dataclasses; :func:`load_recipe` composes a recipe with Hydra and validates it
into a :class:`WeightSyncConfig`. Errors name the field and the value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mx_refit.errors import InvalidArgument
from mx_refit.types import Role

__all__ = ["CatalogConfig", "RoleOverrideConfig", "WeightSyncConfig", "load_recipe", "validate"]

RECIPES_DIR = Path(__file__).resolve().parents[3] / "recipes"


@dataclass
class CatalogConfig:
    mode: str = "embedded"  # embedded | standalone
    address: str | None = None  # standalone: host:port of `mx-refit serve`
    host: str = "127.0.0.1"  # embedded: bind address
    port: int = 0  # embedded: 0 picks a free port
    token: str | None = None


@dataclass
class RoleOverrideConfig:
    role: str = "replicated"
    pattern: str | None = None
    module_class: str | None = None
    shard_axis: int | None = None


@dataclass
class WeightSyncConfig:
    method: str = "mx"
    model_name: str = "policy"
    catalog: CatalogConfig = field(default_factory=CatalogConfig)
    transfer_timeout_s: float = 120.0
    lease_ttl_s: float = 60.0
    source_ttl_s: float = 30.0
    drain_timeout_s: float = 120.0
    full_tensors: bool = True
    plugins: list[str] = field(default_factory=list)
    role_overrides: list[RoleOverrideConfig] = field(default_factory=list)


def validate(cfg: WeightSyncConfig) -> WeightSyncConfig:
    """Check what types alone cannot; raise :class:`InvalidArgument` naming field and value."""
    if cfg.method != "mx":
        raise InvalidArgument(f"weight_sync.method: {cfg.method!r} is not handled by mx-refit (expected 'mx')")
    if not cfg.model_name:
        raise InvalidArgument("weight_sync.model_name: must be a non-empty string")
    if cfg.catalog.mode not in ("embedded", "standalone"):
        raise InvalidArgument(f"weight_sync.catalog.mode: {cfg.catalog.mode!r} (expected 'embedded' or 'standalone')")
    if cfg.catalog.mode == "standalone":
        host, sep, port = (cfg.catalog.address or "").rpartition(":")
        if not (host and sep and port.isdigit()):
            raise InvalidArgument(f"weight_sync.catalog.address: {cfg.catalog.address!r} (expected host:port)")
    if not 0 <= cfg.catalog.port < 65536:
        raise InvalidArgument(f"weight_sync.catalog.port: {cfg.catalog.port} out of range")
    for key in ("transfer_timeout_s", "lease_ttl_s", "source_ttl_s", "drain_timeout_s"):
        if getattr(cfg, key) <= 0:
            raise InvalidArgument(f"weight_sync.{key}: {getattr(cfg, key)} must be > 0")
    roles = {r.value for r in Role}
    for i, rule in enumerate(cfg.role_overrides):
        if rule.role not in roles:
            raise InvalidArgument(f"weight_sync.role_overrides[{i}].role: {rule.role!r} (expected one of {sorted(roles)})")
        if (rule.pattern is None) == (rule.module_class is None):
            raise InvalidArgument(f"weight_sync.role_overrides[{i}]: give exactly one of pattern or module_class")
    return cfg


def load_recipe(name: str = "config", overrides: list[str] | None = None, config_dir: Path | None = None) -> WeightSyncConfig:
    """Compose ``name`` (a YAML file in ``config_dir``, default ``recipes/``) and validate it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    directory = (config_dir or RECIPES_DIR).resolve()
    with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
        cfg = compose(config_name=name, overrides=list(overrides or []))
    if "weight_sync" not in cfg:
        raise InvalidArgument(f"recipe {name!r}: no weight_sync section")
    try:
        # Resolve against the whole recipe first (``${model_name}`` lives at its root).
        section = OmegaConf.to_container(cfg.weight_sync, resolve=True)
        merged = OmegaConf.merge(OmegaConf.structured(WeightSyncConfig), section)
        typed: Any = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:  # type errors, missing values (???), unknown keys
        raise InvalidArgument(f"recipe {name!r}: weight_sync.{exc.full_key}: {exc.msg}") from exc
    return validate(typed)


def as_dict(cfg: WeightSyncConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
