"""Plugin manager factory and the typed facade over ``pm.hook``.

Loading is lazy (first hook call), happens once per :class:`Hooks`, and is controlled by:

- ``allow`` (``Hooks(allow=...)``, from ``weight_sync.plugins``): the same allow-list, from a
  config; the environment variable wins when both are set.
- ``MX_REFIT_PLUGINS``: comma-separated allow-list of entry-point names. Only these load, and
  one that cannot be found or imported raises :class:`PluginLoadError`. Set but empty: no
  third-party plugin loads (the built-ins always do). Unset: every installed plugin loads; one
  that fails to import is skipped with a warning.
- ``MX_REFIT_DISABLE_PLUGINS``: comma-separated block-list (wins over the allow-list).
- ``MX_REFIT_TRACE_PLUGINS=1``: log every hook call and result (logger ``mx_refit.plugins.trace``,
  which is then set to DEBUG so the trace shows whatever the root level).
- ``MX_REFIT_METRICS_PORT``: also register :class:`mx_refit.metrics.RefitMetrics` and serve
  Prometheus metrics on that port (needs ``mx-refit[metrics]``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

from mx_refit import hookspecs
from mx_refit.hookspecs import PROJECT_NAME

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mx_refit.hookspecs import RegisterRoleOverride
    from mx_refit.overrides import RoleOverrides
    from mx_refit.plan import ReceivePlan
    from mx_refit.types import MeshPosition, PublishedTensor, RefitStats, TargetLayout, VersionInfo

__all__ = ["BUILTIN_PLUGINS", "ENTRY_POINT_GROUP", "Hooks", "PluginLoadError", "get_plugin_manager"]

log = logging.getLogger(__name__)
trace_log = logging.getLogger(f"{__name__}.trace")

ENTRY_POINT_GROUP = PROJECT_NAME
# Built-in behaviour is itself plugins, registered before third-party ones (pytest's idiom).
BUILTIN_PLUGINS: tuple[str, ...] = ("mx_refit.builtin", "mx_refit.megatron.plugin")

ALLOW_ENV = "MX_REFIT_PLUGINS"
BLOCK_ENV = "MX_REFIT_DISABLE_PLUGINS"
TRACE_ENV = "MX_REFIT_TRACE_PLUGINS"


class PluginLoadError(RuntimeError):
    """An allow-listed plugin is missing or failed to import."""


def _env_names(var: str) -> set[str] | None:
    """The names in ``var``; None when it is unset (an empty value is the empty set)."""
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def get_plugin_manager() -> pluggy.PluginManager:
    """A fresh manager with the specs added and nothing loaded (no side effects)."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def load_plugins(pm: pluggy.PluginManager, allow: "Iterable[str] | None" = None) -> None:
    """Register the built-ins and the allowed entry points, then check every hookimpl.

    :param allow: an allow-list from a config (``weight_sync.plugins``); ``None`` or empty
        allows every plugin. ``MX_REFIT_PLUGINS`` wins when set.
    """
    allowed = _env_names(ALLOW_ENV)
    allow_source = ALLOW_ENV
    if allowed is None and allow:
        allowed = {name.strip() for name in allow if name.strip()}
        allow_source = "weight_sync.plugins"
    blocked = _env_names(BLOCK_ENV) or set()
    for name in blocked:
        pm.set_blocked(name)

    for module_name in BUILTIN_PLUGINS:
        if module_name not in blocked and pm.get_plugin(module_name) is None:
            pm.register(importlib.import_module(module_name), name=module_name)

    found: set[str] = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.add(ep.name)
        if ep.name in blocked or (allowed is not None and ep.name not in allowed):
            continue
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # an allow-listed plugin must fail loudly, others are skipped
            if allowed is not None:
                raise PluginLoadError(f"{allow_source} plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
            warnings.warn(f"mx-refit plugin {ep.name!r} ({ep.value}) skipped: {exc}", RuntimeWarning, stacklevel=2)
            continue
        pm.register(plugin, name=ep.name)

    if allowed is not None:
        missing = sorted(allowed - found - blocked - set(BUILTIN_PLUGINS))
        if missing:
            raise PluginLoadError(
                f"{allow_source} names {missing} but no installed distribution provides them in the "
                f"{ENTRY_POINT_GROUP!r} entry-point group (installed: {sorted(found) or 'none'})"
            )
    from mx_refit.metrics import METRICS_PORT_ENV, refit_metrics_from_env

    if os.environ.get(METRICS_PORT_ENV, "").strip() and "mx_refit.metrics" not in blocked:
        metrics = refit_metrics_from_env()
        if metrics is not None and pm.get_plugin("mx_refit.metrics") is None:
            pm.register(metrics, name="mx_refit.metrics")
    pm.check_pending()
    if os.environ.get(TRACE_ENV, "").strip() not in ("", "0"):
        trace_log.setLevel(logging.DEBUG)
        pm.trace.root.setwriter(lambda message: trace_log.debug(message.rstrip()))
        _enable_redacted_tracing(pm)


# Setting names whose values are secrets (the catalog token in a recipe's settings).
_SECRET = re.compile(r"token|secret|password|authorization|credential", re.IGNORECASE)


def _redacted(value: Any) -> Any:
    """``value`` with every secret-named mapping entry masked (nested mappings and lists too)."""
    if isinstance(value, Mapping):
        return {key: "<redacted>" if isinstance(key, str) and _SECRET.search(key) and item else _redacted(item)
                for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_redacted(item) for item in value)
    return value


def _enable_redacted_tracing(pm: pluggy.PluginManager) -> None:
    """pluggy's hook tracing (the same lines) with secrets masked in the arguments and results:
    ``mx_refit_configure`` gets the whole ``weight_sync`` block, catalog token included."""
    hooktrace = pm.trace.root.get("hook")

    def before(hook_name: str, methods: Any, kwargs: Mapping[str, object]) -> None:
        hooktrace.root.indent += 1
        hooktrace(hook_name, _redacted(kwargs))

    def after(outcome: Any, hook_name: str, methods: Any, kwargs: Mapping[str, object]) -> None:
        if outcome.exception is None:
            hooktrace("finish", hook_name, "-->", _redacted(outcome.get_result()))
        hooktrace.root.indent -= 1

    pm.add_hookcall_monitoring(before, after)


class Hooks:
    """Typed facade: one method per hook. The only code that calls ``pm.hook``.

    :param pm: An existing manager (tests, embedding hosts). ``None`` builds one lazily on first
        use and loads plugins into it exactly once, thread-safely.
    :param allow: Plugin allow-list (``weight_sync.plugins``); ``None`` or empty: every plugin.
    """

    def __init__(
        self, pm: pluggy.PluginManager | None = None, *, load: bool = True, allow: Iterable[str] | None = None
    ) -> None:
        self._pm = pm
        self._load = load
        self._allow = list(allow) if allow is not None else None
        self._loaded = pm is not None and not load
        self._lock = threading.Lock()
        self._settings: dict[str, Any] = {}
        self._overrides: "RoleOverrides | None" = None

    @property
    def pm(self) -> pluggy.PluginManager:
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    if self._pm is None:
                        self._pm = get_plugin_manager()
                    if self._load:
                        load_plugins(self._pm, allow=self._allow)
                    self._loaded = True
        assert self._pm is not None
        return self._pm

    def register(self, plugin: object, name: str | None = None) -> str | None:
        """Register an extra plugin object (inline plugins, tests)."""
        return self.pm.register(plugin, name=name)

    def unregister(self, plugin: object) -> None:
        self.pm.unregister(plugin)

    def describe(self) -> list[dict[str, Any]]:
        """What loaded: ``[{"name", "builtin", "distribution", "version", "hooks"}]`` in
        registration order (built-ins first), each with the hooks it implements. ``distribution``
        and ``version`` name the installed package whose entry point loaded a plugin (None for
        the built-ins and for plugins registered in-process)."""
        pm = self.pm
        # Plugins register under their entry point's name (load_plugins), so the entry point
        # tells which distribution shipped each one.
        shipped = {ep.name: ep.dist for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        listing = []
        for name, plugin in pm.list_name_plugin():
            if plugin is None:  # blocked
                continue
            builtin = name in BUILTIN_PLUGINS
            dist = None if builtin else shipped.get(name)
            hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or ())
            listing.append({
                "name": name,
                "builtin": builtin,
                "distribution": dist.name if dist is not None else None,
                "version": dist.version if dist is not None else None,
                "hooks": hooks,
            })
        return listing

    # -- configuration ------------------------------------------------------------------------
    def configure(self, settings: dict[str, Any]) -> None:
        self._settings = dict(settings)
        self._overrides = None
        self.pm.hook.mx_refit_configure.call_historic(kwargs={"settings": dict(settings)})

    def role_overrides(self) -> "RoleOverrides":
        """Overrides from plugins, then from the ``role_overrides`` setting (config wins);
        built once per configuration."""
        if self._overrides is None:
            from mx_refit.overrides import RoleOverrides

            registry = RoleOverrides()
            self.register_role_overrides(registry.register)
            registry.extend_from_config(self._settings.get("role_overrides") or ())
            self._overrides = registry
        return self._overrides

    def register_role_overrides(self, register: "RegisterRoleOverride") -> None:
        self.pm.hook.mx_refit_register_role_overrides(register=register)

    # -- trainer side ---------------------------------------------------------------------------
    def collect_tensors(self, model: Any, mesh: "MeshPosition") -> "list[PublishedTensor]":
        tensors = self.pm.hook.mx_refit_collect_tensors(model=model, mesh=mesh, overrides=self.role_overrides())
        if tensors is None:
            raise TypeError(
                f"no mx-refit plugin can collect tensors from a {type(model).__module__}.{type(model).__qualname__}; "
                "pass a {name: tensor} mapping, a torch.nn.Module, or install the framework's plugin"
            )
        return list(tensors)

    def build_sidecar(self, model: Any, mesh: "MeshPosition") -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.pm.hook.mx_refit_build_sidecar(model=model, mesh=mesh):
            for key, value in (part or {}).items():
                if key in merged and merged[key] != value:
                    raise ValueError(f"sidecar key {key!r} is contributed twice with different values")
                merged[key] = value
        return merged

    # -- inference side -------------------------------------------------------------------------
    def target_layout(self, engine: Any) -> "TargetLayout":
        from mx_refit.types import TargetLayout

        layout = self.pm.hook.mx_refit_target_layout(engine=engine)
        return layout if layout is not None else TargetLayout()

    def plan_receive(self, version: "VersionInfo", target: "TargetLayout") -> "ReceivePlan":
        plan = self.pm.hook.mx_refit_plan_receive(version=version, target=target)
        if plan is None:
            raise TypeError(f"no mx-refit plugin can plan version {version.version} of {version.model!r}")
        return plan

    def load_weights(self, engine: Any, weights: "list[tuple[str, torch.Tensor]]") -> None:
        if not self.pm.hook.mx_refit_load_weights(engine=engine, weights=weights):
            raise TypeError(
                f"no mx-refit plugin can load weights into a {type(engine).__qualname__}; give it a "
                "load_weights(iterable) method, pass a mapping of tensors, or install the engine's plugin"
            )

    def direct_targets(
        self, engine: Any, tensors: "list[tuple[str, tuple[int, ...], str]]"
    ) -> "dict[str, Callable[[int, torch.Tensor], None]]":
        """Row writers for a ``receive_mode: direct`` refit (empty: every tensor loads whole)."""
        writers = self.pm.hook.mx_refit_direct_targets(engine=engine, tensors=tensors)
        return dict(writers or {})

    # -- lifecycle --------------------------------------------------------------------------------
    def version_published(self, model: str, version: int, source_id: str, mesh: "MeshPosition") -> None:
        self.pm.hook.mx_refit_version_published(model=model, version=version, source_id=source_id, mesh=mesh)

    def version_ready(self, model: str, version: int) -> None:
        self.pm.hook.mx_refit_version_ready(model=model, version=version)

    def refit_done(self, stats: "RefitStats") -> None:
        self.pm.hook.mx_refit_refit_done(stats=stats)

    def version_retired(self, model: str, version: int) -> None:
        self.pm.hook.mx_refit_version_retired(model=model, version=version)

    def version_drained(self, model: str, version: int) -> None:
        self.pm.hook.mx_refit_version_drained(model=model, version=version)

    def refit_failed(self, model: str, version: int | None, error: BaseException) -> None:
        self.pm.hook.mx_refit_refit_failed(model=model, version=version, error=error)
