"""doremi/study/design.py: the pre-registered numbers of ../shared/study-design.md, and the
study's experiment file (experiments/configs/doremi_study.yaml) equal to them."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import yaml

from doremi.study.design import DESIGN, config_differences, merged

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "configs" / "doremi_study.yaml"


def test_the_design_is_the_costed_one():
    ref, main = DESIGN.reference, DESIGN.main
    assert DESIGN.proxy.shape == ref.shape and DESIGN.proxy.schedule == ref.schedule
    assert (ref.shape.d_model, ref.shape.n_layers, ref.shape.n_heads, ref.shape.ffn_dim) == (384, 6, 6, 1152)
    assert (ref.schedule.steps, ref.schedule.global_batch_size, ref.schedule.seq_len) == (1000, 96, 1024)
    assert (ref.schedule.lr, ref.schedule.warmup_steps, ref.schedule.min_lr) == (1e-3, 100, pytest.approx(1e-4))
    assert ref.schedule.tokens == 98_304_000  # "98M tokens"
    assert (main.shape.d_model, main.shape.n_layers, main.shape.n_heads, main.shape.ffn_dim) == (640, 10, 10, 1792)
    s = main.schedule
    assert (s.steps, s.global_batch_size, s.seq_len, s.lr, s.warmup_steps) == (4400, 32, 1024, 6e-4, 400)
    assert (s.decay, s.min_lr_fraction, s.weight_decay, s.grad_clip) == ("cosine", 0.1, 0.1, 1.0)
    assert s.tokens == 144_179_200  # "144M tokens"
    r = DESIGN.rule
    assert (r.baseline, r.alpha, r.ci_level, r.margin, r.mde, r.power, r.pairs, r.max_se) == (
        "uniform",
        0.05,
        0.95,
        0.01,
        0.02,
        0.8,
        6,
        0.008,
    )
    assert [a.name for a in DESIGN.arms] == ["uniform", "doremi", "natural", "doremi_pooled"]
    assert [a.name for a in DESIGN.arms if a.pooled] == ["doremi_pooled"] and DESIGN.primary == "doremi_pooled"
    assert DESIGN.arm("doremi_pooled").search_stages == DESIGN.arm("doremi").search_stages
    assert DESIGN.arm("natural").mixture == "tokens" and DESIGN.arm("doremi").search_stages == ("reference", "proxy")
    assert (DESIGN.guardrails.memorisation_gap, DESIGN.guardrails.se_multiple) == (0.05, 2.0)
    assert [(g.max_sigma_d, g.pairs) for g in DESIGN.gate.steps] == [(0.02, 6), (0.03, 10)]
    assert DESIGN.calibration.arms == ("uniform", "fixed") and DESIGN.calibration.seeds == (1, 2, 3, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DESIGN.rule.margin = 0.02  # type: ignore[misc]


def test_config_differences_name_each_key():
    cfg = {"model": {"d_model": 640, "n_layers": 10, "n_heads": 10, "ffn_dim": 1792}, "data": {"seq_len": 1024}}
    cfg["train"] = {
        "steps": 4400,
        "global_batch_size": 32,
        "lr": 1e-3,
        "min_lr": 6e-5,
        "warmup_steps": 400,
        "decay": "cosine",
        "weight_decay": 0.1,
    }
    assert config_differences(cfg, DESIGN.main) == [
        "train.lr 0.001 (design 0.0006)",
        "train.grad_clip None (design 1.0)",
    ]


@pytest.mark.skipif(not CONFIG.is_file(), reason="the study's experiment file is not written yet")
def test_the_study_config_is_the_design():
    cfg = yaml.safe_load(CONFIG.read_text())
    assert config_differences(cfg, DESIGN.reference) == []
    assert config_differences(merged(cfg, cfg["pipeline"]["main"]), DESIGN.main) == []
    assert cfg["data"]["validation_fraction"] == DESIGN.validation_fraction
    assert cfg["data"]["validation_split"] == DESIGN.validation_split
    assert cfg["train"]["deterministic"] is DESIGN.deterministic
    d = cfg["mixing"]["doremi"]
    assert (d["eta"], d["smoothing"], d["reference_weights"]) == (
        DESIGN.eta,
        DESIGN.smoothing,
        DESIGN.reference_weights,
    )
    assert merged(cfg, cfg["pipeline"]["main"])["data"]["max_epochs"] == DESIGN.guardrails.max_epochs
    # Evaluations every 5% of the main run's steps, on the whole test half.
    main = merged(cfg, cfg["pipeline"]["main"])["train"]
    assert main["eval_every"] * 20 == DESIGN.main.schedule.steps and main["eval_sequences"] == 0
    assert main.get("eval_sequence_losses") in (DESIGN.sequence_losses, "every"), (
        "main runs must log per-sequence losses (train.eval_sequence_losses: final) for clustered SEs"
    )


LAUNCHER = ROOT / "experiments" / "launch" / "doremi_study.py"


@pytest.mark.skipif(not LAUNCHER.is_file(), reason="the study's launcher is not written yet")
def test_the_launcher_names_runs_as_the_design_reads_them(monkeypatch):
    """The launcher's run directories are the `<arm>-seed<k>` names doremi/study/runs.py pairs,
    the calibration's arms are the plan's, and each arm trains on the design's mixture."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("doremi_study_launcher", LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, launcher)  # its dataclasses look their module up
    spec.loader.exec_module(launcher)
    seeds = list(DESIGN.calibration.seeds)
    cal = {s.name for s in launcher.calibration_stages(seeds)}
    assert cal == {f"{a}-seed{s}" for a in DESIGN.calibration.arms for s in seeds}
    study = launcher.study_stages([3], Path("/w"))
    names = {s.name for s in study}
    assert {f"{a.name}-seed3" for a in DESIGN.arms} | {
        f"{st}-seed3" for a in DESIGN.arms for st in a.search_stages
    } <= names
    natural = next(s for s in study if s.name == "natural-seed3")
    assert f"data.domain_weights={DESIGN.arm('natural').mixture}" in natural.sets
    assert all(s.main for s in study if s.name in {f"{a.name}-seed3" for a in DESIGN.arms})


