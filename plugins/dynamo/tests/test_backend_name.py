"""Case 7: mx-refit and Dynamo's development branch both register a vLLM backend named ``mx``.

The rule (``mx_refit_dynamo.backend``): ``mx_refit`` always selects mx-refit; ``mx`` is whoever
registered first, and neither order is silent.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import HERE


@pytest.fixture(scope="module")
def reports() -> dict:
    """Both orders, in one fresh process (vLLM's registries are process-global)."""
    out = subprocess.run(
        [sys.executable, str(HERE / "_dev_branch_engine.py"), "dynamo-first", "mx-refit-first"],
        capture_output=True, text=True, timeout=600, cwd=HERE,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_dynamo_first_keeps_mx_and_mx_refit_is_still_reachable_by_its_alias(reports) -> None:
    report = reports["dynamo-first"]
    assert report["owner"] == {"mx": "_dev_branch_engine", "mx_refit": "mx-refit"}
    assert report["classes"] == {"mx": "DevMxEngine", "mx_refit": "MxWeightTransferEngine"}
    assert report["trainer_owner"] == "mx-refit"
    assert any("belongs to _dev_branch_engine" in w and "'mx_refit'" in w for w in report["warnings"]), report
    # What a worker on the foreign `mx` answers to mx-refit's init info; the client turns this
    # into an error that names the alias (tested in test_client_hints_at_the_alias).
    assert "Invalid init_info for DevMxEngine" in report["foreign_init_error"]


def test_mx_refit_first_owns_mx_and_dynamo_s_registration_fails_loudly(reports) -> None:
    report = reports["mx-refit-first"]
    assert report["owner"] == {"mx": "mx-refit", "mx_refit": "mx-refit"}
    assert report["classes"] == {"mx": "MxWeightTransferEngine", "mx_refit": "MxWeightTransferEngine"}
    assert "'mx' is already registered" in report["dynamo_registration_error"]
    assert report["warnings"] == []


def test_the_client_names_the_alias_when_a_worker_s_mx_is_foreign(ckpts, log_dir) -> None:
    """A real Dynamo worker whose vLLM rank got the other package's ``mx`` refuses mx-refit's init
    info; the client's error says which backend name to start workers with."""
    from conftest import start_workers

    from mx_refit_dynamo import DynamoRefitClient, DynamoRefitError

    (worker,) = start_workers([("dev-mx", 1)], ckpts[0], log_dir, worker_script="_dev_mx_worker.py")
    try:
        client = DynamoRefitClient([worker.system_url])
        with pytest.raises(DynamoRefitError, match="Invalid init_info for DevMxEngine.*start workers with backend 'mx_refit'"):
            client.init_weight_transfer_engine({"catalog": "127.0.0.1:1", "model": "m"})
        assert worker.calls() == ["rpc:init_weight_transfer_engine"]
    finally:
        worker.stop()
