"""`make install` follows TORCH_SPEC: a changed spec reinstalls torch (pip alone keeps an
installed torch that satisfies the new spec), an unchanged one installs nothing again. Run
against a fake venv whose `python` records its arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_venv(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("needs make")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    py.chmod(0o755)
    return venv, log


def make_install(venv: Path, spec: str) -> None:
    subprocess.run(
        ["make", "-s", "-C", str(ROOT), "install", f"VENV={venv}", f"TORCH_SPEC={spec}"],
        check=True,
        capture_output=True,
        env={**os.environ, "MAKEFLAGS": ""},
    )


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_a_changed_torch_spec_reinstalls_torch_and_an_unchanged_one_does_nothing(fake_venv):
    venv, log = fake_venv
    make_install(venv, "torch==2.13.0")
    first = calls(log)
    assert "-m pip install -q --force-reinstall --no-deps torch==2.13.0" in first
    assert "-m pip install -q -e .[test]" in first
    assert (venv / ".torch-spec").read_text().strip() == "torch==2.13.0"

    log.unlink()
    make_install(venv, "torch==2.13.0")
    assert calls(log) == []

    make_install(venv, "torch")
    again = calls(log)
    assert "-m pip install -q --force-reinstall --no-deps torch" in again
    assert "-m pip install -q -e .[test]" in again
    assert (venv / ".torch-spec").read_text().strip() == "torch"
