"""The declared dependencies match the imports: every third-party module the package imports is
declared in pyproject.toml (the core list, or an extra for an optional import), and every core
dependency is imported somewhere (none installed for nothing)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("doremi", "trainer", "data")
#: Optional extras that need not be installed for the suite (GPU kernels), by import name.
NOT_INSTALLED = {
    "flash_attn": "flash-attn",
    "mamba_ssm": "mamba-ssm",
    "causal_conv1d": "causal-conv1d",
    "torchao": "torchao",
}
#: Imports that need a distribution other than the module's own.
IMPLIED = {"torch.utils.tensorboard": "tensorboard"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def imported_modules() -> set[str]:
    out = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    out |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    out.add(node.module)
    return out


def distributions(modules: set[str]) -> dict[str, str]:
    """Third-party module -> its distribution's normalised name."""
    known = packages_distributions()
    out = {}
    for module in modules:
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top in PACKAGES or top == "__future__":
            continue
        if module in IMPLIED:
            out[module] = IMPLIED[module]
        elif top in NOT_INSTALLED:
            out[top] = NOT_INSTALLED[top]
        else:
            assert top in known, f"{top}: imported but not installed, and not in NOT_INSTALLED"
            out[top] = _name(known[top][0])
    return out


def test_declared_dependencies_match_the_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    used = distributions(imported_modules())
    undeclared = sorted(f"{m} ({d})" for m, d in used.items() if d not in core | extras)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = sorted(core - set(used.values()))
    assert not unused, f"core dependencies nothing imports: {unused}"
