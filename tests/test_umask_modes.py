"""What the framework writes takes the modes the user's umask gives (issue 43 item 6): an export,
a weights file or a config written atomically is as readable to the user's group as a file that
`open` or `mkdir` would make, not mkstemp's 0600 or mkdtemp's 0700 (unreadable to the rest of a
group on a shared file system)."""

from __future__ import annotations

import os

import pytest

from data.atomic import atomic_write_text, staging_dir
from tests.runs import config


@pytest.fixture
def umask_027():
    """A group-readable, world-private umask, so that 0600 and 0700 would both show."""
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_atomic_files_and_staging_directories_follow_the_umask(tmp_path, umask_027):
    atomic_write_text(tmp_path / "weights.json", "{}")
    assert (tmp_path / "weights.json").stat().st_mode & 0o777 == 0o640
    assert staging_dir(tmp_path, "export-").stat().st_mode & 0o777 == 0o750


def test_an_export_is_readable_as_the_umask_says(stores, tmp_path, umask_027):
    from doremi.commands.hf import export
    from doremi.pipeline import stages

    run = tmp_path / "run"
    stages.train(config(stores, run, "train.steps=1"))
    out = tmp_path / "hf"
    files = export(run, out, with_tokenizer=False)
    assert out.stat().st_mode & 0o777 == 0o750
    written = sorted(p for p in out.rglob("*") if p.is_file())
    assert written and {p.name for p in written} >= {"config.json", "model.safetensors"}, files
    assert {p.name: p.stat().st_mode & 0o777 for p in written} == {p.name: 0o640 for p in written}
