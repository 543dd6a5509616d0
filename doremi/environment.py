"""What produced a result: the project's version, commit and sources digest, and the versions of
the packages that change numbers. `doremi --version` prints it; a pipeline root records it with its command
line and resolved config, so that a table found months later names the code that made it."""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any

from data.code_identity import code_identity

PROJECT = "doremi-mix"
#: The packages whose version can change a number or a file this framework writes.
PACKAGES = ("torch", "numpy", "scipy", "tokenizers", "datasets", "transformers", "safetensors", "triton")


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """{project version, commit, sources digest (data/code_identity.py, the one owner of which
    code this is), python, every installed package of PACKAGES by version}."""
    code = code_identity()
    return {
        PROJECT: package_version(PROJECT),
        "commit": code["commit"],
        "sources": code["sources"],
        "python": platform.python_version(),
        **{p: v for p in PACKAGES if (v := package_version(p)) is not None},
    }


def version_line() -> str:
    env = environment()
    commit, sources = env.pop("commit"), env.pop("sources")
    head = (
        f"doremi {env.pop(PROJECT) or 'unknown'} (" + (f"commit {commit}, " if commit else "") + f"sources {sources})"
    )
    return head + "; " + ", ".join(f"{k} {v}" for k, v in env.items())