def test_the_launcher_pools_every_seeds_proxy_before_any_pooled_main_run(monkeypatch):
    """The pooled arm's weights average the proxies of all --seeds (one `doremi average` with
    --out), written after the last proxy and read by every seed's doremi_pooled run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("doremi_study_launcher", LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, launcher)
    spec.loader.exec_module(launcher)
    folder = Path("/w/study")
    study = launcher.study_stages([1, 2, 3], folder)
    names = [s.name for s in study]
    pooled = names.index("pooled")
    assert pooled > max(i for i, n in enumerate(names) if n.startswith("proxy-seed"))
    assert names[pooled + 1 :] == [f"doremi_pooled-seed{k}" for k in (1, 2, 3)]
    assert {n.split("-seed")[0] for n in names if "-seed" in n} >= {a.name for a in DESIGN.arms}
    cmd = launcher.command(study[pooled], folder, [], [], [])
    proxies = [f"/w/study/proxy-seed{k}" for k in (1, 2, 3)]
    assert cmd[1:] == ["-m", "doremi", "average", *proxies, "--out", "/w/study/pooled/weights.json"]
    for s in study[pooled + 1 :]:
        assert s.main and "data.domain_weights=/w/study/pooled/weights.json" in s.sets
        assert s.sets[:2] == (f"train.seed={s.name[-1]}", f"data.seed={s.name[-1]}")


def test_the_launcher_runs_consecutive_main_runs_side_by_side_and_everything_else_alone():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("doremi_study_batches", LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    sys.modules["doremi_study_batches"] = launcher
    spec.loader.exec_module(launcher)
    stages = launcher.study_stages([1, 2], Path("/w"))
    names = [[stages[i].name for i in b] for b in launcher.batches(stages, 3)]
    assert names[:4] == [
        ["reference-seed1"],
        ["proxy-seed1"],
        ["proxy-seed1"],  # its average
        ["uniform-seed1", "natural-seed1", "doremi-seed1"],
    ]
    assert [len(b) for b in launcher.batches(stages, 1)] == [1] * len(stages)
    assert [len(b) for b in launcher.batches(launcher.calibration_stages([1, 2, 3]), 4)] == [4, 2]


def test_the_launcher_runs_a_batch_together_and_stops_after_a_failed_one(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("doremi_study_run", LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    sys.modules["doremi_study_run"] = launcher
    spec.loader.exec_module(launcher)
    stages = [launcher.Stage(f"s{i}", "train", main=True) for i in range(3)] + [launcher.Stage("avg", "average")]
    code = ["print('ok')", "raise SystemExit(2)", "print('ok')", "print('never')"]
    cmds = [[sys.executable, "-c", c] for c in code]
    records = list(launcher.run_stages(stages, cmds, tmp_path / "launch.log", None, side_by_side=3))
    assert [(r["stage"], r["exit_status"], r["side_by_side"]) for r in records] == [
        ("s0", 0, 3),
        ("s1", 2, 3),
        ("s2", 0, 3),
    ]  # the batch ran together; the stage after a failed batch did not run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launch-s0.log", "launch-s1.log", "launch-s2.log"]


def test_the_launcher_skips_only_stages_whose_header_says_finished(tmp_path):
    import importlib.util

    from data import artifact

    spec = importlib.util.spec_from_file_location("doremi_study_done", LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    sys.modules["doremi_study_done"] = launcher
    spec.loader.exec_module(launcher)
    done, running, average = (launcher.Stage(n, c) for n, c in (("a", "train"), ("b", "train"), ("a", "average")))
    for name, status in (("a", "finished"), ("b", "running")):
        (tmp_path / name).mkdir()
        header = artifact.Header(kind="run", status=status, step=5 if status == "finished" else 2, steps=5)
        artifact.write(tmp_path / name / "run.json", header, {"stage": "train"})
    assert launcher.finished(done, tmp_path)
    assert not launcher.finished(running, tmp_path)
    assert not launcher.finished(average, tmp_path)  # no weights.json yet
    assert not launcher.finished(launcher.Stage("c", "train"), tmp_path)


def test_the_launcher_refuses_pooled_weights_made_from_other_seeds(monkeypatch, tmp_path, capsys):
    """A pooled weights file from an earlier call with other --seeds is not taken as finished
    (its main runs would train on another pooling): one line, exit status 2."""
    import importlib.util

    from data import artifact
    from data.sampling.weights_file import write_weights_file

    spec = importlib.util.spec_from_file_location("doremi_study_launcher", LAUNCHER)
    launcher = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, launcher)
    spec.loader.exec_module(launcher)
    folder = tmp_path / "study"
    sources = [artifact.Source("run", str(folder / f"proxy-seed{k}"), f"{k:016x}") for k in (1, 2)]
    write_weights_file(folder / "pooled" / "weights.json", ["a", "b"], [0.5, 0.5], {}, sources=sources)
    stages = launcher.study_stages([1, 2], folder)
    pooled = next(s for s in stages if s.name == "pooled")
    assert launcher.finished(pooled, folder)
    other = next(s for s in launcher.study_stages([1, 2, 3], folder) if s.name == "pooled")
    with pytest.raises(SystemExit) as e:
        launcher.finished(other, folder)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pools proxy-seed1, proxy-seed2, this call's --seeds pool proxy-seed1" in err[0]
