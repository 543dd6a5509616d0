"""Every project file a page or a docstring names exists: a reader who follows `doremi/x.py`
from docs/design.md or a module's docstring lands on a file, after any move of the tree."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: A path under one of the project's top folders, ending in a file suffix we write.
PATH = re.compile(r"(?<![\w/.-])((?:data|trainer|doremi|experiments|tests|docs|\.ci)/[\w./-]*\w\.(?:py|md|yaml|sh))")

#: Files of other repositories that our text cites by their own paths (with repository and commit).
EXTERNAL = {"trainer/aioli_trainer.py"}  # HazyResearch/aioli a236112


def _readers_text() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return pages + [p for pkg in ("data", "trainer", "doremi") for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_every_named_project_file_exists():
    missing = sorted(
        f"{path.relative_to(ROOT)}: {m.group(1)}"
        for path in _readers_text()
        for m in PATH.finditer(path.read_text())
        if m.group(1) not in EXTERNAL and not (ROOT / m.group(1)).exists()
    )
    assert missing == []
