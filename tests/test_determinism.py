"""Same seeds, same bits: `train.deterministic` and the pairing record (trainer/run/determinism.py,
trainer/records/pairing.py; docs/design.md section 4e)."""

from __future__ import annotations

import torch

from doremi.pipeline import stages
from doremi.study.runs import measured_pairing_problems
from tests.runs import config, final_params
from trainer.records.metrics import read_jsonl
from trainer.records.pairing import check_paired, read_pairing
from trainer.run.determinism import is_deterministic, set_deterministic


def _train(stores, run, *sets):
    stages.train(config(stores, run, "train.steps=4", "train.eval_every=2", *sets))
    return read_jsonl(run / "metrics.jsonl")


def _numbers(rows):
    keep = ("loss", "grad_norm", "val_loss", "domain_loss")
    return [{k: r[k] for k in keep if k in r} for r in rows]


def test_two_same_seed_runs_are_bitwise_equal(stores, tmp_path, one_thread):
    a = _train(stores, tmp_path / "a", "train.deterministic=true", "train.seed=3", "data.seed=5")
    b = _train(stores, tmp_path / "b", "train.deterministic=true", "train.seed=3", "data.seed=5")
    assert _numbers(a) == _numbers(b) and len(_numbers(a)) >= 4
    pa, pb = final_params(stores, tmp_path / "a"), final_params(stores, tmp_path / "b")
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert read_pairing(tmp_path / "a") == read_pairing(tmp_path / "b")


def test_arms_with_other_mixtures_are_paired_and_another_seed_is_not(stores, tmp_path, one_thread):
    _train(stores, tmp_path / "uniform", "train.seed=3", "data.seed=5")
    _train(stores, tmp_path / "skewed", "train.seed=3", "data.seed=5", "data.domain_weights=[0.6,0.1,0.3]")
    _train(stores, tmp_path / "other", "train.seed=4", "data.seed=6")
    uniform, skewed, other = (read_pairing(tmp_path / n) for n in ("uniform", "skewed", "other"))
    # Different counts per domain in the first step, from the same per-domain streams.
    assert [len(v) for v in uniform["first_batch"].values()] != [len(v) for v in skewed["first_batch"].values()]
    assert sum(len(v) for v in skewed["first_batch"].values()) == 8
    assert check_paired(uniform, skewed) == []
    problems = check_paired(uniform, other)
    assert problems[0] == "initial parameters differ" and any(p.startswith("domain ") for p in problems)
    # The study's pairing reads the same records from the run directories.
    assert measured_pairing_problems(tmp_path / "uniform", tmp_path / "skewed") == []
    assert measured_pairing_problems(tmp_path / "uniform", tmp_path / "other") == problems


def test_the_switch_sets_and_clears_the_process_flags():
    try:
        set_deterministic(True)
        assert is_deterministic() and torch.are_deterministic_algorithms_enabled()
    finally:
        set_deterministic(False)
    assert not is_deterministic()
