"""Every online mixing method on the trainer (docs/design.md section 2): the weights of DoGE,
ODM, Aioli, ADO and of a method written for the tests (tests/toy_method.py) do not depend on the
layout (one process with 1 or 4 micro-batches, tp2 pp2 dp2 over 8 gloo processes) to 1e-6, and
random draws are the same draws under every layout; a run resumed after a crash repeats the
uninterrupted run exactly; each method's proxy averages into a weights file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from doremi.methods.history import read_history
from doremi.pipeline import stages
from tests.distributed import spawn
from tests.runs import config
from trainer.checkpoint.checkpoint import checkpoint_dir, latest_checkpoint

COMMON = ["train.decay=constant", "train.warmup_steps=0", "train.eps=1e-4", "train.steps=5", "train.eval_sequences=4"]

#: Method -> the keys that make a 5-step proxy of it move its weights.
METHODS: dict[str, list[str]] = {
    # 3 target sequences: split 2 + 1 over dp = 2
    "doge": ["mixing.method=doge", "mixing.doge.mu=0.01", "mixing.doge.target_sequences=3"],
    "odm": ["mixing.method=odm"],
    "aioli": ["mixing.method=aioli", "mixing.aioli.rounds=1", "mixing.aioli.delta=1", "mixing.aioli.sweeps=1"],
    "ado": [
        "mixing.method=ado",
        # the paper's form: the authors' fit on 1 to 5 points is ill-posed, and a float32 rounding
        # flip of one loss between layouts can move its weights by ~1e-6 (doremi/methods/ado/method.py)
        "mixing.ado.variant=paper",
        "mixing.ado.warmup=0",
        "mixing.ado.refit_every=1",
        "mixing.ado.record_every=1",
        "mixing.ado.min_points=3",
    ],
    "toy": [],
}
LAYOUTS = {
    "mb4": ["train.micro_batches=4"],
    "tp2-pp2-dp2": [
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.dp=2",
        "parallelism.sequence_parallel=true",
        "train.micro_batches=2",
    ],
}

pytestmark = pytest.mark.usefixtures("one_thread")


def run_method(name: str, store: Path, run: Path, *sets: str) -> None:
    cfg = config(store, run, *COMMON, *METHODS[name], *sets)
    if name == "toy":
        from tests.toy_method import LossChaser
        from trainer.run.loop import Trainer

        Trainer(cfg, stage="proxy", method=LossChaser).fit()
    else:
        stages.train_proxy(cfg)


def worker(rank: int, world: int, store: str, root: str, sets: list[str]) -> None:
    for name in METHODS:
        run_method(name, Path(store), Path(root) / f"{name}-tp2-pp2-dp2", *sets)


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("methods")
    for name in METHODS:
        run_method(name, stores, root / f"{name}-single")
        run_method(name, stores, root / f"{name}-mb4", *LAYOUTS["mb4"])
    spawn(worker, 8, str(stores), str(root), LAYOUTS["tp2-pp2-dp2"])
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(METHODS))
def test_weights_and_draws_do_not_depend_on_the_layout(runs, name, layout):
    want, got = read_history(runs / f"{name}-single"), read_history(runs / f"{name}-{layout}")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5]
    for a, b in zip(want, got):
        assert b["weights"] == pytest.approx(a["weights"], abs=1e-6), f"step {a['step']}"
        assert b["tokens"] == a["tokens"], f"step {a['step']}"  # the same draws
        if "sequences" in a:
            assert b["sequences"] == a["sequences"]
    assert max(abs(x - w) for x, w in zip(want[-1]["weights"], want[0]["weights"])) > 1e-4  # they moved


@pytest.mark.parametrize("name", ["odm", "toy"])
def test_random_draws_are_random_and_logged(runs, name):
    rows = read_history(runs / f"{name}-single")
    counts = {tuple(r["sequences"]) for r in rows}
    assert len(counts) > 1  # not the same apportioned counts every step
    assert all(sum(r["sequences"]) == 8 and len(r["sampling"]) == 3 for r in rows)


@pytest.mark.parametrize("name", list(METHODS))
def test_resume_after_a_crash_equals_the_uninterrupted_run(stores, tmp_path, name):
    sets = ["checkpoint.every=1", "checkpoint.keep=10"]
    whole = tmp_path / "whole"
    run_method(name, stores, whole, *sets)
    crashed = tmp_path / "crashed"
    shutil.copytree(whole, crashed)
    for step in (4, 5):
        shutil.rmtree(checkpoint_dir(crashed, step))
    assert latest_checkpoint(crashed) == checkpoint_dir(crashed, 3)
    run_method(name, stores, crashed, *sets)
    assert read_history(crashed) == read_history(whole)


@pytest.mark.parametrize("name", ["doge", "odm", "aioli", "ado"])
def test_a_proxy_averages_into_a_weights_file_naming_its_method(runs, name):
    out = json.loads(stages.average(runs / f"{name}-single", runs / f"{name}.json").read_text())
    assert out["method"] == name and sum(out["weights"]) == pytest.approx(1.0)
    history = [r["weights"] for r in read_history(runs / f"{name}-single")]
    mean = [sum(w[i] for w in history) / len(history) for i in range(3)]
    assert out["weights"] == pytest.approx(mean, abs=1e-12)


def test_a_proxy_averages_under_its_own_method_whatever_mixing_main_says(runs, tmp_path):
    """A proxy's config may also name a method for main runs (`mixing.main`); the weights it
    logged are its `mixing.method`'s, and the average says so."""
    import yaml

    run = tmp_path / "odm-proxy"
    shutil.copytree(runs / "odm-single", run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["mixing"]["main"] = "aioli"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = json.loads(stages.average(run, tmp_path / "w.json").read_text())
    assert out["method"] == "odm" and out["reward"] == "loss" and "rounds" not in out  # ODM's keys, not Aioli's
