"""The import rules of docs/design.md ("Import rules"), held by reading every module's imports
(module level, inside functions and under TYPE_CHECKING alike: a lazy import is still an arrow)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "src"
PLUGIN_SRCS = sorted(p for p in (ROOT / "plugins").glob("*/src") if p.is_dir())
# What a plugin may import from mx-refit: the front door.
FRONT_DOOR = {"mx_refit", "mx_refit.hookspecs", "mx_refit.types", "mx_refit.errors", "mx_refit.config"}
# What the pure receive planner may import besides itself.
# mx_refit.copies: the batched device-copy kernel (torch/triton only, no catalog or transport)
LAYOUT_MAY_IMPORT = {"mx_refit.types", "mx_refit.errors", "mx_refit.plan", "mx_refit.ranges", "mx_refit.copies"}
# What sits above the receive side (it builds on receive/; receive/ never imports it).
ABOVE_RECEIVE = ("mx_refit.publisher", "mx_refit.megatron", "mx_refit.verify", "mx_refit.demo", "mx_refit.cli",
                 "mx_refit.testing")


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules(base: Path) -> dict[str, Path]:
    return {
        _module_name(p, base): p
        for p in base.rglob("*.py")
        if "catalog/v1" not in p.as_posix()  # generated protobuf code
    }


def _imports(path: Path, name: str, known: frozenset[str] = frozenset()) -> set[str]:
    """Every module ``path`` imports (``from pkg import sub`` counts as ``pkg.sub`` when that is
    a module in ``known``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            subs = {f"{module}.{alias.name}" for alias in node.names} & known
            found.update(subs or {module})
    return found


@cache
def _core_graph() -> dict[str, set[str]]:
    modules = _modules(CORE)
    known = frozenset(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(sources: list[str], rule) -> list[str]:
    graph = _core_graph()
    return sorted(f"{src} imports {dst}" for src in sources for dst in graph[src] if rule(dst))


def test_the_rules_see_the_whole_core():
    graph = _core_graph()
    assert {"mx_refit.layout.planner", "mx_refit.megatron.classify", "mx_refit.catalog.service",
            "mx_refit.transport.nixl", "mx_refit.verify.tool", "mx_refit.overrides"} <= set(graph)
    assert "mx_refit.ranges" in graph["mx_refit.layout.placement"]  # the walker finds real arrows


def test_layout_is_pure():
    """layout/ imports neither catalog, transport nor megatron: only types, errors, plan, ranges."""
    layout = [m for m in _core_graph() if _under(m, "mx_refit.layout")]
    assert len(layout) >= 5
    bad = _violations(layout, lambda dst: _under(dst, "mx_refit") and not _under(dst, "mx_refit.layout")
                      and dst not in LAYOUT_MAY_IMPORT)
    assert not bad, bad


def test_receive_imports_nothing_above_it():
    """receive/ builds on catalog/, transport/, plan and the kernel; never on the front door, the
    publisher, megatron/ or the tools."""
    receive = [m for m in _core_graph() if _under(m, "mx_refit.receive")]
    assert {"mx_refit.receive.receiver", "mx_refit.receive.cycle", "mx_refit.receive.lease"} <= set(receive)
    bad = _violations(receive, lambda dst: dst == "mx_refit" or any(_under(dst, top) for top in ABOVE_RECEIVE))
    assert not bad, bad


def test_only_the_front_door_and_the_tools_import_receive():
    """The receive side is reached through ``mx_refit.Receiver`` (the package root) and by the
    tools (demo, cli, verify, testing); no other part of the core reaches into it."""
    outside = [m for m in _core_graph() if not _under(m, "mx_refit.receive")]
    allowed = ("mx_refit.demo", "mx_refit.cli", "mx_refit.verify", "mx_refit.testing")
    bad = _violations(
        [m for m in outside if m != "mx_refit" and not any(_under(m, top) for top in allowed)],
        lambda dst: _under(dst, "mx_refit.receive"),
    )
    assert not bad, bad
    assert "mx_refit.receive.receiver" in _core_graph()["mx_refit"]  # the walker sees the front door's arrow


def test_catalog_never_imports_transport():
    catalog = [m for m in _core_graph() if _under(m, "mx_refit.catalog")]
    bad = _violations(catalog, lambda dst: _under(dst, "mx_refit.transport"))
    assert not bad, bad


def test_overrides_import_neither_plugins_nor_the_classifier():
    bad = _violations(["mx_refit.overrides"], lambda dst: _under(dst, "mx_refit") and dst not in
                      {"mx_refit.errors", "mx_refit.types"})
    assert not bad, bad


def test_the_core_never_imports_a_plugin():
    plugin_packages = {p.name for src in PLUGIN_SRCS for p in src.iterdir() if (p / "__init__.py").exists()}
    assert "mx_refit_vllm" in plugin_packages
    bad = _violations(list(_core_graph()), lambda dst: dst.split(".")[0] in plugin_packages)
    assert not bad, bad


@pytest.mark.parametrize("src", PLUGIN_SRCS, ids=lambda p: p.parent.name)
def test_plugins_use_only_the_front_door(src):
    core_modules = frozenset(_modules(CORE))
    bad = []
    for name, path in _modules(src).items():
        for dst in _imports(path, name, core_modules):
            if _under(dst, "mx_refit") and dst not in FRONT_DOOR:
                bad.append(f"{path.relative_to(ROOT)} imports {dst}")
    assert not bad, "plugins may import only " + ", ".join(sorted(FRONT_DOOR)) + ":\n" + "\n".join(bad)


def test_no_import_cycle_among_core_modules():
    graph = {m: {d for d in deps if d in _core_graph()} for m, deps in _core_graph().items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(cycles)
