"""The suite's own machinery (docs/design.md section 8, experiments/notes/SUITE.md): gloo ranks
forked from a preloaded forkserver still see the test's environment and working directory, the
slow files named in tests/conftest.py exist, and importing the trainer leaves torch's dynamo
unimported (it cost every rank and CLI call about 1.5 s of CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from tests.conftest import SLOW
from tests.distributed import spawn

ROOT = Path(__file__).resolve().parents[1]


def _sees(rank: int, world: int, probe: str, cwd: str) -> None:
    assert os.environ.get("DOREMI_SUITE_PROBE") == probe and os.getcwd() == cwd
    assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(world)
    dist.barrier()  # no rank leaves while another is still connecting to it


def test_ranks_see_the_tests_environment_and_directory(monkeypatch, tmp_path):
    """The forkserver keeps the environment it started with: each rank takes the test's own."""
    monkeypatch.setenv("DOREMI_SUITE_PROBE", "first")
    spawn(_sees, 2, "first", os.getcwd())
    monkeypatch.setenv("DOREMI_SUITE_PROBE", "second")
    monkeypatch.chdir(tmp_path)
    spawn(_sees, 2, "second", str(tmp_path))


def test_every_slow_file_exists():
    assert sorted(n for n in SLOW if not (ROOT / "tests" / n).is_file()) == []
    assert len(set(SLOW)) == len(SLOW)


def test_importing_the_trainer_and_the_cli_does_not_import_dynamo():
    code = "import sys, doremi.commands.cli, doremi.pipeline.stages; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
