"""Sweeps, fits and method options on inputs that gave a silent wrong result or a traceback: a
LightGBM fit too small to split (it proposed the prior), another prior than the sweep's, a
diverged or malformed sweep table, a chunk half recorded, checkpoint keys that refused a resume,
design keys out of range; each now one line naming the key, file or run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from doremi.commands.cli import main
from doremi.errors import DoReMiError
from doremi.methods.regmix.fit import RegMixOptions, RidgeOptions, fit_regressor, propose_regmix
from doremi.offline.fit.checks import FitError
from doremi.offline.fit.design import dirichlet_design
from doremi.offline.propose import check_prior
from doremi.offline.sweep import FINAL_FILE, SWEEP_FILE, Sweep, final_table, sweep_keys
from tests.runs import config, config_path
from trainer.config.tools import ConfigError

PRIOR = np.array([0.2, 0.3, 0.5])
DOMAINS = ["noise", "easy", "markov"]
SIM = RegMixOptions(n_simulations=2000, top_k=128, seed=42)


def linear_sweep(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n Dirichlet mixtures and a loss that falls with domain 0's weight (optimum: all domain 0)."""
    w = dirichlet_design(PRIOR, n, seed=0).weights
    return w, 3.0 - 2.0 * w[:, 0] + 0.5 * w[:, 2]


# ---- RegMix ---------------------------------------------------------------------------------


def test_lightgbm_on_a_sweep_too_small_to_split_is_refused():
    """30 runs < 2 x min_data_in_leaf: every tree is one leaf, and the proposal used to be the
    mean of the first 128 prior draws ([0.166, 0.314, 0.520] here), with exit 0."""
    w, y = linear_sweep(30)
    with pytest.raises(FitError, match=r"^lightgbm: 30 runs are too few for trees with min_data_in_leaf 20") as e:
        fit_regressor(w, y, "lightgbm")
    assert "\n" not in str(e.value) and "fit.regressor: ridge" in str(e.value)
    w, y = linear_sweep(64)
    proposal = propose_regmix(fit_regressor(w, y, "lightgbm"), PRIOR, options=SIM)
    assert proposal.weights[0] > 0.8  # enough runs: the fit finds the optimum's side


def test_regmix_refuses_a_regressor_that_ranks_nothing():
    w, _ = linear_sweep(8)
    model = fit_regressor(w, np.full(8, 2.5), "ridge")
    with pytest.raises(FitError, match="predicts the same loss for all 2000 simulated mixtures"):
        propose_regmix(model, PRIOR, options=SIM)


def test_ridge_needs_as_many_runs_as_free_parameters():
    w, y = linear_sweep(6)
    with pytest.raises(FitError, match="ridge: 2 runs are too few for degree 1 over 3 domains; expected at least 3"):
        fit_regressor(w[:2], y[:2], "ridge")
    with pytest.raises(FitError, match="ridge: 5 runs are too few for degree 2 over 3 domains; expected at least 6"):
        fit_regressor(w[:5], y[:5], "ridge", RidgeOptions(degree=2))
    model = fit_regressor(w[:3], y[:3], "ridge")
    assert model.predict(w[:3]) == pytest.approx(y[:3], abs=1e-3)


# ---- the sweep's table ------------------------------------------------------------------------


def write_sweep(root: Path, rows: list[list[str]], header: list[str] | None = None, keys: dict | None = None) -> Path:
    root.mkdir(parents=True)
    (root / SWEEP_FILE).write_text(json.dumps({"domains": DOMAINS, "keys": keys or {}, "design": [{}] * 4}))
    header = header or ["run", "design", *(f"w:{d}" for d in DOMAINS), *DOMAINS, "mean", "worst"]
    (root / FINAL_FILE).write_text("\n".join(",".join(r) for r in [header, *rows]) + "\n")
    return root


ROW0 = ["0", "dirichlet", "0.2", "0.3", "0.5", "4.0", "3.0", "2.0", "3.0", "4.0"]
ROW1 = ["1", "dirichlet", "0.5", "0.5", "0.0", "4.5", "2.5", "nan", "nan", "nan"]


def test_final_table_names_a_diverged_run(tmp_path):
    root = write_sweep(tmp_path / "s", [ROW0, ROW1])
    with pytest.raises(DoReMiError, match=r"run 1's final markov loss is nan \(the run diverged\)"):
        final_table(root)
    domains, weights, losses = final_table(write_sweep(tmp_path / "ok", [ROW0]))
    assert domains == DOMAINS and weights.tolist() == [[0.2, 0.3, 0.5]] and losses["mean"].tolist() == [3.0]


