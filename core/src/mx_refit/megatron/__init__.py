"""Trainer side for Megatron-Core: classify a rank's native shards, collect them for publishing,
build the sidecar receivers plan from, and the built-in Megatron plugin that wires it into the
hooks (:mod:`mx_refit.megatron.plugin`).

The helpers a Megatron training loop uses are reachable from here (``from mx_refit.megatron
import BridgedModel, mesh_position, is_publishing_rank, ParallelContext, ...``); the three a
publishing loop needs most (``BridgedModel``, ``mesh_position``, ``is_publishing_rank``,
``expected_sources``) are also on the package root. Import-light: these load on first access (PEP 562), and megatron and
torch only when a function needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mx_refit._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
    from mx_refit.megatron.classify import ClassifiedParam, classify_model, unsupported_bridge_mappings
    from mx_refit.megatron.collect import collect_for_publish, collect_megatron_tensors
    from mx_refit.megatron.parallel import (
        BridgedModel,
        ParallelContext,
        expected_sources,
        innermost_module,
        is_publishing_rank,
        mesh_position,
        unwrap_model,
    )
    from mx_refit.megatron.sidecar import build_sidecar, conversion_tasks

_LAZY = {
    "BridgedModel": "mx_refit.megatron.parallel",
    "ClassifiedParam": "mx_refit.megatron.classify",
    "ParallelContext": "mx_refit.megatron.parallel",
    "build_sidecar": "mx_refit.megatron.sidecar",
    "classify_model": "mx_refit.megatron.classify",
    "collect_for_publish": "mx_refit.megatron.collect",
    "collect_megatron_tensors": "mx_refit.megatron.collect",
    "conversion_tasks": "mx_refit.megatron.sidecar",
    "expected_sources": "mx_refit.megatron.parallel",
    "innermost_module": "mx_refit.megatron.parallel",
    "is_publishing_rank": "mx_refit.megatron.parallel",
    "mesh_position": "mx_refit.megatron.parallel",
    "unsupported_bridge_mappings": "mx_refit.megatron.classify",
    "unwrap_model": "mx_refit.megatron.parallel",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


__all__ = [
    "BridgedModel",
    "ClassifiedParam",
    "ParallelContext",
    "build_sidecar",
    "classify_model",
    "collect_for_publish",
    "collect_megatron_tensors",
    "conversion_tasks",
    "expected_sources",
    "innermost_module",
    "is_publishing_rank",
    "mesh_position",
    "unsupported_bridge_mappings",
    "unwrap_model",
]
