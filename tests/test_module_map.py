"""docs/design.md's module map names every module and package of the core, and nothing else.

The map is the first fenced block under ``core/src/mx_refit/``: one entry per line, its path
relative to that folder (``catalog/service.py``; a package as its folder, ``catalog/``, which
stands for its ``__init__.py``), then its description; continuation lines start with blanks
only. Generated code (``catalog/v1/``) is listed as its folder alone.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "src" / "mx_refit"
DESIGN = ROOT / "docs" / "design.md"
GENERATED = ("catalog/v1/",)
ENTRY = re.compile(r"^  (\S+)(?:\s|$)")  # two blanks, the path; deeper lines continue an entry


def _map_entries() -> list[str]:
    text = DESIGN.read_text()
    start = text.index("```\ncore/src/mx_refit/\n") + len("```\ncore/src/mx_refit/\n")
    block = text[start:text.index("```", start)]
    return [m.group(1) for line in block.splitlines() if (m := ENTRY.match(line))]


def _core_paths() -> set[str]:
    """Every module (``a/b.py``) and package (``a/``) of the core, generated code aside."""
    paths = set()
    for path in CORE.rglob("*.py"):
        rel = path.relative_to(CORE).as_posix()
        if rel.startswith(GENERATED):
            continue
        if path.name == "__init__.py":
            rel = rel.removesuffix("__init__.py")  # the package, as its folder
            if not rel:
                rel = "__init__.py"  # the root package: the front door
        paths.add(rel)
    return paths


def test_the_map_parses() -> None:
    entries = _map_entries()
    assert {"__init__.py", "catalog/", "catalog/service.py", "layout/planner.py"} <= set(entries)
    assert len(entries) == len(set(entries)), sorted(e for e in entries if entries.count(e) > 1)


def test_every_core_module_is_on_the_map() -> None:
    missing = sorted(_core_paths() - set(_map_entries()))
    assert not missing, f"docs/design.md's module map lacks {missing}: give each a line there"


def test_the_map_names_only_modules_that_exist() -> None:
    stale = sorted(set(_map_entries()) - _core_paths() - set(GENERATED))
    assert not stale, f"docs/design.md's module map names {stale}, which are not in core/src/mx_refit"
