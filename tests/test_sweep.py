"""`doremi sweep` (doremi/offline/sweep.py): the tables of a sweep killed mid-way and resumed equal an
uninterrupted sweep's; a sweep directory made under other keys is refused with the keys named, and
one made under another design with the first mixture that differs; stacked runs give the tables
of runs one by one; the design and a fit's proposal are capped in the sequences a run reads."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from doremi.commands.cli import main
from doremi.offline.sweep import FINAL_FILE, LOSSES_FILE, MIXTURES_FILE, read_table, run_sweep
from tests.paths import ROOT
from tests.runs import config, config_path
from trainer.checkpoint.checkpoint import checkpoint_dir

SETS = [
    "train.steps=4",
    "train.eval_every=2",
    "sweep.eval_points=2",
    "train.eval_sequences=4",
    "train.decay=constant",
    "train.warmup_steps=0",
    "train.eps=1e-4",
    "sweep.runs=3",
    "sweep.designs=[dirichlet, one_hot]",
]

pytestmark = pytest.mark.usefixtures("one_thread")


def sweep_sets(root: Path, *more: str) -> list[str]:
    return [*SETS, f"sweep.run_dir={root}", *more]


def tables(root: Path) -> dict[str, list[dict[str, str]]]:
    return {name: read_table(root / name) for name in (MIXTURES_FILE, LOSSES_FILE, FINAL_FILE)}


@pytest.fixture(scope="module")
def whole(stores, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep") / "whole"
    run_sweep(config(stores, root / "cfg", *sweep_sets(root, "sweep.stacked=false")))
    return root


def test_tables_hold_every_run_and_evaluation(whole):
    t = tables(whole)
    assert [r["design"] for r in t[MIXTURES_FILE]] == ["dirichlet"] * 3 + ["one_hot"] * 3
    assert [(r["run"], r["step"]) for r in t[LOSSES_FILE]] == [(str(i), s) for i in range(6) for s in ("2", "4")]
    final = t[FINAL_FILE]
    assert len(final) == 6
    for row in final:
        losses = [float(row[d]) for d in ("noise", "easy", "markov")]
        assert float(row["mean"]) == pytest.approx(np.mean(losses), abs=1e-12)
        assert float(row["worst"]) == max(losses)
    assert [float(final[3][f"w:{d}"]) for d in ("noise", "easy", "markov")] == [1.0, 0.0, 0.0]


def test_a_sweep_killed_mid_run_resumes_to_the_same_tables(stores, whole, tmp_path):
    """SIGKILL once run 1 has written a checkpoint: the resumed sweep keeps run 0, resumes run 1
    from its checkpoint and ends with the uninterrupted sweep's tables, byte for byte."""
    root = tmp_path / "killed"
    sets = sweep_sets(root, "sweep.stacked=false", "checkpoint.every=1", "checkpoint.keep=10")
    path = config_path(stores, tmp_path / "cfg")
    args = [a for s in sets for a in ("--set", s)]
    cmd = [sys.executable, "-m", "doremi", "sweep", str(path), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not checkpoint_dir(root / "runs" / "0001", 2).exists():
        assert proc.poll() is None and time.time() < deadline, "the sweep ended before it could be killed"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(read_table(root / FINAL_FILE)) < 6  # killed mid-way
    assert main(["sweep", str(path), *args]) == 0
    for name in (MIXTURES_FILE, LOSSES_FILE, FINAL_FILE):
        assert (root / name).read_text() == (whole / name).read_text(), name


def test_a_sweep_under_changed_keys_is_refused(stores, whole, tmp_path, capsys):
    root = tmp_path / "copy"
    shutil.copytree(whole, root)
    path = config_path(stores, tmp_path / "cfg")
    args = [a for s in sweep_sets(root, "sweep.stacked=false", "train.lr=0.01") for a in ("--set", s)]
    before = {p: p.read_bytes() for p in root.rglob("*.csv")}
    assert main(["sweep", str(path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a sweep made under other keys is there: train.lr" in err[0]
    assert {p: p.read_bytes() for p in root.rglob("*.csv")} == before  # nothing touched


def test_stacked_runs_give_the_tables_of_runs_one_by_one(stores, whole, tmp_path):
    """The same sweep trained stacked, in chunks of 4 and 2 (trainer/stacked/): the same
    mixtures, and every loss within 1e-5 relative of the runs one by one."""
    root = tmp_path / "stacked"
    run_sweep(config(stores, root / "cfg", *sweep_sets(root, "sweep.stacked=true", "sweep.chunk_size=4")))
    want, got = tables(whole), tables(root)
    assert got[MIXTURES_FILE] == want[MIXTURES_FILE]
    for name in (LOSSES_FILE, FINAL_FILE):
        assert [r["run"] for r in got[name]] == [r["run"] for r in want[name]]
        for a, b in zip(want[name], got[name]):
            for col in ("noise", "easy", "markov", "mean", "worst"):
                assert float(b[col]) == pytest.approx(float(a[col]), rel=1e-5), (name, a["run"], col)


def test_a_sweep_reports_each_chunk_on_stderr_and_stdout_is_unchanged(stores, tmp_path, capsys, monkeypatch):
    """DOREMI_PROGRESS_SECONDS small: a line after every step of a stacked chunk and after the
    chunk, with its place in the sweep, its runs and mixtures, time spent and left; stdout as
    without progress."""
    path = config_path(stores, tmp_path / "cfg")
    outs = {}
    for seconds in ("0", "0.000001"):
        monkeypatch.setenv("DOREMI_PROGRESS_SECONDS", seconds)
        root = tmp_path / "root"
        shutil.rmtree(root, ignore_errors=True)
        args = [a for s in sweep_sets(root, "sweep.stacked=true", "sweep.chunk_size=4") for a in ("--set", s)]
        assert main(["sweep", str(path), *args]) == 0
        outs[seconds] = capsys.readouterr()
    assert outs["0"].out == outs["0.000001"].out
    lines = [line.rsplit(":", 1) for line in outs["0.000001"].err.splitlines() if line.startswith("sweep ")]
    chunks = ["runs 0-3 (dirichlet, one_hot)", "runs 4-5 (one_hot)"]
    assert [head for head, _ in lines] == [
        *(f"sweep {chunks[0]}: step {i}/4" for i in range(1, 5)),
        f"sweep 4/6 {chunks[0]}",
        *(f"sweep {chunks[1]}: step {i}/4" for i in range(1, 5)),
        f"sweep 6/6 {chunks[1]}",
    ]
    assert all(" elapsed, ETA " in tail for _, tail in lines)
    assert all(lines[i][1].endswith(" elapsed, ETA 0 s") for i in (3, 8, 9))  # each chunk's last step, the sweep's end
    assert not any(line.startswith("sweep ") for line in outs["0"].err.splitlines())


@pytest.mark.parametrize(
    "method, sets",
    [("mixing_law", ["fit.mixing_law.variant=direct"]), ("regmix", ["fit.regressor=ridge", "fit.simulations=500"])],
)
def test_fit_proposes_a_capped_mixture_with_its_provenance(stores, whole, tmp_path, capsys, method, sets):
    """`doremi fit`: the proposal within the epoch caps of the run's budget, its held-out metrics
    and the sweep's compute in the weights file."""
    import json

    path = config_path(stores, tmp_path / "cfg")
    out = tmp_path / f"{method}.json"
    args = [a for s in [*sweep_sets(whole), "fit.max_epochs=0.5", "fit.folds=2", *sets] for a in ("--set", s)]
    assert main(["fit", str(path), "--method", method, "--out", str(out), *args]) == 0
    doc = json.loads(out.read_text())
    assert doc["method"] == method and doc["n_runs"] == 6
    if method == "regmix":
        assert doc["held_out"]["folds"] == 2 and "held_out_skipped" not in doc
    else:  # a fold's 3 runs cannot fit a law of 3 domains: said, not hidden
        assert "held_out" not in doc and doc["held_out_skipped"].startswith("mixing law: 3 runs are too few")
    assert doc["compute"]["runs"] == 6 and doc["compute"]["flops"] > 0
    assert all(w <= c + 1e-9 for w, c in zip(doc["weights"], doc["caps"]))
    assert f"{method} weights:" in capsys.readouterr().out


def test_fit_of_too_few_runs_is_one_line(stores, whole, tmp_path, capsys):
    path = config_path(stores, tmp_path / "cfg")
    root = tmp_path / "small"
    run_sweep(config(stores, root / "cfg", *sweep_sets(root, "sweep.designs=[dirichlet]")))
    args = [a for s in sweep_sets(root, "fit.mixing_law.variant=direct") for a in ("--set", s)]
    assert main(["fit", str(path), "--method", "mixing_law", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["doremi fit: error: mixing law: 3 runs are too few for 3 domains; expected at least 5"]
    assert not (root / "mixing_law.json").exists()


# -- the caps of sweep.max_epochs, in the unit a run reads -------------------------------------------

#: A sweep whose runs read more than a pool: 150 steps x 8 = 1200 sequences, pools of 642, 642 and
#: 1484 sequences (26955, 26955, 53909 train tokens at seq_len 32, 200 held out each). At 1 epoch
#: the caps in sequences are (642 - 1) / 1200 = 0.534 for noise and easy; counted in tokens they
#: were 26955 / (1200 x 32) = 0.702, which lets a run read 1.31 epochs of noise.
CAPPED = (
    "data.holdout_sequences=200",
    "train.steps=150",
    "sweep.max_epochs=1",
    "sweep.designs=[dirichlet, grid, one_hot]",
    "sweep.grid_steps=10",
    "sweep.runs=32",
)


def token_caps(cfg, manifest) -> np.ndarray:
    """The caps `doremi sweep` drew its design under before it counted sequences: train tokens
    over the run's token budget."""
    from doremi.offline.fit.design import epoch_caps

    return epoch_caps([d.train.tokens for d in manifest.domains], cfg.budget_tokens, cfg.sweep.max_epochs)


def realised_epochs(cfg, weights: np.ndarray) -> np.ndarray:
    """[n, k]: the epochs each run's sampler reads over the run, built as a stacked sweep run
    builds it (trainer/stacked/feed.py over trainer/feed/data_feed.py's pools) and drawn for every
    step of the run."""
    from data.sampling.weights import resolve_weights
    from trainer.feed.data_feed import DataFeed
    from trainer.parallel.context import ParallelContext
    from trainer.stacked.feed import StackedFeed

    t = cfg.train
    feed = DataFeed(cfg.data, t.global_batch_size, t.micro_batches, ParallelContext.single(), seed=cfg.data.seed)
    rows = np.stack([resolve_weights(row.tolist(), feed.manifest) for row in weights])
    stacked = StackedFeed(feed, rows, t.micro_batches)
    for sampler, w in zip(stacked.samplers, stacked.weights):
        for step in range(t.steps):
            sampler.global_batch(step, w)
    return np.array([s.epochs() for s in stacked.samplers])


def test_the_design_is_capped_in_sequences_over_the_pools_and_no_run_reads_past_the_cap(stores, tmp_path, monkeypatch):
    from data.sampling.pools import pool_sizes
    from data.store.store import read_manifest
    from doremi.offline import sweep

    cfg = config(stores, tmp_path / "cfg", *sweep_sets(tmp_path / "sweep", *CAPPED))
    manifest = read_manifest(cfg.data.store_dir)
    assert [d.train.tokens for d in manifest.domains] == [26955, 26955, 53909]
    assert pool_sizes(cfg.data) == [642, 642, 1484]
    caps = sweep.sequence_caps([642, 642, 1484], 1200, 1.0, manifest.domain_names, "sweep.max_epochs")
    assert caps.tolist() == [641 / 1200, 641 / 1200, 1.0]
    new = sweep.design(cfg, manifest)
    assert np.all(new.weights <= caps + 1e-6)
    assert new.names.count("one_hot") == 1 and new.weights[new.names.index("one_hot")].tolist() == [0.0, 0.0, 1.0]
    monkeypatch.setattr(sweep, "sequence_caps", lambda *args: token_caps(cfg, manifest))
    old = sweep.design(cfg, manifest)
    # the grid rows with 0.6 or 0.7 on noise or easy: within the token caps, beyond the pools
    assert old.names.count("grid") - new.names.count("grid") == 18
    read_old, read_new = realised_epochs(cfg, old.weights), realised_epochs(cfg, new.weights)
    assert read_old.max() == pytest.approx(840 / 642, abs=1 / 642)  # a grid row of 0.7 on noise
    assert read_new.max() <= 1.0
    assert read_new.max() >= 600 / 642  # the grid's 0.5 on noise: the caps do not bind below them


def test_a_sweep_made_under_another_design_is_refused_and_start_over_moves_it(stores, tmp_path, monkeypatch, capsys):
    """The directory of a sweep whose design was drawn under the token caps, resumed with the same
    keys: refused with one line naming it and the first mixture that differs, nothing touched;
    `checkpoint.start_over: true` moves it aside and starts the design computed now."""
    import json

    from data.store.store import read_manifest
    from doremi.offline import sweep

    root = tmp_path / "sweep"
    path = config_path(stores, tmp_path / "cfg")
    cfg = config(stores, tmp_path / "cfg", *sweep_sets(root, *CAPPED))
    manifest = read_manifest(cfg.data.store_dir)
    with monkeypatch.context() as m:
        m.setattr(sweep, "sequence_caps", lambda *args: token_caps(cfg, manifest))
        sweep.Sweep(cfg).open()  # the directory as the sweep made it before its caps counted sequences

    def files() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in root.iterdir() if p.name != ".lock"}  # the lock: rundir.locked's

    before = files()
    args = [a for s in sweep_sets(root, *CAPPED) for a in ("--set", s)]
    assert main(["sweep", str(path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{root}: its saved design differs from the one these keys give now (" in err[0]
    assert re.search(r"\(\d+ mixtures saved, \d+ now; \d+ differ, the first run \d+: \w+ [0-9.e-]+ saved, ", err[0])
    assert err[0].endswith(" now) (checkpoint.start_over: true moves it aside)")
    assert files() == before
    again = config(stores, tmp_path / "cfg", *sweep_sets(root, *CAPPED, "checkpoint.start_over=true"))
    fresh = sweep.Sweep(again)
    fresh.open()
    assert f"{root}: checkpoint.start_over: the previous sweep was moved to " in capsys.readouterr().out
    assert json.loads((root / "sweep.json").read_text())["design"] == json.loads(json.dumps(fresh.design.rows()))
    sweep.Sweep(cfg).open()  # the same design again: accepted


def test_a_fit_caps_its_proposal_in_the_main_runs_sequences(stores, whole, tmp_path):
    """`fit.max_epochs` counts what the main run will read: sequences over its pools, one of
    slack, so that run reads the proposal unchanged under `data.max_epochs`. At 0.4347 epochs of
    a main run of 1200 sequences over pools of 642, 642 and 1484 the caps, (0.4347 pool - 1) /
    1200, sum to 1.0002: every proposal sits at them. Counted in tokens they were 0.305, 0.305,
    0.610, and noise at 0.305 reads (0.305 x 1200 + 1) / 642 = 0.57 epochs."""
    import json

    from data.sampling.mixtures import sequence_capped

    path = config_path(stores, tmp_path / "cfg")
    out = tmp_path / "fit.json"
    max_epochs, pools = 0.4347, [642, 642, 1484]
    caps = [(max_epochs * n - 1) / 1200 for n in pools]
    main_run = CAPPED[:2]  # 150 steps x 8 sequences, 200 held out of each domain
    sets = [
        *sweep_sets(whole),
        *main_run,
        f"fit.max_epochs={max_epochs}",
        "fit.folds=2",
        "fit.mixing_law.variant=direct",
    ]
    args = [a for s in sets for a in ("--set", s)]
    assert main(["fit", str(path), "--method", "mixing_law", "--out", str(out), *args]) == 0
    doc = json.loads(out.read_text())
    assert doc["caps"] == pytest.approx(caps, rel=0, abs=1e-15)
    assert doc["caps_counted"] == {"unit": "sequences", "pools": pools, "run_sequences": 1200, "slack": 1.0}
    assert np.all(np.array(doc["weights"]) <= np.array(caps) + 1e-9) and sum(caps) - 1 < 3e-4
    run = config(stores, tmp_path / "main", *main_run, f"data.max_epochs={max_epochs}")
    assert realised_epochs(run, np.array([doc["weights"]])).max() <= max_epochs
    read = sequence_capped(doc["weights"], pools, 1200, max_epochs)
    np.testing.assert_allclose(read, doc["weights"], rtol=0, atol=1e-12)  # the main run's cap moves nothing
