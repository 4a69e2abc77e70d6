"""Built-in Megatron plugin: plans receives for versions published by Megatron-Core ranks.

Kept import-light: the planner (and torch) load only when a Megatron version is planned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mx_refit import hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.plan import ReceivePlan
    from mx_refit.types import TargetLayout, VersionInfo

MEGATRON_CONFIG_KEY = "megatron.config"


@hookimpl
def mx_refit_plan_receive(version: "VersionInfo", target: "TargetLayout") -> "ReceivePlan | None":
    """Plan any Megatron TP/PP/EP source layout into the worker's target layout."""
    if MEGATRON_CONFIG_KEY not in version.sidecar:
        return None
    from mx_refit.layout.planner import plan_receive

    return plan_receive(version, target)
