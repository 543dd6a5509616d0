"""Run directories (trainer/records/run_dir.py): the fingerprint of what determines results, the resume
policy, the lock; then the trainer and the pipeline refusing or redoing what would otherwise
silently continue under another config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from doremi.config import ExperimentConfig
from doremi.pipeline import stages
from doremi.pipeline.pipeline import Pipeline, deep_merge, remove_marker_temps, started_marker
from tests.runs import config, config_path, losses
from trainer.checkpoint.checkpoint import latest_checkpoint
from trainer.config.tools import ConfigError, from_dict
from trainer.records import run_dir as rundir

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["train.decay=constant", "train.warmup_steps=0", "train.eps=1e-4", "checkpoint.every=1"]


pytestmark = pytest.mark.usefixtures("one_thread")


def exp(**sections) -> ExperimentConfig:
    return from_dict(ExperimentConfig, deep_merge({"data": {"domains": [{"name": "a", "embedded": "code"}]}}, sections))


# -- the fingerprint (pure) ----------------------------------------------------------------------


def test_cadence_layout_and_paths_do_not_change_the_fingerprint():
    base = rundir.record(exp())
    same = exp(
        logging={"every": 5},
        checkpoint={"every": 7, "keep": 3, "resume_changed": True},
        parallelism={"dp": 2},
        train={"run_dir": "elsewhere", "eval_every": 3, "micro_batches": 2},
        pipeline={"baselines": []},
        mixing={"doremi": {"rounds": 3}},
    )
    assert rundir.record(same)["fingerprint"] == base["fingerprint"]


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("mixing", "method", "odm"),
        ("train", "lr", 1e-4),
        ("train", "seed", 1),
        ("data", "seed", 2),
        ("data", "domain_weights", [1.0]),
        ("model", "d_model", 128),
        ("checkpoint", "load", "x"),
    ],
)
def test_result_keys_change_the_fingerprint(section, key, value):
    old, new = rundir.record(exp()), rundir.record(exp(**{section: {key: value}}))
    assert new["fingerprint"] != old["fingerprint"]
    assert rundir.changed_keys(old["keys"], new["keys"]).startswith(f"{section}.{key} ")


def test_steps_count_only_when_the_schedule_depends_on_them():
    constant = {"decay": "constant", "warmup_steps": 0}
    a, b = exp(train={**constant, "steps": 10}), exp(train={**constant, "steps": 20})
    assert rundir.record(a) == rundir.record(b)
    a, b = exp(train={"steps": 10}), exp(train={"steps": 20})  # cosine decay over train.steps
    assert rundir.changed_keys(rundir.record(a)["keys"], rundir.record(b)["keys"]) == "train.steps 10 -> 20"


def test_ignored_sections_and_file_contents(tmp_path):
    # DoReMi's options are recorded under their former section (docs/design.md section 2a)
    moved = exp(mixing={"doremi": {"eta": 3.0}})
    assert rundir.record(moved, ignore=("doremi",)) == rundir.record(exp(), ignore=("doremi",))
    weights = tmp_path / "w.json"
    weights.write_text('{"domains": ["a"], "weights": [1.0]}')
    old = rundir.record(exp(data={"domain_weights": str(weights)}))
    weights.write_text('{"domains": ["a"], "weights": [1.00]}')
    new = rundir.record(exp(data={"domain_weights": str(weights)}))
    assert rundir.changed_keys(old["keys"], new["keys"]).startswith("data.domain_weights (content) ")


def test_changed_keys_names_each_difference():
    assert (
        rundir.changed_keys({"a": 1, "b": "x", "c": 0}, {"a": 2, "b": "x", "d": 5})
        == "a 1 -> 2, c 0 -> (unset), d (unset) -> 5"
    )
    assert rundir.changed_keys({f"k{i}": i for i in range(6)}, {}, limit=2).endswith("and 4 more")


# -- the resume policy (pure) --------------------------------------------------------------------


def test_check_resume():
    old, new = rundir.record(exp()), rundir.record(exp(mixing={"doremi": {"eta": 3.0}}))
    rundir.check_resume("runs/x", old, old, 5, 10, allow_changed=False)
    rundir.check_resume("runs/x", old, new, 5, 10, allow_changed=True)
    rundir.check_resume("runs/x", None, new, 5, 10, allow_changed=False)  # written before fingerprints
    with pytest.raises(ConfigError) as e:
        rundir.check_resume("runs/x", old, new, 5, 10, allow_changed=False)
    assert str(e.value) == (
        "runs/x: resuming under a changed config: doremi.eta 1.0 -> 3.0; start a new run "
        "directory, or set checkpoint.resume_changed: true to continue anyway"
    )
    with pytest.raises(
        ConfigError,
        match=r"runs/x: train.steps=3 is below the step of the checkpoint to "
        r"resume \(5\)",
    ):
        rundir.check_resume("runs/x", old, old, 5, 3, allow_changed=True)


def test_check_fresh_start():
    rundir.check_fresh_start("runs/x", None, resume=False, start_over=False)
    rundir.check_fresh_start("runs/x", 20, resume=True, start_over=False)
    rundir.check_fresh_start("runs/x", 20, resume=False, start_over=True)
    with pytest.raises(
        ConfigError,
        match="runs/x: checkpoint.resume is false but the run directory holds "
        "checkpoints up to step 20; set checkpoint.start_over: true",
    ):
        rundir.check_fresh_start("runs/x", 20, resume=False, start_over=False)


def test_move_aside_keeps_the_lock_file(tmp_path):
    run = tmp_path / "run"
    assert rundir.move_aside(run) is None
    (run / "checkpoints").mkdir(parents=True)
    (run / rundir.LOCK_FILE).write_text("1\n")
    (run / "metrics.jsonl").write_text("{}\n")
    now = time.mktime((2024, 5, 6, 7, 8, 9, 0, 0, -1))
    first = rundir.move_aside(run, now)
    assert first == tmp_path / "run.old-20240506-070809"
    assert sorted(p.name for p in first.iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert [p.name for p in run.iterdir()] == [rundir.LOCK_FILE]
    (run / "metrics.jsonl").write_text("{}\n")
    second = rundir.move_aside(run, now)
    assert second == tmp_path / "run.old-20240506-070809-1"


# -- the lock ------------------------------------------------------------------------------------

HOLD = "import sys, time; from trainer.records.run_dir import locked\nwith locked(sys.argv[1]):\n print('held', flush=True)\n time.sleep(60)"


def test_second_job_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError) as e:
            with rundir.locked(run):
                pass
        assert str(e.value).startswith(f"{run}: run directory in use by another job (pid {holder.pid}, ")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with rundir.locked(run):
        with rundir.locked(run):  # re-entrant within one job
            assert (run / rundir.LOCK_FILE).read_text() == f"{os.getpid()}\n"
    assert (run / rundir.LOCK_FILE).read_text() == ""


def test_cli_refuses_a_locked_run_directory(stores, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with rundir.locked(run):
        result = subprocess.run(
            [sys.executable, "-m", "doremi", "train", str(config_path(stores, run))],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=300,
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"doremi train: error: {run}: run directory in use by another job (pid {os.getpid()}, "
        f"{(run / rundir.LOCK_FILE).resolve()}); wait for it to finish or use another run directory"
    ]
    assert [p.name for p in run.iterdir()] == [rundir.LOCK_FILE]


# -- the trainer -----------------------------------------------------------------------------


def snapshot(run: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != rundir.LOCK_FILE
    }


def test_resume_under_a_changed_config_is_refused(stores, tmp_path):
    run = tmp_path / "run"
    stages.train(config(stores, run, *COMMON, "train.steps=3"))
    before = snapshot(run)
    with pytest.raises(ConfigError) as e:
        stages.train(config(stores, run, *COMMON, "train.steps=5", "train.lr=1e-3", "data.seed=4"))
    assert str(e.value) == (
        f"{run}: resuming under a changed config: data.seed 0 -> 4, train.lr 0.003 -> 0.001; "
        f"start a new run directory, or set checkpoint.resume_changed: true to continue anyway"
    )
    assert snapshot(run) == before
    stages.train(
        config(stores, run, *COMMON, "train.steps=5", "logging.every=2", "checkpoint.keep=1", "mixing.doremi.eta=3")
    )  # not result keys; more steps under a constant schedule
    assert "doremi.eta" not in json.loads((run / "run.json").read_text())["keys"] and len(losses(run)) == 5
    stages.train(config(stores, run, *COMMON, "train.steps=6", "train.lr=1e-3", "checkpoint.resume_changed=true"))
    assert len(losses(run)) == 6


def test_proxy_resume_under_a_changed_eta_is_refused(stores, tmp_path):
    ref, proxy = tmp_path / "reference", tmp_path / "proxy"
    stages.train_reference(config(stores, ref, *COMMON, "train.steps=2"))
    sets = [*COMMON, "train.steps=3", f"mixing.doremi.reference={ref}"]
    stages.train_proxy(config(stores, proxy, *sets))
    with pytest.raises(ConfigError, match=r"resuming under a changed config: doremi.eta 1.0 -> 3.0; "):
        stages.train_proxy(config(stores, proxy, *sets, "train.steps=4", "mixing.doremi.eta=3.0"))
    stages.train_reference(config(stores, ref, *COMMON, "train.steps=3"))  # the reference moved on
    with pytest.raises(ConfigError, match=r"doremi.reference \(content\) "):
        stages.train_proxy(config(stores, proxy, *sets, "train.steps=4"))


def test_steps_below_the_checkpoint_is_an_error_and_rewrites_nothing(stores, tmp_path):
    run = tmp_path / "run"
    stages.train(config(stores, run, *COMMON, "train.steps=5"))
    before = snapshot(run)
    with pytest.raises(
        ConfigError,
        match=rf"^{run}: train.steps=3 is below the step of the checkpoint to resume "
        rf"\(5\); set train.steps >= 5",
    ):
        stages.train(config(stores, run, *COMMON, "train.steps=3"))
    assert snapshot(run) == before


def test_fresh_start_over_checkpoints_refuses_unless_told_to_start_over(stores, tmp_path, capsys):
    run = tmp_path / "run"
    stages.train(config(stores, run, *COMMON, "train.steps=5"))
    before = snapshot(run)
    with pytest.raises(
        ConfigError, match="checkpoint.resume is false but the run directory holds checkpoints up to step 5"
    ):
        stages.train(config(stores, run, *COMMON, "train.steps=3", "checkpoint.resume=false"))
    assert snapshot(run) == before
    stages.train(config(stores, run, *COMMON, "train.steps=3", "checkpoint.resume=false", "checkpoint.start_over=true"))
    (old,) = tmp_path.glob("run.old-*")
    assert f"{run}: checkpoint.start_over: the previous run was moved to {old}" in capsys.readouterr().err
    assert snapshot(old) == before
    assert latest_checkpoint(run).name == "step_0000003" and len(losses(run)) == 3
    domains, got = stages.evaluate(run)
    _, want = stages.evaluate(latest_checkpoint(run))
    assert got.tolist() == want.tolist()


# -- the pipeline ------------------------------------------------------------------------------


def pipeline_sets(stores: Path, root: Path, *sets: str) -> list[str]:
    return [
        *COMMON,
        "train.steps=10",
        "checkpoint.keep=2",
        "pipeline.skip_main=true",
        f"pipeline.run_dir={root}",
        f"data.store_dir={stores}",
        *sets,
    ]


def test_pipeline_killed_mid_proxy_then_rerun_with_another_eta_equals_the_uninterrupted_run(stores, tmp_path):
    whole = tmp_path / "whole"
    Pipeline(
        config_path(stores, tmp_path / "w"), pipeline_sets(stores, whole, "mixing.doremi.eta=3.0"), say=lambda m: None
    ).run()

    root = tmp_path / "killed"
    cfg = config_path(stores, tmp_path / "k")
    args = [
        sys.executable,
        "-m",
        "doremi",
        "pipeline",
        str(cfg),
        *[a for s in pipeline_sets(stores, root, "mixing.doremi.eta=1.0") for a in ("--set", s)],
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proxy = root / "round1" / "proxy"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            latest = latest_checkpoint(proxy)
            if latest is not None and latest.name >= "step_0000002":
                break
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the pipeline ended before it could be killed"
    assert not (proxy / "stage.json").exists() and started_marker(proxy / "stage.json").is_file()
    (proxy / ".stage.json.x1.tmp").write_text("torn")

    messages: list[str] = []
    Pipeline(cfg, pipeline_sets(stores, root, "mixing.doremi.eta=3.0"), say=messages.append).run()
    assert any("round 1: proxy: interrupted under another config, redoing from scratch" in m for m in messages)
    assert not list(root.rglob("*.tmp"))
    assert (
        json.loads((root / "weights.json").read_text())["weights"]
        == json.loads((whole / "weights.json").read_text())["weights"]
    )
    assert losses(proxy) == losses(whole / "round1" / "proxy")


def test_remove_marker_temps(tmp_path):
    for name in (
        "a/.stage.json.1.tmp",
        "a/.eval.json.stage.json.2.tmp",
        "a/.stage.started.json.3.tmp",
        "a/.metrics.jsonl.4.tmp",
        "a/stage.json",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    remove_marker_temps(tmp_path)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".metrics.jsonl.4.tmp", "stage.json"]
