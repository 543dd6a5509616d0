"""Loading the scripts under experiments/ in tests: they are files, not a package, so a test
imports them by path (one owner for the import dance the bench and tool tests all need)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from tests.paths import ROOT

BENCH = ROOT / "experiments" / "tools" / "bench"


def load_script(path: Path, name: str) -> ModuleType:
    """The script at `path` as module `name`, registered in sys.modules so that its dataclasses
    and pickles resolve their module."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def bench_module(name: str) -> ModuleType:
    """experiments/tools/bench/`name`.py, imported with the bench folder on sys.path only while
    it imports (the benches import their siblings, e.g. `timing`, by plain name)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
