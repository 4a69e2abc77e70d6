"""Hook specifications: the contract between the mx-refit core and its plugins.

Framework plugins (NeMo RL, Dynamo, vLLM, Megatron) implement these with ``@mx_refit.hookimpl``
(:data:`hookimpl`, defined here next to the specs and re-exported from the package root)
and are found through the ``mx_refit`` entry-point group. The core calls them only through the
typed facade :class:`mx_refit.plugins.Hooks`; nothing else touches ``pm.hook``.

Any hook may be implemented as a new-style wrapper (``@hookimpl(wrapper=True)``) for cross-cutting
work such as timing, tracing, or pausing an engine around a load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:  # pragma: no cover - types only
    import torch

    from mx_refit.overrides import RoleOverrides
    from mx_refit.plan import ReceivePlan
    from mx_refit.types import (
        MeshPosition,
        PublishedTensor,
        RefitStats,
        Role,
        TargetLayout,
        VersionInfo,
    )

PROJECT_NAME = "mx_refit"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for plugin hook implementations: ``@mx_refit.hookimpl`` (the same object)."""


class RegisterRoleOverride(Protocol):
    """The callback handed to :func:`mx_refit_register_role_overrides`."""

    def __call__(
        self,
        *,
        role: "Role | str",
        pattern: str | None = None,
        module_class: str | None = None,
        shard_axis: int | None = None,
    ) -> None: ...


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@hookspec(historic=True)
def mx_refit_configure(settings: dict[str, Any]) -> None:
    """Receive the process's mx-refit settings (catalog address, model name, recipe values).

    Historic: a plugin registered after the call still receives it, so lazily loaded plugins
    see the same configuration as eager ones.

    :param settings: Plain, JSON-safe mapping. Plugins must treat it as read-only.
    Runs once per process that builds a :class:`~mx_refit.plugins.Hooks` facade and configures it
    (trainer ranks and inference workers alike).

    .. versionadded:: 0.1
    """


@hookspec
def mx_refit_register_role_overrides(register: RegisterRoleOverride) -> None:
    """Register role overrides for trainer-side tensor classification.

    Call ``register(role=..., pattern="decoder.*.my_proj.weight")`` to match parameter names
    (``fnmatch`` glob on the published, prefix-stripped name) or
    ``register(role=..., module_class="MyColumnLinear")`` to match the owning module's class
    name. Overrides win over detection; among overrides a name pattern wins over a class name,
    and later registrations win over earlier ones.

    :param register: Callback owned by the core; it validates the role and records the rule.
    Called on every trainer rank when the classifier is built. Results are ignored.

    .. versionadded:: 0.1
    """


# --------------------------------------------------------------------------------------------
# Trainer side (runs on every publishing rank)
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def mx_refit_collect_tensors(
    model: Any, mesh: "MeshPosition", overrides: "RoleOverrides"
) -> "list[PublishedTensor] | None":
    """Describe the local tensors this rank publishes, with their roles and shard geometry.

    Implementations return ``None`` for model objects they do not recognise. The tensors must
    be the live parameters (contiguous, never copies): the publisher registers them in place.

    :param model: The framework's model object on this rank (a Megatron ``MegatronModule`` list,
        a ``torch.nn.Module``, a ``{name: tensor}`` mapping, ...).
    :param mesh: This rank's TP/PP/EP position.
    :param overrides: The role overrides registered through
        :func:`mx_refit_register_role_overrides` and the ``role_overrides`` setting; classifiers
        must let them win over detection.
    :return: The tensors to publish, or ``None`` to let the next plugin try.
    Stops at the first non-``None`` result (``firstresult``); the built-in mapping/module
    collector runs last.

    .. versionadded:: 0.1
    """


@hookspec
def mx_refit_build_sidecar(model: Any, mesh: "MeshPosition") -> "dict[str, Any] | None":
    """Contribute model-level sidecar entries (e.g. transformer config, Megatron->HF name map).

    :param model: As in :func:`mx_refit_collect_tensors`.
    :param mesh: This rank's position; EP/PP ranks contribute only what they own, the catalog
        merges the parts recursively.
    :return: JSON-safe mapping, or ``None``. All results are merged; two plugins giving the same
        key different values is an error.

    .. versionadded:: 0.1
    """


