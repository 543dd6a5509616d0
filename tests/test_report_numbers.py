"""The report's numbers are the runs' numbers: a tiny pipeline (DoReMi-free: ODM's proxy, RegMix
on a small sweep, ADO online, a uniform baseline) whose report.md is checked against the files
its runs wrote; the online run's mixture is the one it sampled; the sweep's runs are guarded;
`doremi compare` never pairs an unfinished run."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from doremi.errors import DoReMiError
from doremi.reports.guardrails import findings, format_guardrail_table, measure_pipeline, measure_sweep
from doremi.reports.summary import weight_histories
from doremi.study.compare import MainRun, compare, compare_roots
from tests.paths import QUICKSTART
from trainer.records.metrics import read_jsonl

TINY = [
    "train.steps=4",
    "train.eval_every=2",
    "train.eval_sequences=8",
    "logging.progress=false",
    "logging.every=1",
    "checkpoint.every=0",
    "data.tokenizer.vocab_size=512",  # the logits are most of a width-16 model's work
    "model.vocab_size=512",
    "model.d_model=16",
    "model.n_layers=1",
    "model.ffn_dim=32",
    "pipeline.main.train.steps=6",
    "pipeline.main.model.d_model=16",
    "pipeline.main.model.n_layers=1",
    "pipeline.main.model.ffn_dim=32",
    "pipeline.methods=[odm, regmix]",
    "pipeline.online=[ado]",
    "pipeline.baselines=[uniform]",
    "mixing.ado.warmup=1",
    "mixing.ado.refit_every=1",
    "mixing.ado.record_every=1",
    "sweep.runs=1",
    "sweep.eval_points=2",
    "sweep.designs=[dirichlet, one_hot]",
    "fit.regressor=ridge",
    "fit.simulations=200",
    "fit.top_k=10",
    "pipeline.guardrails.min_fit_spearman=-1",  # 4 sweep runs: too few to check the fit on held-out runs
]


def _rows(section: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = [l for l in section.splitlines() if l.startswith("| ")]
    cells = [[c.strip() for c in l.strip().strip("|").split("|")] for l in lines]
    return cells[0], {c[0].strip("*"): c for c in cells[1:]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from doremi.pipeline.pipeline import run_pipeline

    root = tmp_path_factory.mktemp("numbers")
    run_pipeline(QUICKSTART, [*TINY, f"pipeline.run_dir={root / 'run'}", f"data.store_dir={root / 'stores'}"])
    run = root / "run"
    return run, (run / "report.md").read_text()


def test_loss_table_is_the_eval_results(tiny):
    run, report = tiny
    header, rows = _rows(report.split("## Mixtures and final validation loss")[1].split("\n## ")[0])
    mains = sorted(p.name for p in (run / "main").iterdir())
    assert mains == ["ado-online", "odm", "regmix", "uniform"]
    for m in mains:
        result = json.loads((run / "main" / m / "eval.json.stage.json").read_text())["result"]
        last = [r for r in read_jsonl(run / "main" / m / "metrics.jsonl") if "val_loss" in r][-1]
        assert last["step"] == 6
        for d, loss in zip(result["domains"], result["val_loss"]):
            assert loss == pytest.approx(last["val_loss"][d], abs=1e-12)
            assert float(rows[d][header.index(f"loss: {m}")]) == pytest.approx(loss, abs=5e-5)
        assert float(rows["average"][header.index(f"loss: {m}")]) == pytest.approx(
            np.mean(result["val_loss"]), abs=5e-5
        )
        assert float(rows["worst case"][header.index(f"loss: {m}")]) == pytest.approx(max(result["val_loss"]), abs=5e-5)


def test_weights_are_the_weights_files_and_the_online_run_what_it_sampled(tiny):
    run, report = tiny
    header, rows = _rows(report.split("## Mixtures and final validation loss")[1].split("\n## ")[0])
    for m in ("odm", "regmix"):
        doc = json.loads((run / "methods" / m / "weights.json").read_text())
        for d, w in zip(doc["domains"], doc["weights"]):
            assert float(rows[d][header.index(f"weight: {m}")]) == pytest.approx(w, abs=5e-5)
    history = read_jsonl(run / "main" / "ado-online" / "domain_weights.jsonl")
    # ADO logs the policy for the next step as `weights`: the run sampled with `sampling`
    assert history[-1]["weights"] != history[-1]["sampling"]
    sampled = np.mean([h["sampling"] for h in history], axis=0)
    for d, w in zip(history[0]["domains"], sampled):
        assert float(rows[d][header.index("weight: ado-online")]) == pytest.approx(w, abs=5e-5)
    plotted = weight_histories(run)
    assert plotted["ado-online"] == [h["sampling"] for h in history]
    assert plotted["odm"] == [
        h["weights"] for h in read_jsonl(run / "methods" / "odm" / "proxy" / "domain_weights.jsonl")
    ]


def _fpt_tokens(run: Path) -> tuple[int, int]:
    from trainer.config.schema import ModelConfig
    from trainer.config.tools import from_dict
    from trainer.model.flops import flops_per_token

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    fpt = flops_per_token(from_dict(ModelConfig, cfg["model"], "model"), cfg["data"]["seq_len"])
    return fpt, cfg["train"]["steps"] * cfg["train"]["global_batch_size"] * cfg["data"]["seq_len"]


def test_ledger_is_the_formula_on_the_runs(tiny):
    run, report = tiny
    section = report.split("## Compute spent to find each mixture")[1].split("\n## ")[0]
    _, rows = _rows(section)
    for name, path in (("odm", run / "methods" / "odm" / "proxy"), ("ado-online", run / "main" / "ado-online")):
        fpt, tokens = _fpt_tokens(path)
        last = [r for r in read_jsonl(path / "metrics.jsonl") if "realised" in r][-1]
        drawn = sum(last["realised"]["tokens"].values())
        assert rows[name][1:8] == [
            f"{fpt * tokens:.3g}",
            "0",
            "0",
            "0",
            f"{fpt * tokens:.3g}",
            f"{tokens:.3g}",
            f"{drawn:.3g}",
        ]
        assert rows[name][9] == "0.0"  # of which validation seconds: it asked for no pass
    sweep = json.loads((run / "sweep" / "sweep.json").read_text())
    keys, n = sweep["keys"], len(sweep["finished"])
    fpt, _ = _fpt_tokens(run / "methods" / "odm" / "proxy")  # the proxy-size model the sweep trains
    train = n * keys["train.steps"] * keys["train.global_batch_size"] * keys["data.seq_len"]
    evals = n * 2 * 6 * keys["train.eval_sequences"] * keys["data.seq_len"]  # steps 2 and 4, 6 domains
    assert rows["regmix"][1:8] == [
        f"{fpt * train:.3g}",
        "0",
        "0",
        f"{fpt / 3 * evals:.3g}",
        f"{fpt * train + fpt / 3 * evals:.3g}",
        f"{train + evals:.3g}",
        "",
    ]
    assert rows["regmix"][9] == ""  # a sweep's evaluations are not timed apart
    assert "regmix: the fit of one shared sweep of small runs; the row shows the whole sweep; its stacked" in section


def test_the_report_lists_what_each_method_read(tiny):
    """Each method's declared reads (its spec's `reads`, issue 35 point 3), by its run's name."""
    _, report = tiny
    section = report.split("## What each method read")[1].split("\n## ")[0]
    _, rows = _rows(section)
    assert {name: row[1] for name, row in rows.items()} == {
        "odm": "training batches' losses",
        "regmix": "dev validation (sweep_run), a sweep's losses",
        "ado-online": "training batches' losses",
    }


