"""Plugin loading: lazy and once, allow-list, block-list, loud failures, and hook coverage."""

from __future__ import annotations

import importlib.metadata
import inspect
import pathlib
import subprocess
import sys

import pluggy
import pytest

from mx_refit import hookspecs
from mx_refit.plugins import BUILTIN_PLUGINS, ENTRY_POINT_GROUP, Hooks, PluginLoadError, get_plugin_manager
from mx_refit.types import TargetLayout

TESTS = pathlib.Path(__file__).parent


def _entry_points(*pairs: tuple[str, str]):
    eps = [importlib.metadata.EntryPoint(name=n, value=v, group=ENTRY_POINT_GROUP) for n, v in pairs]

    def fake(*, group: str):
        return [ep for ep in eps if ep.group == group]

    return fake


@pytest.fixture
def installed(monkeypatch):
    """Pretend these distributions are installed: the modules are real, only discovery is faked."""

    def install(*pairs: tuple[str, str]) -> None:
        monkeypatch.setattr(importlib.metadata, "entry_points", _entry_points(*pairs))

    monkeypatch.delenv("MX_REFIT_PLUGINS", raising=False)
    monkeypatch.delenv("MX_REFIT_DISABLE_PLUGINS", raising=False)
    return install


def test_factory_has_specs_and_no_plugins():
    pm = get_plugin_manager()
    assert pm.get_plugins() == set()
    assert {name for name in dir(pm.hook) if name.startswith("mx_refit_")} == _spec_names()


def test_loading_is_lazy_and_happens_once(installed):
    installed(("good", "tests.plugin_samples.good"))
    hooks = Hooks()
    assert hooks._pm is None  # nothing loaded before the first hook call
    pm = hooks.pm
    assert pm is hooks.pm
    names = {pm.get_name(p) for p in pm.get_plugins()}
    assert names == {*BUILTIN_PLUGINS, "good"}
    assert hooks.target_layout({"tp": (1, 2)}) == TargetLayout(tp_rank=1, tp_size=2, full_tensors=False)
    assert hooks.target_layout(object()) == TargetLayout()


def test_allow_list_loads_only_named_plugins(installed, monkeypatch):
    installed(("good", "tests.plugin_samples.good"), ("broken", "tests.plugin_samples.broken"))
    monkeypatch.setenv("MX_REFIT_PLUGINS", "good")
    pm = Hooks().pm
    assert pm.get_plugin("good") is not None
    assert pm.get_plugin("broken") is None


def test_allow_listed_plugin_that_fails_to_import_fails_loudly(installed, monkeypatch):
    installed(("broken", "tests.plugin_samples.broken"))
    monkeypatch.setenv("MX_REFIT_PLUGINS", "broken")
    with pytest.raises(PluginLoadError, match="'broken'.*mx_refit_this_dependency_does_not_exist"):
        Hooks().pm


def test_allow_listed_plugin_that_is_not_installed_fails_loudly(installed, monkeypatch):
    installed(("good", "tests.plugin_samples.good"))
    monkeypatch.setenv("MX_REFIT_PLUGINS", "good, missing")
    with pytest.raises(PluginLoadError, match=r"\['missing'\].*installed: \['good'\]"):
        Hooks().pm


def test_autoloaded_broken_plugin_is_skipped_with_a_warning(installed):
    installed(("good", "tests.plugin_samples.good"), ("broken", "tests.plugin_samples.broken"))
    with pytest.warns(RuntimeWarning, match="'broken'.*skipped"):
        pm = Hooks().pm
    assert pm.get_plugin("good") is not None and pm.get_plugin("broken") is None


def test_block_list_wins_for_entry_points_and_builtins(installed, monkeypatch):
    installed(("good", "tests.plugin_samples.good"))
    monkeypatch.setenv("MX_REFIT_PLUGINS", "good")
    monkeypatch.setenv("MX_REFIT_DISABLE_PLUGINS", "good,mx_refit.megatron.plugin")
    pm = Hooks().pm
    assert pm.get_plugin("good") is None and pm.is_blocked("good")
    assert pm.get_plugin("mx_refit.megatron.plugin") is None
    assert pm.get_plugin("mx_refit.builtin") is not None


def test_misspelled_hookimpl_is_rejected_at_load(installed):
    installed(("typo", "tests.plugin_samples.misspelled"))
    with pytest.raises(pluggy.PluginValidationError, match="mx_refit_colect_tensors"):
        Hooks().pm


def test_facade_covers_every_hook():
    facade = {name for name, _ in inspect.getmembers(Hooks, inspect.isfunction)}
    for spec in _spec_names():
        method = spec.removeprefix("mx_refit_")
        assert method in facade, f"Hooks has no typed method for {spec}"


def _spec_names() -> set[str]:
    return {name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("mx_refit_")}


@pytest.mark.parametrize("spec", sorted(_spec_names()))
def test_every_hook_has_a_test(spec):
    sources = "\n".join(p.read_text() for p in TESTS.rglob("test_*.py"))
    assert f"def test_hook_{spec}(" in sources, f"hook {spec} has no test named test_hook_{spec}"


@pytest.mark.parametrize("spec", sorted(_spec_names()))
def test_every_hook_is_documented(spec):
    doc = getattr(hookspecs, spec).__doc__ or ""
    assert ":param" in doc or "Called" in doc, f"{spec} lacks a real docstring"
    assert spec in (TESTS.parent / "README.md").read_text(), f"{spec} missing from README's hook table"


def test_import_is_light():
    """`import mx_refit` (and loading the built-in plugins) must not import heavy frameworks."""
    heavy = ["torch", "nixl", "grpc", "vllm", "megatron", "transformers", "google.protobuf"]
    code = (
        "import sys\n"
        f"for m in {heavy!r}: sys.modules[m] = None\n"
        "import mx_refit, mx_refit.hookspecs, mx_refit.plugins, mx_refit.catalog, mx_refit.transport\n"
        "import mx_refit.config, mx_refit.layout, mx_refit.megatron, mx_refit.verify\n"
        "from mx_refit.plugins import Hooks\n"
        "Hooks().pm\n"
        "from mx_refit import BridgedModel, Hooks, Publisher, Receiver, is_publishing_rank, load_config\n"
        "from mx_refit import mesh_position, shared_transport\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_empty_allow_list_loads_no_third_party_plugin(installed, monkeypatch):
    installed(("good", "tests.plugin_samples.good"))
    monkeypatch.setenv("MX_REFIT_PLUGINS", "")
    names = {entry["name"] for entry in Hooks().describe()}
    assert names == set(BUILTIN_PLUGINS)  # llm and vLLM read an empty list the same way


def test_a_config_allow_list_applies_unless_the_environment_sets_one(installed, monkeypatch):
    installed(("good", "tests.plugin_samples.good"), ("broken", "tests.plugin_samples.broken"))
    listing = Hooks(allow=["good"]).describe()  # a recipe's weight_sync.plugins
    good = next(entry for entry in listing if entry["name"] == "good")
    assert good["hooks"] and all(hook.startswith("mx_refit_") for hook in good["hooks"])
    assert "broken" not in {entry["name"] for entry in listing}
    with pytest.raises(PluginLoadError, match=r"weight_sync.plugins names \['nope'\]"):
        Hooks(allow=["nope"]).pm
    monkeypatch.setenv("MX_REFIT_PLUGINS", "")  # the operator's word wins: none
    assert {entry["name"] for entry in Hooks(allow=["good"]).describe()} == set(BUILTIN_PLUGINS)
