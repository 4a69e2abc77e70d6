"""The kernel of argument checks (mx_refit.checks): one wording per check, both renderings, the
mode names every entry point shares, and the one batching helper loaders use."""

from __future__ import annotations

import math

import pytest

import mx_refit
from mx_refit import config
from mx_refit.checks import (
    CATALOG_MODES,
    FANOUT_MODES,
    TRANSPORT_MODES,
    batches,
    check_count,
    check_flag,
    check_mode,
    check_name,
    check_seconds,
)
from mx_refit.errors import InvalidArgument


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: check_seconds(0, "ttl_s"), "ttl_s: must be a finite number of seconds > 0, got 0"),
        (lambda: check_seconds(True, "ttl_s"), "ttl_s: must be a finite number of seconds > 0, got True"),
        (lambda: check_seconds(math.inf, "ttl_s"), "ttl_s: must be a finite number of seconds > 0, got inf"),
        (lambda: check_seconds(math.nan, "ttl_s"), "ttl_s: must be a finite number of seconds > 0, got nan"),
        (lambda: check_seconds("5", "ttl_s"), "ttl_s: must be a finite number of seconds > 0, got '5'"),
        (lambda: check_seconds(-1.0, "f", allow_zero=True), "f: must be a finite number of seconds >= 0, got -1.0"),
        (lambda: check_seconds(0.0, "weight_sync.lease_ttl_s", setting=True),
         "weight_sync.lease_ttl_s: 0.0 (expected a finite number of seconds > 0)"),
        (lambda: check_count(True, "n", minimum=1), "n: must be an integer >= 1, got True"),
        (lambda: check_count(1.0, "n"), "n: must be an integer >= 0, got 1.0"),
        (lambda: check_count(-1, "m", setting=True), "m: -1 (expected an integer >= 0)"),
        (lambda: check_name("", "model"), "model: must be a non-empty string, got ''"),
        (lambda: check_name(3, "model"), "model: must be a non-empty string, got 3"),
        (lambda: check_name("  ", "model", blank_ok=False), "model: must be a non-blank string, got '  '"),
        (lambda: check_flag(1, "checksums"), "checksums: must be a bool, got 1"),
        (lambda: check_flag("yes", "weight_sync.checksums", setting=True),
         "weight_sync.checksums: 'yes' (expected true or false)"),
        (lambda: check_mode("grpc", "transport", TRANSPORT_MODES),
         "transport: 'grpc' (expected 'auto', 'nixl' or 'cuda_ipc')"),
        (lambda: check_mode("star", "fanout", FANOUT_MODES), "fanout: 'star' (expected 'none' or 'tree')"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field_and_the_value(call, message) -> None:
    with pytest.raises(InvalidArgument) as caught:
        call()
    assert str(caught.value) == message


def test_good_values_come_back_normalised() -> None:
    assert check_seconds(2, "t") == 2.0 and isinstance(check_seconds(2, "t"), float)
    assert check_seconds(0, "t", allow_zero=True) == 0.0
    assert check_count(0, "n") == 0 and check_count(5, "n", minimum=5) == 5
    assert check_name(" x", "m", blank_ok=False) == " x"
    assert check_flag(False, "f") is False
    assert check_mode("standalone", "mode", CATALOG_MODES) == "standalone"


def test_the_config_schema_uses_the_same_modes_and_defaults() -> None:
    cfg = config.WeightSyncConfig()
    assert (cfg.transport, cfg.fanout, cfg.catalog.mode) == (TRANSPORT_MODES[0], FANOUT_MODES[0], CATALOG_MODES[0])
    assert cfg.transfer_timeout_s == config.DEFAULT_TRANSFER_TIMEOUT_S == 120.0
    for mode in TRANSPORT_MODES:
        assert config.load_config({"transport": mode}).transport == mode
    with pytest.raises(InvalidArgument, match=r"weight_sync.drain_timeout_s: inf \(expected a finite"):
        config.load_config({"drain_timeout_s": math.inf})


def test_batches_group_tensors_by_bytes_in_order() -> None:
    torch = pytest.importorskip("torch")
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([2, 2, 5, 1, 1, 1])]
    grouped = list(mx_refit.batches(tensors, 16))  # 16 bytes: 4 float32
    assert [[name for name, _ in batch] for batch in grouped] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert [pair for batch in grouped for pair in batch] == tensors  # nothing dropped, nothing reordered
    assert list(batches([], 16)) == []
    assert [len(b) for b in batches(tensors, 1 << 30)] == [6]


def test_the_kernel_imports_only_the_errors() -> None:
    """checks.py sits beneath config, the constructors and transport: it may lean on nothing else."""
    import ast
    from pathlib import Path

    import mx_refit.checks

    tree = ast.parse(Path(mx_refit.checks.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert {m for m in imported if m and m.startswith("mx_refit")} == {"mx_refit.errors"}
