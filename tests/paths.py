"""The repository's paths that tests read: its root (subprocesses run there, docs and configs
are found from it) and the quickstart config the end-to-end tests shrink, one owner for what
each test file used to compute from its own `__file__`."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "configs" / "quickstart.yaml"
