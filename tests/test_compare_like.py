"""Comparisons compare like with like (issue 41, item 6): `doremi compare` refuses roots that
differ in more than their seeds, naming the keys, shows each seed's weights; a pipeline does not
train a main run on a fit that ranks held-out runs badly; `doremi train` on a pipeline config says
what it trains, or applies `pipeline.main` when asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from data import artifact
from doremi.errors import DoReMiError
from doremi.study.compare import compare_roots, differences, is_seed, settings

DOMAINS = ["noise", "easy", "markov"]


def _root(path: Path, stores: Path, seed: int, eta: float = 1.0, steps: int = 20, tuned=(0.2, 0.3, 0.5)) -> Path:
    """A pipeline root as `doremi compare` reads it: round1/proxy and main/{doremi,uniform}, each
    with its saved config.yaml and eval result (losses made up, differing by seed)."""
    (path / "round1" / "proxy").mkdir(parents=True)
    (path / "weights.json").write_text(json.dumps({"domains": DOMAINS, "weights": list(tuned)}))
    base = {
        "train": {"seed": seed, "steps": steps, "run_dir": "x", "lr": 0.001},
        "data": {"seed": seed, "store_dir": str(stores), "domain_weights": "uniform"},
        "doremi": {"eta": eta, "reference": str(path / "round1" / "reference")},
        "logging": {"every": seed},  # not a result key: never a difference
    }
    proxy = {**base, "train": {**base["train"], "steps": 10}}
    (path / "round1" / "proxy" / "config.yaml").write_text(yaml.safe_dump(proxy))
    for name, weights, losses in (
        ("uniform", "uniform", [3.0 + seed / 10, 2.0, 1.0]),
        ("doremi", str(path / "weights.json"), [2.9 + seed / 10, 2.1, 0.9]),
    ):
        run = path / "main" / name
        run.mkdir(parents=True)
        cfg = {**base, "data": {**base["data"], "domain_weights": weights}}
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        (run / "metrics.jsonl").write_text(json.dumps({"step": steps, "val_loss": dict(zip(DOMAINS, losses))}) + "\n")
        result = {"domains": DOMAINS, "val_loss": losses}
        (run / "eval.json.stage.json").write_text(json.dumps({"stage": "eval", "fingerprint": "x", "result": result}))
    return path


def test_seeds_are_the_keys_allowed_to_differ():
    assert is_seed("train.seed") and is_seed("data.seed") and is_seed("data.split_seed") and is_seed("sweep.seed")
    assert not is_seed("mixing.doremi.eta") and not is_seed("train.steps")


def test_roots_differing_in_eta_and_main_steps_are_refused_naming_the_keys(stores, tmp_path):
    """The issue's case: two roots run with another eta and other main steps were pooled as
    "2 seeds" (+0.0022 ± 0.1369)."""
    a = _root(tmp_path / "seed1", stores, 1, eta=1.0, steps=20)
    b = _root(tmp_path / "seed2", stores, 2, eta=3.0, steps=40)
    with pytest.raises(DoReMiError) as e:
        compare_roots([a, b], tmp_path / "out")
    msg = str(e.value)
    assert msg.startswith(
        "compare: the roots differ in more than their seeds: mixing.doremi.eta (seed1: 1.0, seed2: 3.0); "
    )
    assert "train.steps in main/doremi, main/uniform (seed1: 20, seed2: 40)" in msg
    assert msg.endswith("(--allow-differences compares them anyway)") and "\n" not in msg
    assert "train.seed" not in msg and "data.seed" not in msg and "logging" not in msg
    assert not (tmp_path / "out").exists()


def test_allow_differences_goes_on_and_shows_them(stores, tmp_path):
    a = _root(tmp_path / "seed1", stores, 1, eta=1.0)
    b = _root(tmp_path / "seed2", stores, 2, eta=3.0)
    text = compare_roots([a, b], tmp_path / "out", allow_differences=True)
    roots = text.split("## Roots")[1].split("##")[0]
    assert "| root | train.seed | data.seed | mixing.doremi.eta |" in roots
    assert "| seed1 | 1 | 1 | 1.0 |" in roots and "| seed2 | 2 | 2 | 3.0 |" in roots
    assert "- the roots differ in 1 key(s) besides their seeds (table 'Roots')" in text


def test_roots_differing_in_seeds_only_compare_and_show_each_seeds_weights(stores, tmp_path):
    a = _root(tmp_path / "seed1", stores, 1, tuned=(0.2, 0.3, 0.5))
    b = _root(tmp_path / "seed2", stores, 2, tuned=(0.6, 0.3, 0.1))
    text = compare_roots([a, b], tmp_path / "out")
    weights = text.split("## Weights per seed")[1].split("##")[0]
    assert "| mixture | root | noise | easy | markov |" in weights
    assert "| doremi | seed1 | 0.2000 | 0.3000 | 0.5000 |" in weights
    assert "| doremi | seed2 | 0.6000 | 0.3000 | 0.1000 |" in weights
    assert "| uniform | seed2 | 0.3333 | 0.3333 | 0.3333 |" in weights
    assert "| doremi | 2 | -0.0333 ± 0.0000 | -0.1000 ± 0.0000 |" in text


def test_paths_inside_a_root_compare_relative_to_it(stores, tmp_path):
    a = settings(_root(tmp_path / "seed1", stores, 1))
    assert a["main/doremi"]["data.domain_weights"] == "<root>/weights.json"
    assert a["round1/proxy"]["mixing.doremi.reference"] == "<root>/round1/reference"
    assert "train.seed" not in a["main/doremi"] and "logging.every" not in a["main/doremi"]
    b = settings(_root(tmp_path / "seed2", stores, 2))
    assert differences({"seed1": a, "seed2": b}) == []


def test_cli_compare_refusal_is_one_line_and_exit_2(stores, tmp_path, capsys):
    from doremi.commands.cli import main

    a = _root(tmp_path / "seed1", stores, 1, eta=1.0)
    b = _root(tmp_path / "seed2", stores, 2, eta=3.0)
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("doremi compare: error: compare: the roots differ")
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "out"), "--allow-differences"]) == 0
    assert "| seed2 | 2 | 2 | 3.0 |" in capsys.readouterr().out


# -- the fit guardrail ---------------------------------------------------------------------------


def _bad_fit(path: Path, rho: float | None = -0.74, held: bool = True) -> Path:
    from doremi.offline.fit.evaluate import HeldOut
    from doremi.offline.provenance import proposal_provenance, write_proposal

    provenance = proposal_provenance(
        method="regmix",
        n_runs=16,
        held_out=HeldOut(float("nan") if rho is None else rho, 0.05, 5, 16, 0) if held else None,
        seed=0,
        extra=None if held else {"held_out_skipped": "3 runs are too few for 2 folds"},
    )
    return write_proposal(path, DOMAINS, [0.998, 0.001, 0.001], provenance)


def test_check_fit_quality(tmp_path):
    from doremi.offline.propose import FitQualityError, check_fit_quality

    good = _bad_fit(tmp_path / "good.json", 0.81)
    assert check_fit_quality("regmix", good, 0.3) == "held-out Spearman 0.810, mean abs error 0.05 (16 runs, 5 folds)"
    bad = _bad_fit(tmp_path / "bad.json")
    with pytest.raises(FitQualityError) as e:
        check_fit_quality("regmix", bad, 0.3)
    assert str(e.value).startswith(
        f"regmix: fit {bad}: held-out Spearman -0.740, mean abs error 0.05 (16 runs, 5 folds), below "
        "pipeline.guardrails.min_fit_spearman 0.3: its proposal is not trained on;"
    )
    assert check_fit_quality("regmix", bad, -0.8).startswith("held-out Spearman -0.740")
    for other in (_bad_fit(tmp_path / "flat.json", None), _bad_fit(tmp_path / "small.json", held=False)):
        with pytest.raises(FitQualityError):
            check_fit_quality("regmix", other, 0.3)
        check_fit_quality("regmix", other, -1)  # -1 takes any fit


def test_pipeline_does_not_train_on_a_fit_that_ranks_badly(stores, tmp_path, monkeypatch, capsys):
    """The issue's case: a RegMix fit with held-out Spearman -0.74 proposed a 0.998 one-hot
    mixture and the pipeline trained the main run on it, the report silent about the fit. Now
    the pipeline stops before the main runs; with the threshold lowered it trains, and the
    report shows the fit's quality."""
    from doremi.offline.propose import FitQualityError
    from doremi.pipeline import pipeline
    from tests.runs import config_path

    (tmp_path / "sweep").mkdir()
    monkeypatch.setattr(pipeline.Pipeline, "sweep", lambda self: tmp_path / "sweep")
    monkeypatch.setattr(pipeline, "propose", lambda cfg, name, out, sweep, budget, **kw: _bad_fit(Path(out)))
    root = tmp_path / "root"
    path = config_path(stores, tmp_path / "unused")
    sets = [f"pipeline.run_dir={root}", "pipeline.methods=[regmix]", "pipeline.baselines=[uniform]", "train.steps=2"]
    with pytest.raises(FitQualityError, match=r"^regmix: fit .*held-out Spearman -0.740"):
        pipeline.run_pipeline(path, sets)
    assert not (root / "main").exists()
    stopped = artifact.read(root)
    assert (stopped.kind, stopped.status, stopped.sources[0].kind) == ("pipeline", "interrupted", "stores")
    pipeline.run_pipeline(path, [*sets, "pipeline.guardrails.min_fit_spearman=-1"])
    assert sorted(p.name for p in (root / "main").iterdir()) == ["regmix", "uniform"]
    done = artifact.read(root)
    assert done.status == "finished" and done.fingerprint != stopped.fingerprint  # another experiment
    made = json.loads((root / "artifact.json").read_text())  # what made it, for a reader months later
    assert made["command"].startswith("doremi") and made["environment"]["torch"] == torch.__version__
    assert "commit" in made["environment"] and made["config"]["pipeline"]["run_dir"] == str(root)
    from doremi.commands.cli import main

    capsys.readouterr()
    assert main(["verify", str(root)]) == 0  # the root, then every artifact inside it
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"ok pipeline {root}: pipeline finished" and sum(x.startswith("ok run ") for x in lines) >= 2
    report = (root / "report.md").read_text()
    section = report.split("## Offline fits: held-out quality")[1].split("\n## ")[0]
    assert (
        "| regmix | 16 | 5 | -0.740 | 0.05 | below 0.3: trained on as pipeline.guardrails.min_fit_spearman is -1 |"
        in section
    )


