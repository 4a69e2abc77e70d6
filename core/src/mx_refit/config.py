"""Typed configuration of the ``weight_sync`` block (``weight_sync.method: mx``) and its validation.

The schema is plain dataclasses. :func:`load_config` builds a :class:`WeightSyncConfig` from any
mapping (a plain dict, an OmegaConf ``DictConfig``, a framework's own config tree), so hosts such as
NeMo RL need no Hydra recipe folder; :func:`load_recipe` composes one of the bundled Hydra recipes
and hands it to the same loader. mx-refit validates only its own keys (an unknown one gets a "did
you mean"); a key whose value is a mapping is a plugin's namespace (``weight_sync.<plugin>: {...}``),
kept for that plugin in :attr:`WeightSyncConfig.plugin_settings`. Errors name the field and the value.

Where each key takes effect:

- ``model_name``, ``source_ttl_s``, ``drain_timeout_s``, ``checksums``, ``checksum_block_bytes``,
  ``publish_format``, ``delta``, ``delta_anchor_every``, ``plugins``, ``role_overrides``:
  ``Publisher.from_config``; ``model_name``, ``delta``,
  ``transfer_timeout_s``, ``lease_ttl_s``, ``full_tensors``, ``checksums``, ``plugins``,
  ``role_overrides``, ``fanout``, ``max_readers_per_source``: ``Receiver.from_config``. Both call
  ``Hooks.configure(as_dict(cfg))``, so plugins see the whole block (their namespace included).
- ``catalog.*``: ``catalog_address(cfg)`` (standalone) and ``start_catalog(config=cfg)`` (embedded).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mx_refit.checks import (
    AUTO,
    CATALOG_MODES,
    CUDA_IPC,
    DIRECT,
    EMBEDDED,
    FANOUT_MODES,
    MIN_RECEIVE_BUFFER_BYTES,
    NIXL,
    NO_FANOUT,
    STAGED,
    STANDALONE,
    TRANSPORT_MODES,
    TREE,
    check_count,
    check_flag,
    check_mode,
    check_name,
    check_receive_buffer_bytes,
    check_receive_mode,
    check_seconds,
)
from mx_refit.errors import InvalidArgument
from mx_refit.types import Role

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.catalog.api import Catalog

__all__ = [
    # the settings' defaults (one place: the schema, the constructors and the plugins use these)
    "DEFAULT_CHECKSUM_BLOCK_BYTES",
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_LOAD_BATCH_BYTES",
    "DEFAULT_RECEIVE_BUFFER_BYTES",
    "DEFAULT_SOURCE_TTL_S",
    "DEFAULT_TRANSFER_TIMEOUT_S",
    # mode names and argument checks (from mx_refit.checks, re-exported for plugins)
    "AUTO",
    "CATALOG_MODES",
    "CUDA_IPC",
    "DIRECT",
    "EMBEDDED",
    "FANOUT_MODES",
    "MIN_RECEIVE_BUFFER_BYTES",
    "NIXL",
    "NO_FANOUT",
    "STAGED",
    "STANDALONE",
    "TRANSPORT_MODES",
    "TREE",
    "check_count",
    "check_flag",
    "check_mode",
    "check_name",
    "check_receive_buffer_bytes",
    "check_receive_mode",
    "check_seconds",
    # the schema
    "CatalogConfig",
    "RoleOverrideConfig",
    "WeightSyncConfig",
    "as_dict",
    "catalog_address",
    "catalog_argument",
    "load_config",
    "load_recipe",
    "validate",
]

# Wheels ship the top-level recipes/ folder as mx_refit/recipes (see setup.py); a source checkout
# reads it in place.
_PACKAGED_RECIPES = Path(__file__).resolve().parent / "recipes"
RECIPES_DIR = _PACKAGED_RECIPES if _PACKAGED_RECIPES.is_dir() else Path(__file__).resolve().parents[3] / "recipes"

# Defaults of the settings more than one entry point takes (WeightSyncConfig, Publisher, Receiver,
# the vLLM plugin's MxInitInfo): declared once, here.
DEFAULT_TRANSFER_TIMEOUT_S = 120.0
DEFAULT_LEASE_TTL_S = 60.0
DEFAULT_SOURCE_TTL_S = 30.0
DEFAULT_DRAIN_TIMEOUT_S = 120.0
DEFAULT_CHECKSUM_BLOCK_BYTES = 1 << 20
DEFAULT_LOAD_BATCH_BYTES = 512 << 20
DEFAULT_RECEIVE_BUFFER_BYTES = 256 << 20  # receive_mode direct: the bounce buffer's size


@dataclass
class CatalogConfig:
    mode: str = EMBEDDED  # embedded | standalone
    address: str | None = None  # standalone: host:port of `mx-refit serve`; embedded: filled in once started
    host: str = "127.0.0.1"  # embedded: bind address (0.0.0.0 binds every interface)
    port: int = 0  # embedded: 0 picks a free port
    advertise_host: str | None = None  # embedded: the host name clients dial (default: a routable one)
    token: str | None = field(default=None, repr=False)  # a secret: never in a repr or a log line
    # embedded: where the catalog keeps its state, memory or redis://HOST:PORT/DB (kept across
    # restarts, shared with `mx-refit serve --store` processes on the same Redis)
    store: str = "memory"


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
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    source_ttl_s: float = DEFAULT_SOURCE_TTL_S
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    full_tensors: bool = True
    transport: str = AUTO  # auto | nixl | cuda_ipc (see README, "Data paths")
    checksums: bool = False  # end-to-end per-block checksums (see README, "End-to-end checksums")
    checksum_block_bytes: int = DEFAULT_CHECKSUM_BLOCK_BYTES  # block size of those checksums (publishers)
    publish_format: str = "bf16"  # bf16 | fp8_block: quantise linear weights on publish (README, "FP8 on publish")
    delta: str = "off"  # off | auto | on: move only the bytes changed since the receiver's version (README, "Delta refits")
    delta_anchor_every: int = 10  # publishers: every N-th version is published whole (an anchor)
    receive_mode: str = STAGED  # staged (whole-version arena) | direct (bounded buffer); README "Receive memory"
    receive_buffer_bytes: int = DEFAULT_RECEIVE_BUFFER_BYTES  # direct: receive memory outside the parameters
    fanout: str = NO_FANOUT  # none | tree: receivers republish their arena as replicas (README, "Fan-out")
    max_readers_per_source: int = 0  # > 0: concurrent readers one source serves at most
    plugins: list[str] = field(default_factory=list)  # allow-list of plugin names; [] loads every one
    role_overrides: list[RoleOverrideConfig] = field(default_factory=list)
    # weight_sync.<plugin>: {...} namespaces, untouched by mx-refit, for their plugins
    plugin_settings: dict[str, dict[str, Any]] = field(default_factory=dict)


def validate(cfg: WeightSyncConfig) -> WeightSyncConfig:
    """Check what types alone cannot; raise :class:`InvalidArgument` naming field and value."""
    if cfg.method != "mx":
        raise InvalidArgument(f"weight_sync.method: {cfg.method!r} is not handled by mx-refit (expected 'mx')")
    check_name(cfg.model_name, "weight_sync.model_name", setting=True)
    check_mode(cfg.catalog.mode, "weight_sync.catalog.mode", CATALOG_MODES)
    if cfg.catalog.mode == STANDALONE:
        host, sep, port = (cfg.catalog.address or "").rpartition(":")
        if not (host and sep and port.isdigit()):
            raise InvalidArgument(f"weight_sync.catalog.address: {cfg.catalog.address!r} (expected host:port)")
    if not 0 <= cfg.catalog.port < 65536:
        raise InvalidArgument(f"weight_sync.catalog.port: {cfg.catalog.port} out of range")
    from mx_refit.catalog.store import check_store_url

    check_store_url(cfg.catalog.store, "weight_sync.catalog.store")
    for i, name in enumerate(cfg.plugins):
        if not isinstance(name, str) or not name.strip():
            raise InvalidArgument(f"weight_sync.plugins[{i}]: {name!r} (expected a plugin name)")
    for key in ("transfer_timeout_s", "lease_ttl_s", "source_ttl_s", "drain_timeout_s"):
        check_seconds(getattr(cfg, key), f"weight_sync.{key}", setting=True)
    check_mode(cfg.transport, "weight_sync.transport", TRANSPORT_MODES)
    check_flag(cfg.checksums, "weight_sync.checksums", setting=True)
    from mx_refit.checksums import check_block_bytes

    check_block_bytes(cfg.checksum_block_bytes, "weight_sync.checksum_block_bytes")
    from mx_refit.checks import PUBLISH_FORMATS

    check_mode(cfg.publish_format, "weight_sync.publish_format", PUBLISH_FORMATS)
    check_mode(cfg.fanout, "weight_sync.fanout", FANOUT_MODES)
    check_receive_mode(cfg.receive_mode, "weight_sync.receive_mode")
    check_receive_buffer_bytes(cfg.receive_buffer_bytes, "weight_sync.receive_buffer_bytes", setting=True)
    check_mode(cfg.delta, "weight_sync.delta", ("off", "auto", "on"))
    check_count(cfg.delta_anchor_every, "weight_sync.delta_anchor_every", minimum=1, setting=True)
    check_count(cfg.max_readers_per_source, "weight_sync.max_readers_per_source", minimum=0, setting=True)
    roles = {r.value for r in Role}
    for i, rule in enumerate(cfg.role_overrides):
        if rule.role not in roles:
            raise InvalidArgument(f"weight_sync.role_overrides[{i}].role: {rule.role!r} (expected one of {sorted(roles)})")
        if (rule.pattern is None) == (rule.module_class is None):
            raise InvalidArgument(f"weight_sync.role_overrides[{i}]: give exactly one of pattern or module_class")
    return cfg


def load_config(mapping: Any) -> WeightSyncConfig:
    """Build and validate a :class:`WeightSyncConfig` from a mapping, without Hydra.

    :param mapping: The ``weight_sync`` block, or a whole config holding one under the key
        ``weight_sync``: a plain dict or an OmegaConf ``DictConfig`` (interpolations are resolved
        against its root). Missing keys take their defaults.
    :raises InvalidArgument: naming the field and the value, for a wrong type or value, and for
        an unknown scalar key (with the closest known key). Keys holding a mapping that mx-refit
        does not know are plugin namespaces, returned in ``cfg.plugin_settings[<plugin>]``.
    """
    section = _plain(mapping)
    if not isinstance(section, Mapping):
        raise InvalidArgument(f"weight_sync: expected a mapping, got {type(mapping).__qualname__}")
    if isinstance(section.get("weight_sync"), Mapping):
        section = section["weight_sync"]
    namespaces: dict[str, dict[str, Any]] = {}
    cfg = _build(WeightSyncConfig, section, "weight_sync", namespaces)
    for name, settings in namespaces.items():
        if name in cfg.plugin_settings and cfg.plugin_settings[name] != settings:
            raise InvalidArgument(f"weight_sync.{name}: given both there and in weight_sync.plugin_settings.{name}")
        cfg.plugin_settings[name] = settings
    return validate(cfg)


def load_recipe(name: str = "config", overrides: list[str] | None = None, config_dir: Path | None = None) -> WeightSyncConfig:
    """Compose ``name`` (a YAML file in ``config_dir``, default ``recipes/``) with Hydra and
    validate its ``weight_sync`` block with :func:`load_config`."""
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
    except OmegaConfBaseException as exc:  # interpolation errors
        raise InvalidArgument(f"recipe {name!r}: weight_sync.{exc.full_key}: {exc.msg}") from exc
    return load_config(section)


def as_dict(cfg: WeightSyncConfig) -> dict[str, Any]:
    """The config as plain JSON-safe data (what ``Hooks.configure`` hands to plugins)."""
    return dataclasses.asdict(cfg)


def catalog_address(cfg: WeightSyncConfig) -> str | None:
    """The catalog address clients dial: ``catalog.address`` (always set for ``standalone``; for
    ``embedded`` once the process that started it filled it in), else ``None``."""
    return cfg.catalog.address


def catalog_argument(cfg: WeightSyncConfig, catalog: "str | Catalog | None") -> "str | Catalog":
    """The catalog a ``from_config`` constructor hands on: the caller's, else the config's address."""
    if catalog is not None:
        return catalog
    if cfg.catalog.address:
        return cfg.catalog.address
    raise InvalidArgument(
        "weight_sync.catalog.address: None; with catalog.mode 'embedded' start the catalog first "
        "(mx_refit.start_catalog(config=cfg) fills it in) or pass catalog=..."
    )


# ----------------------------------------------------------------------------- the loader


def _plain(value: Any) -> Any:
    """OmegaConf containers -> plain dicts/lists (interpolations resolved)."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:
            return OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException as exc:
            raise InvalidArgument(f"weight_sync.{exc.full_key}: {exc.msg}") from exc
    return value


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f" (known keys: {', '.join(sorted(known))})"