def test_guardrails_cover_every_main_run_the_online_run_and_the_sweep(tiny):
    run, report = tiny
    checked = [line.split("|")[1].strip() for line in report.splitlines() if line.startswith("| epochs")]
    assert checked == [
        "epochs: methods/odm/proxy",
        "epochs: main/ado-online",
        "epochs: main/odm",
        "epochs: main/regmix",
        "epochs: main/uniform",
        "epochs, most over the sweep's 7 runs: sweep",
    ]


# -- the sweep's guardrail, on numbers by hand ------------------------------------------------


def _sweep(path: Path, mixtures: list[list[float]], finished: list[int]) -> Path:
    path.mkdir(parents=True)
    keys = {"train.steps": 10, "train.global_batch_size": 8, "data.seq_len": 4, "data.holdout_sequences": 2}
    (path / "sweep.json").write_text(json.dumps({"keys": keys, "finished": finished}))
    with (path / "mixtures.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "design", "big", "tiny"])
        for i, m in enumerate(mixtures):
            w.writerow([i, "one_hot", *m])
    return path


# big: (401 - 1) // 4 = 100 sequences, 98 after the 2 held out; tiny: (41 - 1) // 4 - 2 = 8
MANIFEST = SimpleNamespace(
    domains=[
        SimpleNamespace(name="big", train=SimpleNamespace(tokens=401)),
        SimpleNamespace(name="tiny", train=SimpleNamespace(tokens=41)),
    ]
)


def test_sweep_runs_epochs_and_a_tiny_domain_read_many_epochs_fires(tmp_path):
    sweep = _sweep(tmp_path / "sweep", [[0.75, 0.25], [0.0, 1.0], [1.0, 0.0]], finished=[0, 1])
    measures = measure_sweep(sweep, MANIFEST)
    assert [m.run for m in measures] == ["sweep/run 0", "sweep/run 1"]  # run 2 did not finish
    # 80 sequences per run: 60 / 98 and 20 / 8 epochs; 0 and 80 / 8
    assert measures[0].epochs == pytest.approx({"big": 60 / 98, "tiny": 2.5}, abs=1e-12)
    assert measures[1].epochs == pytest.approx({"big": 0.0, "tiny": 10.0}, abs=1e-12)
    cfg = __import__("doremi.config", fromlist=["GuardrailConfig"]).GuardrailConfig()
    found = [f.message for m in measures for f in findings(m, cfg) if f.is_warning]
    assert found == [
        "sweep/run 0: tiny: epochs read 2.5 > max_epochs 2",
        "sweep/run 1: tiny: epochs read 10 > max_epochs 2",
    ]
    table = format_guardrail_table(["big", "tiny"], measures)
    assert "| epochs, most over the sweep's 2 runs: sweep | 0.6122 | 10.0000 |" in table
    assert "their epochs are their mixtures'" in table


def test_sweep_without_manifest_is_one_note_and_measure_pipeline_includes_the_sweep(tmp_path):
    _sweep(tmp_path / "sweep", [[0.5, 0.5]] * 3, finished=[0, 1, 2])
    alone = measure_pipeline(tmp_path)
    assert len(alone) == 1 and alone[0].notes == [
        "sweep: the stores' manifest was not found; its runs' epochs check skipped"
    ]
    assert [m.kind for m in measure_pipeline(tmp_path, manifest=MANIFEST)] == ["sweep"] * 3


# -- doremi compare and unfinished runs -------------------------------------------------------

D = ["a", "b"]


def _run(path: Path, final: list[float], step: int, planned: int, marker: bool) -> None:
    path.mkdir(parents=True)
    rows = [{"step": s, "val_loss": dict(zip(D, final))} for s in range(2, step + 1, 2)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": planned}}))
    if marker:
        doc = {"stage": "eval", "fingerprint": "x", "result": {"domains": D, "val_loss": final}}
        (path / "eval.json.stage.json").write_text(json.dumps(doc))


def test_compare_leaves_an_unfinished_run_out_and_says_so(tmp_path):
    for seed, off in (("s1", 0.0), ("s2", 0.5)):
        _run(tmp_path / seed / "main" / "uniform", [2.0 + off, 3.0 + off], 8, 8, True)
        _run(tmp_path / seed / "main" / "tokens", [1.0 + off, 4.0 + off], 8, 8, True)
    # s2's doremi stopped at step 6 of 8: its last validation row is not a final loss
    _run(tmp_path / "s1" / "main" / "doremi", [1.5, 3.0], 8, 8, True)
    _run(tmp_path / "s2" / "main" / "doremi", [0.0, 0.0], 6, 8, False)
    text = compare_roots([tmp_path / "s1", tmp_path / "s2"], tmp_path / "out")
    assert "| doremi | 1 | -0.2500 | +0.0000 |" in text
    assert "| tokens | 2 | +0.0000 ± 0.0000 | +1.0000 ± 0.0000 |" in text
    assert "- s2/main/doremi: unfinished (final loss at step 6 of 8); left out" in text
    assert "- doremi: compared over 1 of 2 roots\n" in text


def test_compare_unfinished_baseline_leaves_the_root_out_or_fails(tmp_path):
    runs = {
        "r1": {"uniform": MainRun(D, [2.0, 2.0], [], 8, 8), "x": MainRun(D, [1.0, 2.0], [], 8, 8)},
        "r2": {"uniform": MainRun(D, [9.0, 9.0], [], 4, 8), "x": MainRun(D, [1.0, 1.0], [], 8, 8)},
    }
    results, notes = compare(runs, "uniform")
    assert [(p.mixture, p.roots, p.mean_diff) for p in results] == [("x", ["r1"], [-0.5])]
    assert notes[0] == "r2: main/uniform is unfinished (final loss at step 4 of 8); left out of every comparison"
    with pytest.raises(DoReMiError, match=r"--baseline uniform: unfinished in every root"):
        compare({"r2": runs["r2"]}, "uniform")
    # a mixture and its baseline at other steps (no config to say which is unfinished): not paired
    other = {"r3": {"uniform": MainRun(D, [2.0, 2.0], [], 8), "x": MainRun(D, [1.0, 1.0], [], 6)}}
    assert compare(other, "uniform") == ([], ["r3/main/x: final loss at step 6, uniform's at 8; left out"])


def test_compare_says_when_two_roots_ran_the_same_seeds(tmp_path):
    for root in ("a", "b"):
        for name, final in (("uniform", [2.0, 2.0]), ("x", [1.0, 2.0])):
            _run(tmp_path / root / "main" / name, final, 8, 8, True)
            cfg = {"train": {"steps": 8, "seed": 3}, "data": {"seed": 0}}
            (tmp_path / root / "main" / name / "config.yaml").write_text(yaml.safe_dump(cfg))
    text = compare_roots([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert "| x | 2 | -0.5000 ± 0.0000 |" in text
    assert (
        "- a, b: main/uniform ran the same seeds (train.seed 3, data.seed 0): not independent seeds, "
        "so the standard error understates the noise" in text
    )


def test_a_sweep_trained_one_by_one_has_its_drawn_tokens_measured(tmp_path):
    """The ledger's measured tokens of an unstacked sweep: each run's last cumulative `realised`
    counts, summed; a stacked sweep (no run logs) leaves the cell empty."""
    import json as _json

    from doremi.outputs.main_runs import SWEEP_DIR
    from doremi.reports.ledger import sweep_cost

    sweep = tmp_path / SWEEP_DIR
    sweep.mkdir()
    (sweep / "sweep.json").write_text(_json.dumps({"compute": {"train_flops": 6.0, "train_tokens": 10}}))
    assert sweep_cost(tmp_path)["trained_measured"] is None
    for i, counts in enumerate(({"a": 3, "b": 1}, {"a": 2, "b": 2})):
        rows = [{"step": 1, "realised": {"tokens": {"a": 1, "b": 0}}}, {"step": 2, "realised": {"tokens": counts}}]
        (sweep / "runs" / str(i)).mkdir(parents=True)
        (sweep / "runs" / str(i) / "metrics.jsonl").write_text("".join(_json.dumps(r) + "\n" for r in rows))
    assert sweep_cost(tmp_path)["trained_measured"] == 8.0
