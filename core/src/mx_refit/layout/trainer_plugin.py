"""Trainer-side Megatron plugin: lets ``Publisher.publish(version, model=...)`` publish a
Megatron-Core model through the plugin hooks.

Wrap the model and its bridge in a :class:`MegatronSource`::

    source = MegatronSource(bridge, model_chunks)          # once
    publisher.publish(step, model=source)                  # every step, on every rank together

``mx_refit_collect_tensors`` classifies and collects the native shards in place;
``mx_refit_build_sidecar`` contributes the ``megatron.config`` / ``megatron.hf_map`` entries built
from the same Bridge conversion tasks (computed once per publish: it is a pipeline collective).
Register this module as a plugin (``mx_refit.layout.trainer_plugin``) to enable it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mx_refit import hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.layout.classify import RoleOverrides
    from mx_refit.types import MeshPosition, PublishedTensor

__all__ = ["MegatronSource", "mx_refit_build_sidecar", "mx_refit_collect_tensors"]


@dataclass
class MegatronSource:
    """A Megatron-Core model on this rank plus the Megatron-Bridge that maps it to HF names.

    ``overrides``: a ``RoleOverrides`` registry or config dicts; ``None`` asks the installed
    plugins (``mx_refit_register_role_overrides``) on first use.
    """

    bridge: Any
    model: Any
    overrides: RoleOverrides | Sequence[Mapping[str, Any]] | None = None
    hf_config: Any = None
    _sidecar: dict[str, Any] | None = field(default=None, init=False, repr=False)

    def collect(self) -> tuple[list[PublishedTensor], dict[str, Any]]:
        """This rank's native shards (in place) and sidecar; the sidecar is kept for the hook."""
        from mx_refit.layout.classify import RoleOverrides
        from mx_refit.layout.collect import collect_for_publish

        if self.overrides is None:
            self.overrides = RoleOverrides.from_plugins()
        tensors, sidecar = collect_for_publish(self.bridge, self.model, self.overrides, hf_config=self.hf_config)
        self._sidecar = sidecar
        return tensors, sidecar

    def take_sidecar(self) -> dict[str, Any]:
        """The sidecar of the last ``collect()`` (computing it if there was none), then forget it."""
        sidecar = self._sidecar if self._sidecar is not None else self.collect()[1]
        self._sidecar = None
        return sidecar


@hookimpl
def mx_refit_collect_tensors(model: Any, mesh: MeshPosition) -> list[PublishedTensor] | None:
    """Collect a :class:`MegatronSource`'s native shards; ``None`` for anything else."""
    if not isinstance(model, MegatronSource):
        return None
    return model.collect()[0]


@hookimpl
def mx_refit_build_sidecar(model: Any, mesh: MeshPosition) -> dict[str, Any] | None:
    """The Megatron sidecar of a :class:`MegatronSource` (built during collection)."""
    if not isinstance(model, MegatronSource):
        return None
    return model.take_sidecar()
