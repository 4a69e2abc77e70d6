"""Where things are found: ``hookimpl`` next to the hookspecs, the Megatron helpers on
``mx_refit.megatron``, and both still reachable from the package root, import-light."""

from __future__ import annotations

import subprocess
import sys

import mx_refit
import mx_refit.hookspecs
import mx_refit.megatron


def test_hookimpl_lives_next_to_the_hookspecs_and_the_root_re_exports_it() -> None:
    assert mx_refit.hookimpl is mx_refit.hookspecs.hookimpl
    assert mx_refit.hookspecs.hookimpl.project_name == mx_refit.hookspecs.PROJECT_NAME
    assert "hookimpl" in mx_refit.__all__


def test_the_megatron_helpers_are_reachable_from_mx_refit_megatron() -> None:
    for name in mx_refit.megatron.__all__:
        assert callable(getattr(mx_refit.megatron, name)), name
    assert {"BridgedModel", "ParallelContext", "mesh_position", "is_publishing_rank"} <= set(mx_refit.megatron.__all__)
    for name in ("BridgedModel", "mesh_position", "is_publishing_rank"):  # a publishing loop's three
        assert name in mx_refit.__all__ and getattr(mx_refit, name) is getattr(mx_refit.megatron, name)


def test_the_megatron_package_stays_import_light() -> None:
    probe = (
        "import sys, mx_refit.megatron as m\n"
        "m.BridgedModel, m.ParallelContext, m.classify_model, m.collect_megatron_tensors, m.build_sidecar\n"
        "heavy = [x for x in ('torch', 'megatron', 'grpc', 'nixl') if x in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)