# -- doremi train on a pipeline config -----------------------------------------------------------


def test_train_on_a_pipeline_config_says_what_it_trains_or_applies_pipeline_main(stores, tmp_path, capsys):
    """`doremi train CONFIG` on a config with `pipeline.main` silently trained the proxy-sized
    model; now it says so in one note line, and `--pipeline-main` trains the main model."""
    from doremi.commands.cli import main
    from tests.runs import config_path

    path = config_path(stores, tmp_path / "unused")
    sets = ["--set", "pipeline.main.model.n_layers=2", "--set", "pipeline.main.train.steps=2", "--set", "train.steps=1"]
    own, big = tmp_path / "own", tmp_path / "main"
    assert main(["train", str(path), *sets, "--set", f"train.run_dir={own}"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note" in line]
    assert notes == [
        f"doremi train: note: {path} has a pipeline.main section, not applied: this trains the config's own "
        "model (d_model 64, 4 layers, 1 steps); --pipeline-main trains the pipeline's main model"
    ]
    assert yaml.safe_load((own / "config.yaml").read_text())["model"]["n_layers"] == 4
    assert main(["train", str(path), *sets, "--set", f"train.run_dir={big}", "--pipeline-main"]) == 0
    assert not [line for line in capsys.readouterr().err.splitlines() if "note" in line]
    saved = yaml.safe_load((big / "config.yaml").read_text())
    assert saved["model"]["n_layers"] == 2 and saved["train"]["steps"] == 2


def test_a_pipeline_root_carries_its_header_and_compare_refuses_another_kind(tmp_path):
    """The root of `doremi pipeline` is an artifact like the others (data/artifact.py): running,
    then finished, with the experiment's fingerprint and its stores; `doremi compare` refuses a
    directory whose header says it is something else."""
    from data import artifact
    from doremi.errors import DoReMiError
    from doremi.study.compare import read_root

    root = tmp_path / "root"
    root.mkdir()
    artifact.write(root, artifact.Header("run", status="finished"))
    with pytest.raises(artifact.ArtifactError, match="holds a run, expected a pipeline run root"):
        read_root(root)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DoReMiError, match="not a pipeline run"):
        read_root(empty)
