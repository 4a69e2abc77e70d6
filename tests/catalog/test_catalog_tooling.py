"""Generated code is current, and the catalog package imports lazily."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_protos.py"


def run_python(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "core" / "src"))
    return subprocess.run([python, *args], capture_output=True, text=True, env=env, timeout=60, check=False)


def pinned_tools_python() -> str:
    """This Python when it has the pinned grpcio-tools, else the script's own cached venv's."""
    spec = importlib.util.spec_from_file_location("gen_protos_pin", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    if script._installed_tools() == script.GRPC_TOOLS:
        return sys.executable
    return str(script._pinned_tools_python())


def test_gen_protos_check_passes_on_the_committed_files() -> None:
    result = run_python(str(SCRIPT), "--check")
    assert result.returncode == 0, result.stderr
    assert "current" in result.stdout


def test_gen_protos_check_detects_a_stale_file(tmp_path: Path) -> None:
    # In a subprocess: grpc_tools' protoc links its own libprotobuf, and once loaded into a
    # process it makes a later import of NIXL's bundled libraries abort that process.
    package = tmp_path / "mx_refit" / "catalog" / "v1"
    shutil.copytree(REPO / "core" / "src" / "mx_refit" / "catalog" / "v1", package)
    stale = package / "catalog_pb2_grpc.py"
    stale.write_text(stale.read_text() + "\n# hand edit\n")
    code = (
        "import importlib.util, pathlib, sys\n"
        f"spec = importlib.util.spec_from_file_location('gen_protos_under_test', {str(SCRIPT)!r})\n"
        "script = importlib.util.module_from_spec(spec); spec.loader.exec_module(script)\n"
        f"script.SRC = pathlib.Path({str(tmp_path)!r})\n"
        "assert script.check() == ['mx_refit/catalog/v1/catalog_pb2_grpc.py'], script.check()\n"
        f"pathlib.Path({str(package / 'catalog_pb2.pyi')!r}).unlink()\n"
        "sys.exit(script.main(['--check']))\n"
    )
    # check() imports grpc_tools in-process: run it where the pinned version is installed.
    result = run_python("-c", code, python=pinned_tools_python())
    assert result.returncode == 1, result.stderr


def test_importing_the_catalog_does_not_import_grpc_or_protobuf() -> None:
    code = (
        "import sys, mx_refit.catalog as c\n"
        "from mx_refit.catalog import Catalog, CatalogLimits, CatalogService, VersionSummary\n"
        "CatalogService().list_versions('m')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google'))\n"
        "assert not heavy, heavy\n"
        "from mx_refit.catalog import CatalogClient\n"
        "assert 'grpc' in sys.modules\n"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr


def test_unknown_attribute_of_the_package_is_an_attribute_error() -> None:
    from mx_refit import catalog

    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        catalog.Nope  # noqa: B018
    assert set(catalog.__all__) <= set(dir(catalog))
