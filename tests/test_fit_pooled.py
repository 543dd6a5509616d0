"""`doremi fit --sweep A B ...`: several sweeps of one design, differing only in their seeds, are
one fit over all their runs (the comparison's pooled SWEPT arms, issue 39); sweeps of other
domains or other keys, or one sweep given twice, are one line and exit 2 with nothing written;
one sweep is fitted as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from doremi.commands.cli import main
from doremi.offline.propose import POOLED_KEYS, read_sweeps
from doremi.offline.sweep import FINAL_FILE, SWEEP_FILE
from tests.runs import config_path

DOMAINS = ["noise", "easy", "markov"]
KEYS = {"sweep.runs": 12, "sweep.designs": ["dirichlet"], "train.steps": 20, "sweep.seed": 1, "train.seed": 1}


def rows(seed: int, n: int = 12) -> list[list[str]]:
    """n mixtures and losses smooth in them (each domain's loss falls with its weight)."""
    w = np.random.default_rng(seed).dirichlet([1.0] * 3, n)
    out = []
    for i, x in enumerate(w):
        loss = 3.0 - np.log1p(4 * x)
        numbers = [*x, *loss, loss.mean(), loss.max()]
        out.append([str(i), "dirichlet", *(repr(float(v)) for v in numbers)])
    return out


def write_sweep(root: Path, table: list[list[str]], keys: dict, domains: list[str] = DOMAINS) -> Path:
    root.mkdir(parents=True)
    doc = {"domains": domains, "keys": keys, "design": [{}] * len(table), "compute": {"train_flops": 1e12 * len(table)}}
    (root / SWEEP_FILE).write_text(json.dumps(doc))
    header = ["run", "design", *(f"w:{d}" for d in domains), *domains, "mean", "worst"]
    (root / FINAL_FILE).write_text("\n".join(",".join(r) for r in [header, *table]) + "\n")
    return root


def _fit(stores: Path, tmp: Path, sweeps: list[Path], out: Path) -> int:
    cfg = config_path(stores, tmp / "cfg")
    return main(
        ["fit", str(cfg), "--method", "mixing_law", "--set", 'fit.mixing_law.variant="direct"']
        + ["--sweep", *map(str, sweeps), "--out", str(out)]
    )


def test_two_sweeps_are_one_fit_over_all_their_runs(stores, tmp_path, capsys):
    a = write_sweep(tmp_path / "sweep-seed1", rows(1), KEYS)
    b = write_sweep(tmp_path / "sweep-seed2", rows(2), {**KEYS, "sweep.seed": 2, "train.seed": 2})
    both = write_sweep(tmp_path / "both", rows(1) + rows(2), KEYS)
    domains, weights, losses = read_sweeps([a, b])
    assert domains == DOMAINS and weights.shape == (24, 3) and losses["mean"].shape == (24,)
    assert _fit(stores, tmp_path, [a, b], tmp_path / "pooled.json") == 0
    assert _fit(stores, tmp_path, [both], tmp_path / "one.json") == 0
    pooled, one = (json.loads((tmp_path / f).read_text()) for f in ("pooled.json", "one.json"))
    assert pooled["weights"] == pytest.approx(one["weights"], rel=1e-12)
    assert pooled["n_runs"] == 24 and pooled["sweeps"] == [str(a), str(b)]
    assert pooled["sweep_runs"] == 24 and pooled["compute"] == {"train_flops": 24e12}
    assert "sweeps" not in one and one["sweep"] == str(both)  # one sweep: as before
    assert set(POOLED_KEYS) == {"sweep.seed", "train.seed", "data.seed"}


@pytest.mark.parametrize("bad", ["keys", "domains", "twice", "same_seed", "no_out"])
def test_sweeps_that_are_not_one_design_are_one_line_and_exit_2(stores, tmp_path, capsys, bad):
    a = write_sweep(tmp_path / "sweep-seed1", rows(1), KEYS)
    other = {**KEYS, "sweep.seed": 2}
    if bad == "keys":
        b = write_sweep(tmp_path / "sweep-seed2", rows(2), {**other, "sweep.runs": 64})
        want = "not the sweep of"
    elif bad == "domains":
        b = write_sweep(tmp_path / "sweep-seed2", rows(2), other, ["noise", "easy", "prose"])
        want = "one fit pools one corpus"
    elif bad == "twice":
        b = a
        want = "a sweep given twice"
    elif bad == "same_seed":
        b = write_sweep(tmp_path / "copy", rows(1), KEYS)
        want = "the same sweep twice"
    else:
        b = write_sweep(tmp_path / "sweep-seed2", rows(2), other)
        want = "--out is required with several sweeps"
    out = tmp_path / "pooled.json"
    cfg = config_path(stores, tmp_path / "cfg")
    argv = ["fit", str(cfg), "--method", "mixing_law", "--sweep", str(a), str(b)]
    assert main(argv + ([] if bad == "no_out" else ["--out", str(out)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0], err
    assert not out.exists() and not (a / "mixing_law.json").exists()
