"""Trainer side for Megatron-Core: classify a rank's native shards, collect them for publishing,
build the sidecar receivers plan from, and the built-in Megatron plugin that wires it into the
hooks (:mod:`mx_refit.megatron.plugin`).

Public runtime helpers (``BridgedModel``, ``mesh_position``, ``is_publishing_rank``) live in
:mod:`mx_refit.megatron.parallel` and are re-exported from the package root. Import-light:
megatron and torch load on first use.
"""
