"""Run a script of Triton kernel checks on the CPU under Triton's interpreter (TRITON_INTERPRET=1
is read when a kernel is built, so each script runs in its own process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Triton wheels exist for Linux x86-64 only.
needs_triton = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64", reason="Triton wheels exist for Linux x86-64 only"
)


def run_interpreted(script: str) -> None:
    """Run `script` (which prints "ok" last) with the repository importable; fail with its stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