def test_final_table_of_another_shape_is_one_line(tmp_path):
    """A final.csv without a domain's columns, or with text for a number: one line, not a
    KeyError or ValueError traceback."""
    header = ["run", "design", "w:noise", "w:easy", "noise", "easy", "mean", "worst"]
    root = write_sweep(tmp_path / "cols", [["0", "grid", "0.5", "0.5", "1", "2", "1.5", "2"]], header)
    with pytest.raises(DoReMiError, match=r"missing \['w:markov', 'markov'\]"):
        final_table(root)
    root = write_sweep(tmp_path / "text", [[*ROW0[:5], "four", *ROW0[6:]]])
    with pytest.raises(DoReMiError, match="expected numbers in every column"):
        final_table(root)


def test_fit_of_a_sweep_with_a_diverged_run_exits_2(stores, tmp_path, capsys):
    root = write_sweep(tmp_path / "s", [ROW0, ROW1, ROW0])
    path = config_path(stores, tmp_path / "cfg")
    out = tmp_path / "w.json"
    assert main(["fit", str(path), "--method", "mixing_law", "--sweep", str(root), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run 1's final markov loss is nan" in err[0]
    assert not out.exists()


def test_regmix_refuses_another_prior_than_the_sweeps(stores, tmp_path):
    cfg = config(stores, tmp_path / "run")
    root = write_sweep(tmp_path / "s", [ROW0], keys=json.loads(json.dumps(sweep_keys(cfg), default=str)))
    check_prior(cfg, root)  # the sweep's own prior (tokens)
    other = config(stores, tmp_path / "run", "sweep.prior=uniform")
    with pytest.raises(
        DoReMiError, match=r"another sweep\.prior than this config's \(sweep\.prior tokens -> uniform\)"
    ):
        check_prior(other, root)


# ---- the sweep's keys and design -----------------------------------------------------------


def test_checkpoint_keys_do_not_change_a_sweep(stores, tmp_path):
    """A sweep once run with checkpoint.start_over: true (or resumed with another
    checkpoint.every) used to be refused as 'made under other keys'."""
    base = sweep_keys(config(stores, tmp_path / "a"))
    for key in ("checkpoint.start_over=true", "checkpoint.every=1", "checkpoint.keep=3", "data.num_proc=1"):
        assert sweep_keys(config(stores, tmp_path / "a", key)) == base, key
    assert sweep_keys(config(stores, tmp_path / "a", "train.lr=0.01"))["train.lr"] == 0.01


@pytest.mark.parametrize(
    "sets, match",
    [
        (["sweep.temperature=0"], "sweep.temperature: expected a finite value > 0, got 0"),
        (["sweep.temperature=-1"], "sweep.temperature: expected a finite value > 0, got -1"),
        (["sweep.min_weight=0.5"], r"sweep.min_weight: expected at most 1/k = 0.333333 .* got 0.5"),
    ],
)
def test_design_keys_out_of_range_name_their_key(stores, tmp_path, sets, match):
    with pytest.raises(DoReMiError, match=match):
        Sweep(config(stores, tmp_path / "run", f"sweep.run_dir={tmp_path / 's'}", *sets))
    assert not (tmp_path / "s").exists()


def test_min_weight_above_1_over_k_is_valid_for_the_grid(stores, tmp_path):
    sweep = Sweep(
        config(stores, tmp_path / "run", "sweep.designs=[grid]", "sweep.grid_steps=4", "sweep.min_weight=0.5")
    )
    assert sweep.design.weights.tolist() == [
        [0.0, 0.0, 1.0],
        [0.0, 0.5, 0.5],
        [0.0, 1.0, 0.0],
        [0.5, 0.0, 0.5],
        [0.5, 0.5, 0.0],
        [1.0, 0.0, 0.0],
    ]


def test_a_stacked_chunk_is_recorded_in_one_write(stores, tmp_path, monkeypatch):
    """A kill between two runs' writes would leave part of a chunk recorded; the rest would be
    trained again in another chunk."""
    cfg = config(stores, tmp_path / "run", f"sweep.run_dir={tmp_path / 's'}", "sweep.runs=3", "train.steps=4")
    sweep = Sweep(cfg)
    writes: list[list[int]] = []
    monkeypatch.setattr(sweep, "_write", lambda: writes.append(sorted(sweep.evals)))
    losses = np.arange(9, dtype=np.float64).reshape(3, 3)
    fake = SimpleNamespace(evals=[(4, losses)])
    monkeypatch.setattr("trainer.stacked.train.train_stacked", lambda *a, **k: fake)
    sweep.run_stacked([0, 1, 2])
    assert writes == [[0, 1, 2]]
    assert sweep.evals[2] == [(4, [6.0, 7.0, 8.0])]


# ---- method options --------------------------------------------------------------------------


def test_doge_score_clip_with_nan_is_refused(stores, tmp_path):
    with pytest.raises(ConfigError, match=r"^mixing.doge.score_clip\[0\]: expected a finite number, got nan$"):
        config(stores, tmp_path / "run", "mixing.doge.score_clip=[.nan, 5]")
