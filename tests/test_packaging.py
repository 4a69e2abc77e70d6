"""The built wheel, installed into a fresh venv with only its base dependencies (+ the `recipes`
extra), as a user's `pip install` leaves it: no torch, no NIXL, no Megatron.

It must give clear one-line messages naming the extra to install, never a hang or a traceback;
the recipes load from the installed package; the catalog server runs on the base dependencies.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
QUICK_S = 60


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A venv holding the wheel built from this checkout and its declared base deps."""
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    # Built from a copy: setuptools leaves build/ and *.egg-info next to the sources it builds.
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("mx_refit-*.whl")
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{wheel}[recipes]"],
        capture_output=True, text=True, timeout=600, env=_clean_env(),
    )
    assert install.returncode == 0, install.stderr[-3000:]
    return env_dir


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH: the venv must see only what pip installed into it."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MX_REFIT_CORE_PYTHON")}


def run(env_dir: Path, *argv: str, timeout: float = QUICK_S) -> subprocess.CompletedProcess:
    return subprocess.run([str(env_dir / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=timeout, env=_clean_env(), cwd=env_dir)


@pytest.mark.timeout(900)
def test_the_wheel_without_torch_gives_clear_messages(wheel_venv, tmp_path):
    from mx_refit import __version__

    listing = run(wheel_venv, "python", "-m", "pip", "list", "--format=json")
    installed = {entry["name"].lower().replace("_", "-") for entry in json.loads(listing.stdout)}
    assert "mx-refit" in installed and "torch" not in installed and not any(n.startswith("nixl") for n in installed)

    version = run(wheel_venv, "mx-refit", "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"mx-refit {__version__}"

    demo = run(wheel_venv, "mx-refit", "demo", "--json")
    assert demo.returncode == 3 and demo.stdout == "", demo.stderr
    assert demo.stderr.strip().splitlines() == [
        "mx-refit: error: torch is not installed (needed to publish and receive tensors); install `mx-refit[transport]`"
    ]

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4}))
    (ckpt / "model.safetensors").write_bytes(b"")
    verify = run(wheel_venv, "mx-refit", "verify", "--hf-dir", str(ckpt), "--json")
    assert verify.returncode == 3 and "install `mx-refit[transport]`" in verify.stderr, verify.stderr
    assert len(verify.stderr.strip().splitlines()) == 1

    library = run(wheel_venv, "python", "-c",
                  "from mx_refit.transport.nixl import NixlTransport\n"
                  "try:\n    NixlTransport('probe')\n"
                  "except ImportError as exc:\n    print(exc)\n")
    assert library.returncode == 0, library.stderr
    assert "install `mx-refit[transport]`" in library.stdout


@pytest.mark.timeout(900)
def test_the_wheel_ships_the_recipes_and_serves_the_catalog(wheel_venv):
    recipe = run(wheel_venv, "python", "-c",
                 "import mx_refit.config as c, sysconfig\n"
                 "assert str(c.RECIPES_DIR).startswith(sysconfig.get_paths()['purelib']), c.RECIPES_DIR\n"
                 "cfg = c.load_recipe('grpo-llama-8b-megatron-tp2-vllm-tp1')\n"
                 "import mx_refit, pathlib\n"
                 "pkg = pathlib.Path(mx_refit.__file__).parent\n"
                 "assert (pkg / 'py.typed').exists() and (pkg / 'catalog/v1/catalog.proto').exists()\n"
                 "print(cfg.model_name)\n")
    assert recipe.returncode == 0, recipe.stderr
    assert recipe.stdout.strip() == "llama-8b"

    serve = subprocess.Popen([str(wheel_venv / "bin" / "mx-refit"), "serve", "--port", "0", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=wheel_venv, env=_clean_env())
    try:
        info = json.loads(serve.stdout.readline())
        assert info["port"] > 0 and info["health"] == "grpc.health.v1.Health"
    finally:
        serve.terminate()
        _, err = serve.communicate(timeout=30)
    assert serve.returncode == 0, err


@pytest.mark.timeout(900)
def test_the_wheel_installs_and_serves_beside_protobuf_6(wheel_venv):
    """Beside ModelExpress, which needs protobuf<7: pip resolves the wheel with protobuf 6.31.1
    (an older grpcio-health-checking), and the generated code loads and serves on it. Runs last:
    it moves the module's venv to protobuf 6."""
    (wheel,) = (wheel_venv.parent / "dist").glob("mx_refit-*.whl")
    install = run(wheel_venv, "python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
                  str(wheel), "protobuf==6.31.1", timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    versions = run(wheel_venv, "python", "-c",
                   "import importlib.metadata as m\n"
                   "print(m.version('protobuf'), m.version('grpcio-health-checking'))\n")
    protobuf, health = versions.stdout.split()
    assert protobuf == "6.31.1" and tuple(map(int, health.split(".")[:2])) < (1, 82), versions.stdout
    serve = subprocess.Popen([str(wheel_venv / "bin" / "mx-refit"), "serve", "--port", "0", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=wheel_venv, env=_clean_env())
    try:
        info = json.loads(serve.stdout.readline())
        client = run(wheel_venv, "python", "-c",
                     "from mx_refit.catalog import CatalogClient\n"
                     f"print(CatalogClient('127.0.0.1:{info['port']}').list_versions('m'))\n")
        assert client.returncode == 0 and client.stdout.strip() == "[]", client.stderr[-2000:]
    finally:
        serve.terminate()
        _, err = serve.communicate(timeout=30)
    assert serve.returncode == 0, err


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plugin", ["vllm_engine", "nemo_rl", "dynamo"])
def test_every_plugin_wheel_ships_the_license(plugin, tmp_path):
    """Each plugin distribution carries the Apache-2.0 text (PEP 639 license-files), not only a tag."""
    import zipfile

    repo = Path(__file__).resolve().parents[1]
    # A copy: an in-tree build leaves build/ and an .egg-info beside the editable install's sources.
    source = tmp_path / plugin
    shutil.copytree(repo / "plugins" / plugin, source,
                    ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__", ".*_cache"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          str(source), "-w", str(tmp_path / "wheel")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        licenses = [name for name in archive.namelist() if name.endswith(".dist-info/licenses/LICENSE")]
        assert len(licenses) == 1, archive.namelist()
        assert archive.read(licenses[0]) == (repo / "LICENSE").read_bytes()
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in archive.read(metadata).decode()
