"""Every command and snippet in the READMEs runs as written.

The convention (root README, "Contributing"): each fenced ```bash block runs through ``bash -e``
from the README's folder, with this environment's ``mx-refit`` first on PATH; each fenced
```python block runs in a fresh interpreter. A block that cannot run here is preceded by
``<!-- mx-refit: not-run: <why> -->``. Other fences are documentation only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN_LANGS = ("bash", "python")
NOT_RUN = re.compile(r"<!--\s*mx-refit:\s*not-run:\s*(?P<why>.+?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    readme: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.readme.relative_to(REPO)}:{self.line}"


def readmes() -> list[Path]:
    skip = {".git", "node_modules", ".venv", "build"}
    return sorted(p for p in REPO.rglob("README.md") if not skip & set(p.relative_to(REPO).parts))


def blocks(readme: Path) -> list[Block]:
    found: list[Block] = []
    lines = readme.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{readme}:{i + 1}: unclosed code fence"
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.search(previous)
        found.append(Block(readme, i + 1, opening["lang"], "\n".join(lines[i + 1 : end]) + "\n",
                           marker["why"] if marker else None))
        i = end + 1
    return found


ALL = [block for readme in readmes() for block in blocks(readme)]
RUNNABLE = [block for block in ALL if block.lang in RUN_LANGS and block.not_run is None]


def test_the_convention_holds():
    assert ALL, "no README code blocks found"
    for block in ALL:
        if block.not_run is not None:
            assert block.lang in RUN_LANGS, f"{block.id}: only bash/python blocks are run; the marker is noise"
            assert len(block.not_run) > 10, f"{block.id}: say why the block cannot run"
    assert any(b.readme == REPO / "README.md" for b in RUNNABLE), "the root README runs nothing"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # The snippets import this checkout's packages, as an installed copy would provide them.
    paths = [str(REPO / "core" / "src"), *map(str, sorted(REPO.glob("plugins/*/src")))]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_readme_block_runs_as_written(block: Block):
    if block.lang == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    else:
        argv = [sys.executable, "-c", block.code]
    out = subprocess.run(argv, cwd=block.readme.parent, env=_env(), capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, f"{block.id} failed ({out.returncode}):\n{block.code}\n--- stdout\n{out.stdout[-3000:]}" \
                                f"\n--- stderr\n{out.stderr[-3000:]}"
