"""doremi/study/sharing.py: a run's share of the GPU from the study launcher's records, and the
ledger's GPU-seconds scaled by it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from doremi.study.sharing import device_shares, shares_of


def call(folder: Path, n: int, *stages: tuple[str, int, float, int]) -> None:
    """One launcher call's record: (stage, side_by_side, seconds, exit status) per stage."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"stage": "preprocess", "exit_status": 0, "seconds": 50.0}]
    rows += [{"stage": "proxy-seed1", "command": "average", "exit_status": 0, "seconds": 3.0, "side_by_side": 1}]
    rows += [
        {"stage": s, "command": "train", "exit_status": rc, "seconds": sec, "stopped": rc != 0, "side_by_side": k}
        for s, k, sec, rc in stages
    ]
    rows += [{"stage": "uniform-seed9", "command": "train", "skipped": "finished"}]
    (folder / f"launch-call{n}.json").write_text(json.dumps({"stages": rows}))


def test_shares_follow_the_calls_of_the_session_a_run_finished_in(tmp_path):
    study = tmp_path / "study"
    # session 2: a and b three at a time over two calls (cut, then finished); c finished too.
    call(study / "session-2", 1, ("a-seed1", 3, 400.0, 143), ("b-seed1", 3, 400.0, 143), ("c-seed1", 3, 400.0, 143))
    call(study / "session-2", 2, ("a-seed1", 3, 200.0, 0), ("b-seed1", 1, 100.0, 0), ("c-seed1", 3, 200.0, 0))
    # session 10: c trained again from its start, alone; d alone throughout.
    call(study / "session-10", 1, ("c-seed1", 1, 250.0, 0), ("d-seed1", 1, 250.0, 0))
    shares = device_shares(tmp_path)
    assert shares["a-seed1"] == pytest.approx(1 / 3)
    assert shares["b-seed1"] == pytest.approx((400 / 3 + 100) / 500)
    assert "c-seed1" not in shares and "d-seed1" not in shares  # the whole GPU: c's last session ran it alone
    assert shares_of([study / "a-seed1", study / "d-seed1"]) == shares


def test_the_ledger_charges_a_shared_run_its_share(tmp_path):
    from doremi.study.summarize import compute_of
    from tests.test_study_calibration import write_run

    study = tmp_path / "study"
    runs = {
        ("uniform", 1): write_run(study, "uniform-seed1", 3.0, 1),
        ("natural", 1): write_run(study, "natural-seed1", 3.1, 1),
    }
    alone = compute_of(runs, "natural", (), (1,))["per_seed_mean"]["gpu_seconds"]
    call(study / "session-1", 1, ("uniform-seed1", 2, 300.0, 0), ("natural-seed1", 2, 300.0, 0))
    got = compute_of(runs, "natural", (), (1,), shares=shares_of(runs.values()))
    assert got["per_seed_mean"]["gpu_seconds"] == pytest.approx(alone / 2)
    assert (
        got["per_seed_mean"]["train_flops_total"]
        == compute_of(runs, "natural", (), (1,))["per_seed_mean"]["train_flops_total"]
    )


def test_the_calibration_reads_a_shared_runs_rate_over_its_share(tmp_path):
    from doremi.study.calibration import calibrate
    from doremi.study.design import DESIGN
    from doremi.study.runs import find_runs
    from tests.test_study_calibration import write_run

    root = tmp_path / "cal"
    for seed in (1, 2, 3, 4):
        write_run(root, f"uniform-seed{seed}", 3.0 + 0.01 * seed, seed)
        write_run(root, f"fixed-seed{seed}", 3.02 + 0.012 * seed, seed)
    alone = calibrate(find_runs(root, DESIGN.calibration.arms)).tokens_per_s
    call(root / "session-2", 1, ("uniform-seed1", 2, 300.0, 0), ("fixed-seed1", 2, 300.0, 0))
    shared = calibrate(find_runs(root, DESIGN.calibration.arms)).tokens_per_s
    # Seed 1's two runs had half the GPU each: their rates count double, the other seeds' as measured.
    per_run = alone["uniform"]
    assert shared["uniform"] == pytest.approx(per_run * (2 + 1 + 1 + 1) / 4)
    assert shared["all"] == pytest.approx(alone["all"] * 5 / 4)


def test_a_damaged_launcher_record_is_refused_by_name(tmp_path):
    from doremi.study.runs import StudyError

    (tmp_path / "session-3").mkdir()
    (tmp_path / "session-3" / "launch-call1.json").write_text('{"stages": [')
    with pytest.raises(StudyError, match=r"launch-call1.json: damaged launcher record"):
        device_shares(tmp_path)
