"""The developer guide's size limits, held by reading the sources: modules of the core under 600
lines (generated code aside), and functions under 80 lines in the packages that meet it so far
(``FUNCTION_LIMITED``; a package joins once its long functions are cut)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "src" / "mx_refit"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
FUNCTION_LIMITED = ("catalog", "receive")


def _sources() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if "catalog/v1" not in p.as_posix())


def test_no_core_module_is_over_600_lines() -> None:
    long = {p.relative_to(CORE).as_posix(): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_80_lines() -> None:
    checked, long = 0, {}
    for path in _sources():
        rel = path.relative_to(CORE).as_posix()
        if not rel.startswith(tuple(f"{package}/" for package in FUNCTION_LIMITED)):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                checked += 1
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long[f"{rel}:{node.lineno} {node.name}"] = lines
    assert checked > 100  # the walk sees the packages' functions
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
