"""Which code wrote an artifact: a digest of the framework's own sources, the git commit where
there is one, and the torch version (docs/design.md section 6b).

A run made in one session and resumed in another, or a study whose seeds ran over eleven sessions
of a changing tree, is only as trustworthy as the knowledge of what code made each piece. A git
commit alone does not say it: the GPU machine runs a `git archive` without `.git`, and a working
tree may hold uncommitted changes. So the identity is the XXH3-64 of every Python source of the
framework's packages (path and bytes, in path order): equal digests, equal code. The commit is
added where a `.git` beside the packages names one (read from its files, no subprocess), as a
convenience for finding the tree again.
"""

from __future__ import annotations

import functools
from importlib import metadata
from pathlib import Path
from typing import Any

import xxhash

#: The packages whose sources make up the framework (the import layers, lowest first).
PACKAGES = ("data", "trainer", "doremi")


def sources_digest(root: Path, packages: tuple[str, ...] = PACKAGES) -> str:
    """XXH3-64 over each `*.py` under `root/<package>` (its path relative to `root`, a NUL, its
    bytes, a NUL), in sorted path order; caches (`__pycache__`) are not sources."""
    h = xxhash.xxh3_64()
    files = sorted(
        p for pkg in packages for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.relative_to(root).parts
    )
    for path in files:
        h.update(path.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def git_commit(root: Path) -> str | None:
    """The commit `root/.git` has checked out (a worktree's `.git` file followed), or None: no
    repository, a detached or unborn head it cannot resolve, anything unreadable."""
    try:
        git = root / ".git"
        if git.is_file():
            git = (root / git.read_text().split("gitdir:", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or None
        ref = head.split(":", 1)[1].strip()
        common = git
        if (git / "commondir").is_file():
            common = (git / (git / "commondir").read_text().strip()).resolve()
        for base in (git, common):
            if (base / ref).is_file():
                return (base / ref).read_text().strip() or None
        for line in (common / "packed-refs").read_text().splitlines():
            sha, _, name = line.partition(" ")
            if name == ref:
                return sha
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    return None


def _torch_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def code_identity() -> dict[str, Any]:
    """This process's code: `{"sources": digest, "commit": sha or None, "torch": version}`,
    computed once per process (about 4 MB of sources, a few milliseconds)."""
    root = Path(__file__).resolve().parent.parent
    return {"sources": sources_digest(root), "commit": git_commit(root), "torch": _torch_version()}
