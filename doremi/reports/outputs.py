"""A report command's files in the folder a user names: replaced only where this framework wrote them.

`doremi compare`, `doremi study calibrate`, `summarize` and `compare-methods` write files of fixed
names (`study.md`, `calibration.json`, ...) into any `--out` folder, often one that holds other
things (experiments/results/doremi_study holds the calibration, the study's archive and its
notes). Without a mark of their own, a second run could not tell its earlier output from a
researcher's file of the same name and would overwrite either. Each file says who wrote it, in
its own format so that it stays an ordinary file:
- Markdown: a first line `<!-- written by doremi ... -->` (invisible when rendered);
- JSON: a top-level `written_by` key;
- PNG: the `Software` text chunk (matplotlib's `metadata`);
- any other text (the YAML `doremi import --out` writes): a first line `# doremi ...`.
`check_outputs` runs before a command computes or writes anything (docs/design.md section 6b,
deleting only our own: the artifacts' headers do the same for directories).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from data.artifact import ArtifactError

WRITTEN_BY = "written_by"
_MD_MARK = "<!-- written by "
_PNG_MARK = b"Software\x00doremi "
_COMMENT_MARK = b"# doremi "


def md_mark(command: str) -> str:
    """The first line of a Markdown report written by `command` (`doremi ...`)."""
    return f"{_MD_MARK}{command} -->\n"


def png_metadata(command: str) -> dict[str, str]:
    """matplotlib `savefig(metadata=...)` for a PNG written by `command`."""
    return {"Software": command}


def is_ours(path: Path) -> bool:
    """Whether `path` is a report file this framework wrote (by its mark)."""
    if not path.is_file():
        return False
    if path.suffix == ".md":
        with path.open("rb") as f:
            return f.readline().startswith((_MD_MARK + "doremi ").encode())
    if path.suffix == ".json":
        try:
            doc = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            return False
        return isinstance(doc, dict) and str(doc.get(WRITTEN_BY, "")).startswith("doremi ")
    if path.suffix == ".png":
        with path.open("rb") as f:
            return _PNG_MARK in f.read(1 << 16)
    with path.open("rb") as f:
        return f.readline().startswith(_COMMENT_MARK)


def check_outputs(out: Path, names: Iterable[str], command: str) -> None:
    """Refuse, before anything is written, an `out` that is not a folder or that holds one of
    `names` not written by this framework (one line naming it)."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out}: not a directory; `{command} --out` takes a folder")
    for name in names:
        p = out / name
        if p.exists() and not is_ours(p):
            raise ArtifactError(
                f"{p}: exists and was not written by doremi; `{command}` replaces only its own {name}: "
                f"choose another --out"
            )
