"""The study launcher's records (experiments/launch/doremi_study.py): each call's launch record,
log and stores manifest inside the archive the next session unpacks, per session with
`--session`, so that no session's records overwrite another's."""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).parents[1] / "experiments" / "launch" / "doremi_study.py"


@pytest.fixture(scope="module")
def launcher():
    spec = importlib.util.spec_from_file_location("doremi_study", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["doremi_study"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def work(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "work" / "study"
    (folder / "uniform-seed5" / "checkpoints").mkdir(parents=True)
    (folder / "uniform-seed5" / "run.json").write_text("{}\n")
    (folder / "uniform-seed5" / "checkpoints" / "model.bin").write_bytes(b"\0")
    stores = tmp_path / "work" / "stores"
    stores.mkdir()
    (stores / "manifest.json").write_text('{"files": 1}\n')
    return folder, stores


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_a_session_label_keeps_every_call_s_record_apart(launcher, tmp_path):
    folder, stores = work(tmp_path)
    log = launcher.records_dir(folder, "8") / "launch.log"
    log.parent.mkdir(parents=True)
    log.write_text("call 1\n")
    (tmp_path / "out1").mkdir()
    launcher.pack(tmp_path / "out1", "study", folder, {"call": 1}, stores, "8")
    with log.open("a") as f:
        f.write("call 2\n")
    (tmp_path / "out2").mkdir()
    archive = launcher.pack(tmp_path / "out2", "study", folder, {"call": 2}, stores, "8")
    files = members(archive)
    assert json.loads(files["study/session-8/launch-call1.json"]) == {"call": 1}
    assert json.loads(files["study/session-8/launch-call2.json"]) == {"call": 2}
    assert files["study/session-8/launch.log"] == b"call 1\ncall 2\n"
    assert files["study/session-8/stores-manifest.json"] == b'{"files": 1}\n'
    assert "study/uniform-seed5/run.json" in files
    assert not [n for n in files if "checkpoints" in n or n.endswith("launch.json") or "/stores/" in n]


def test_without_a_label_one_record_is_rewritten_by_every_call(launcher, tmp_path):
    folder, stores = work(tmp_path)
    (folder / "launch.log").write_text("log\n")
    for call in (1, 2):
        (tmp_path / f"out{call}").mkdir()
        archive = launcher.pack(tmp_path / f"out{call}", "study", folder, {"call": call}, stores)
    files = members(archive)
    assert json.loads(files["study/launch.json"]) == {"call": 2}
    assert files["study/stores/manifest.json"] == b'{"files": 1}\n'
    assert files["study/launch.log"] == b"log\n"
    assert not [n for n in files if "session-" in n or "checkpoints" in n]


@pytest.mark.parametrize("label", ["../x", "a/b", " 8"])
def test_a_session_label_that_is_not_a_plain_name_is_refused(launcher, tmp_path, capsys, label):
    with pytest.raises(SystemExit) as stop:
        launcher.main(["study", "--out", str(tmp_path), "--session", label])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("doremi_study: error: --session: expected a label")


def test_the_archive_leaves_out_what_a_later_session_redoes_from_the_start(launcher, tmp_path):
    from data import artifact

    folder, stores = work(tmp_path)
    stages = [
        launcher.Stage("proxy-seed5", "train-proxy"),
        launcher.Stage("proxy-seed5", "average"),
        launcher.Stage("uniform-seed5", "train", main=True),
        launcher.Stage("natural-seed5", "train", main=True),
        launcher.Stage("doremi-seed5", "train", main=True),
    ]
    (folder / "proxy-seed5").mkdir()
    artifact.write(folder / "proxy-seed5" / "run.json", artifact.Header("run"))  # trained, not averaged
    artifact.write(folder / "natural-seed5" / "run.json", artifact.Header("run"))
    # uniform-seed5 was stopped at a deadline (its run.json says nothing finished); doremi-seed5 never began
    unfinished = launcher.left_unfinished(stages, folder)
    assert unfinished == {"uniform-seed5", "doremi-seed5"}
    files = members(launcher.pack(tmp_path, "study", folder, {}, stores, "8", unfinished))
    assert {n.split("/")[1] for n in files} == {"proxy-seed5", "natural-seed5", "session-8"}


def stores_and_runs(tmp_path: Path, runs: dict[str, tuple[str, str]]) -> tuple[Path, Path]:
    """Stores with fingerprint "f" * 64 and run directories whose headers name (status, stores fingerprint)."""
    from data import artifact

    stores = tmp_path / "stores"
    stores.mkdir()
    artifact.write(stores / "manifest.json", artifact.Header(kind="stores", fingerprint="f" * 64), {"domains": []})
    folder = tmp_path / "study"
    for name, (status, fp) in runs.items():
        (folder / name).mkdir(parents=True)
        header = artifact.Header(kind="run", status=status, sources=[artifact.Source("stores", str(stores), fp)])
        artifact.write(folder / name / "run.json", header, {"stage": "train"})
    return folder, stores


def test_finished_runs_on_the_same_stores_pass(launcher, tmp_path):
    folder, stores = stores_and_runs(tmp_path, {"uniform-seed1": ("finished", "f" * 64)})
    assert launcher.stores_mismatch(folder, stores) is None


def test_finished_runs_on_other_stores_are_named(launcher, tmp_path):
    folder, stores = stores_and_runs(
        tmp_path,
        {
            "uniform-seed1": ("finished", "a" * 64),
            "natural-seed1": ("finished", "a" * 64),
            "doremi-seed1": ("finished", "f" * 64),
            "uniform-seed2": ("interrupted", "b" * 64),
        },
    )
    line = launcher.stores_mismatch(folder, stores)
    assert (
        line
        == f"{stores}: stores fingerprint {'f' * 16}, but finished runs were trained on {'a' * 16} (natural-seed1, uniform-seed1)"
    )