def _build(cls: type, data: Any, path: str, namespaces: dict[str, dict[str, Any]] | None = None) -> Any:
    """``cls`` (a config dataclass) from ``data``; ``namespaces`` collects plugin blocks (top level only)."""
    data = _plain(data)
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"{path}: {data!r} (expected a mapping)")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in hints:
            values[key] = _coerce(value, hints[key], f"{path}.{key}")
            continue
        close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.75)
        if namespaces is not None and isinstance(value, Mapping) and not close:
            namespaces[str(key)] = dict(value)  # a plugin's namespace: its plugin validates it
            continue
        if close:
            raise InvalidArgument(f"{path}.{key}: unknown key (value {value!r}); did you mean {close[0]!r}?")
        hint = "" if namespaces is None else "; a plugin's settings go in a mapping, weight_sync.<plugin>: {...}"
        raise InvalidArgument(f"{path}.{key}: unknown key (value {value!r}){_suggest(str(key), names)}{hint}")
    return cls(**values)


def _coerce(value: Any, hint: Any, path: str) -> Any:
    value = _plain(value)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, path)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)  # type: ignore[arg-type]
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise InvalidArgument(f"{path}: {value!r} (expected a list)")
        (item,) = typing.get_args(hint)
        return [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise InvalidArgument(f"{path}: {value!r} (expected a mapping)")
        return {str(k): _plain(v) for k, v in value.items()}
    if hint is Any:
        return value
    if hint is bool:
        return check_flag(value, path, setting=True)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgument(f"{path}: {value!r} (expected a number)")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{path}: {value!r} (expected an integer)")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise InvalidArgument(f"{path}: {value!r} (expected a string)")
        return str(value)
    raise TypeError(f"{path}: unsupported config type {hint!r}")  # a schema bug, not user input