# --------------------------------------------------------------------------------------------
# Inference side (runs in every receiving worker)
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def mx_refit_target_layout(engine: Any) -> "TargetLayout | None":
    """Tell the receiver which layout this worker needs (its TP/EP rank, full or sliced tensors).

    :param engine: The inference engine's model / worker object handed to the receiver.
    :return: The target layout, or ``None`` for engines the plugin does not know.
    Stops at the first non-``None`` result; the built-in default is "one rank, full tensors".

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def mx_refit_plan_receive(version: "VersionInfo", target: "TargetLayout") -> "ReceivePlan | None":
    """Plan exactly which byte ranges of which sources this worker reads, and how they become
    HF tensors.

    :param version: The READY version's manifest (sources, descriptors, sidecar).
    :param target: This worker's layout.
    :return: A :class:`~mx_refit.plan.ReceivePlan`, or ``None`` when the plugin does not handle
        this version's publisher kind. A plugin that handles it but finds uncovered bytes must
        raise :class:`~mx_refit.errors.CoverageError` instead of returning a partial plan.
    Stops at the first non-``None`` result; the built-in full-tensor planner runs last.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def mx_refit_load_weights(engine: Any, weights: "list[tuple[str, torch.Tensor]]") -> "bool | None":
    """Load one bounded batch of received HF-named tensors into the engine.

    Called only after every byte of the version has arrived, batch after batch.

    :param engine: As in :func:`mx_refit_target_layout`.
    :param weights: ``(hf_name, tensor)`` pairs; tensors may be views of the receive arena and
        are only valid until the next refit, so engines copy them into their own parameters.
    :return: ``True`` once handled; ``None`` to let the next plugin try.
    Stops at the first non-``None`` result. The built-in loader handles objects with a vLLM-style
    ``load_weights(iterable)`` method and mutable mappings of tensors.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def mx_refit_direct_targets(
    engine: Any, tensors: "list[tuple[str, tuple[int, ...], str]]"
) -> "dict[str, Callable[[int, torch.Tensor], None]] | None":
    """Prepare a ``receive_mode: direct`` refit, before its first byte is pulled.

    A direct refit writes the engine's parameters chunk by chunk through a bounded buffer, so
    anything that can refuse the version must refuse it here, while the engine still holds its
    previous weights (raise, e.g. for names the engine does not have).

    :param engine: As in :func:`mx_refit_target_layout`.
    :param tensors: ``(hf_name, shape, dtype)`` of every tensor the refit will load.
    :return: For the tensors the engine can take in pieces, a writer ``write(first_row, rows)``
        that puts ``rows`` (rows ``first_row ..`` of the tensor along dim 0) into its
        parameters; tensors without one are loaded whole through :func:`mx_refit_load_weights`
        (so each must fit the buffer). ``None`` to let the next plugin try. The built-in
        answers for mappings of destination tensors (every tensor of matching shape).

    .. versionadded:: 0.2
    """


# --------------------------------------------------------------------------------------------
# Lifecycle notifications (results ignored)
# --------------------------------------------------------------------------------------------


@hookspec
def mx_refit_version_published(model: str, version: int, source_id: str, mesh: "MeshPosition") -> None:
    """A trainer rank has registered and marked its source of ``version`` ready.

    Called in the publishing process, once per rank per version.

    .. versionadded:: 0.1
    """


@hookspec
def mx_refit_version_ready(model: str, version: int) -> None:
    """``version`` became READY (every expected source is ready).

    Called in the publishing process whose ``mark_ready`` completed the version.

    .. versionadded:: 0.1
    """


@hookspec
def mx_refit_refit_done(stats: "RefitStats") -> None:
    """A receiver finished one refit cycle: bytes, seconds, GB/s, descriptors, registrations.

    Called in the receiving worker after the weights were loaded and the lease released.

    .. versionadded:: 0.1
    """


@hookspec
def mx_refit_version_retired(model: str, version: int) -> None:
    """``version`` was retired: the catalog offers it to no new reader (live leases may finish).

    Called in the publishing process that asked the catalog to retire it
    (:meth:`~mx_refit.publisher.Publisher.wait_drained`), right after the catalog agreed.

    .. versionadded:: 0.2
    """


@hookspec
def mx_refit_version_drained(model: str, version: int) -> None:
    """``version`` is drained: retired and no reader holds a lease on it any more, so the
    trainer may mutate the published buffers (e.g. run its optimizer step).

    Called in a publishing process whose :meth:`~mx_refit.publisher.Publisher.wait_drained` or
    :meth:`~mx_refit.publisher.Publisher.wait_retired` saw it drained.

    .. versionadded:: 0.2
    """


@hookspec
def mx_refit_refit_failed(model: str, version: int | None, error: BaseException) -> None:
    """A receiver's refit cycle failed; the engine still holds its previous weights.

    :param model: The model name.
    :param version: The version being refitted, or ``None`` when none was found (discovery
        failed or timed out).
    :param error: The exception, which :meth:`~mx_refit.Receiver.refit` re-raises
        after every implementation ran.
    Called in the receiving worker, after the lease was released.

    .. versionadded:: 0.2
    """
