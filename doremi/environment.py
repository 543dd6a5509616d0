"""What produced a result: the project's version and commit, and the versions of the packages
that change numbers. `doremi --version` prints it; a pipeline root records it with its command
line and resolved config, so that a table found months later names the code that made it."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

PROJECT = "doremi-mix"
#: The packages whose version can change a number or a file this framework writes.
PACKAGES = ("torch", "numpy", "scipy", "tokenizers", "datasets", "transformers", "safetensors", "triton")
ROOT = Path(__file__).resolve().parents[1]


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def project_commit(root: Path = ROOT) -> str | None:
    """The checkout's commit, `+dirty` when tracked files differ from it; None outside a git
    checkout (an installed wheel) or without git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def environment() -> dict[str, Any]:
    """{project version, commit, python, every installed package of PACKAGES by version}."""
    return {
        PROJECT: package_version(PROJECT),
        "commit": project_commit(),
        "python": platform.python_version(),
        **{p: v for p in PACKAGES if (v := package_version(p)) is not None},
    }


def version_line() -> str:
    env = environment()
    commit = env.pop("commit")
    head = f"doremi {env.pop(PROJECT) or 'unknown'}" + (f" (commit {commit})" if commit else "")
    return head + "; " + ", ".join(f"{k} {v}" for k, v in env.items())
