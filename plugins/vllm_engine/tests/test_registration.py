"""Registration through vLLM's plugin mechanism: entry points, idempotence, tolerance, laziness.

The vLLM-side checks run in a fresh interpreter so that the "no factory" case really sees a vLLM
whose ``weight_transfer`` package cannot be imported, and nothing is imported ahead of time.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def test_entry_points_are_declared() -> None:
    general = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert general.get("mx_refit") == "mx_refit_vllm:register"
    core = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="mx_refit")}
    assert core.get("vllm") == "mx_refit_vllm.hooks"


def test_core_plugin_manager_loads_the_vllm_hooks() -> None:
    from mx_refit.plugins import Hooks

    hooks = Hooks()
    assert hooks.pm.get_plugin("vllm") is not None
    # Not a vLLM object: the plugin declines and the built-in default answers.
    assert hooks.target_layout(object()).full_tensors is True


_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("mx_refit_vllm").addHandler(Keep())
    logging.getLogger("mx_refit_vllm").setLevel(logging.DEBUG)

    # 1. A vLLM without the weight-transfer factory: register() is a silent no-op.
    sys.modules["vllm.distributed.weight_transfer"] = None
    import mx_refit_vllm
    mx_refit_vllm.register()
    assert any("factory unavailable" in m for m in records), records
    del sys.modules["vllm.distributed.weight_transfer"]

    # 2. Someone else already owns the trainer-side "mx" name: keep theirs, warn, do not raise.
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine
    from vllm.distributed.weight_transfer import factory
    W, T = factory.WeightTransferEngineFactory, factory.WeightTransferTrainerFactory
    class Foreign(TrainerWeightTransferEngine):
        pass
    T.register_engine("mx", Foreign)

    # 3. vLLM loads general plugins (our entry point) -- then again, and register() by hand twice.
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    mx_refit_vllm.register(); mx_refit_vllm.register()
    assert T._registry["mx"]() is Foreign
    assert any("already registered by another package" in m and "select it as 'mx_refit'" in m
               for m in records), records
    # The alias holds mx-refit's engines on both sides, whoever holds "mx".
    assert T._registry["mx_refit"]().__name__ == "MxTrainerWeightTransferEngine"
    assert W._registry["mx_refit"]().__name__ == "MxWeightTransferEngine"

    # 4. Registration is lazy: the engine module is imported only when vLLM creates the engine.
    cls = W._registry["mx"]()
    assert cls.__module__ == "mx_refit_vllm.engine" and cls.__name__ == "MxWeightTransferEngine"
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    assert issubclass(cls, WeightTransferEngine)
    assert cls.init_info_cls.__name__ == "MxInitInfo" and cls.update_info_cls.__name__ == "MxUpdateInfo"
    print("REGISTRATION-OK")
    """
)


def test_register_is_idempotent_tolerant_and_lazy() -> None:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "REGISTRATION-OK" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )


def test_the_trainer_module_names_the_supported_vllm_without_one() -> None:
    # The core environment has torch and mx-refit but no vLLM: a real install without vLLM.
    from mx_refit.testing.procs import core_python

    python = core_python()
    if python is None:
        pytest.skip("the core venv (no vLLM) is not available; set MX_REFIT_CORE_PYTHON")
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [python, "-c", "import mx_refit_vllm.trainer"], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: mx_refit_vllm.trainer needs vLLM >=0.33,<0.34"), proc.stderr[-2000:]
    assert "vllm is not installed" in last
