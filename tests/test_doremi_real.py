"""The real-data study's scripts: the arms' commands, natural weights, bad input, the verdict rule."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "experiments" / "launch"), str(ROOT / "experiments" / "tools")]

import doremi_real as run_study  # noqa: E402
import doremi_real_summary as summarize  # noqa: E402


def test_natural_weights_follow_uncapped_bytes(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"outputs": {"a": {"uncapped_bytes": 300}, "b": {"uncapped_bytes": 100}}}))
    got = json.loads(run_study.natural_weights(manifest, tmp_path / "natural.json").read_text())
    assert got["domains"] == ["a", "b"] and got["weights"] == [0.75, 0.25]


def test_arm_commands_carry_seed_baselines_and_ablation():
    natural = Path("/w/natural.json")
    cmd = run_study.arm_command("natref-s2", run_study.ARMS["natref-s2"], Path("/w"), natural, ["train.steps=3"])
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert sets == [
        "pipeline.run_dir=/w/natref-s2",
        "data.store_dir=/w/stores",
        "train.seed=2",
        "data.seed=2",
        "pipeline.baselines=[]",
        "mixing.doremi.reference_weights=/w/natural.json",
        "train.steps=3",
    ]
    one = run_study.arm_command("doremi-s1", run_study.ARMS["doremi-s1"], Path("/w"), natural, [])
    assert "pipeline.baselines=[uniform, /w/natural.json]" in one
    domains = json.loads(run_study.corpus_sets(Path("/c"))[0].split("=", 1)[1])
    assert len(domains) == 12 and domains[0] == {"name": "c", "paths": ["/c/c.jsonl.xz"]}


def test_comparison_arms_are_a_valid_pipeline(tmp_path):
    """The comparison's arms (experiments/notes/COMPARISON.md) load as an experiment config with
    every method, the baselines and their options, and the methods' checks pass for 12 domains
    (Aioli's probes fit its rounds, ADO's floor is below 1/12)."""
    from doremi.config import ExperimentConfig
    from doremi.methods.registry import preflight
    from trainer.config.schema import load_config

    natural = tmp_path / "natural.json"
    names = [f"d{i}" for i in range(12)]
    natural.write_text(json.dumps({"domains": names, "weights": [1 / 12] * 12}))
    domains = json.dumps([{"name": n, "paths": [str(tmp_path / f"{n}.jsonl")]} for n in names])
    cmd = run_study.arm_command("compare-s2", run_study.ARMS["compare-s2"], tmp_path, natural, [])
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"] + [f"data.domains={domains}"]
    cfg = load_config(run_study.CONFIG, sets, cls=ExperimentConfig)
    assert cfg.pipeline.methods == ["doremi", "doge", "odm", "aioli", "ado", "regmix", "mixing_law"]
    assert cfg.train.seed == 2 and cfg.pipeline.baselines == ["uniform", str(natural), "unimax:2"]
    for name in ("odm", "aioli", "ado"):
        preflight(name, cfg, names)


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--arms", "nosuch"], "--arms: unknown arm(s) nosuch"),
        (["--corpus", "/nonexistent"], "/nonexistent: no corpus manifest"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, expect):
    with pytest.raises(SystemExit) as e:
        run_study.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0]
    assert not (tmp_path / "work").exists()


def test_verdict_rule():
    works, conds = summarize.verdict([-0.05, -0.06, -0.04, -0.05], [0.0, 0.01, -0.02, 0.0], 9, 0.75, 12)
    assert works == "works" and all(ok for _, ok in conds)
    # One seed worse and the mean within 2 standard errors: inconclusive.
    assert summarize.verdict([-0.1, 0.05, -0.2, 0.06], [0.1] * 4, 7, None, 12)[0] == "inconclusive"
    # Clearly worse: fails.
    assert summarize.verdict([0.1, 0.11, 0.09, 0.1], [0.0] * 4, 2, None, 12)[0] == "fails"
    # Better everywhere but too slow to reach uniform's final loss: not "works", and beyond 2 SE: fails.
    assert summarize.verdict([-0.05, -0.06, -0.04, -0.05], [0.0] * 4, 9, 0.9, 12)[0] == "fails"


def test_rule_checks_take_the_worst_domain_against_each_limit():
    values = {
        "gap": {"c": 0.01, "go": 0.051},
        "epochs": {"c": 1.9},
        "mixture": {},
        "final_minus_best": {"c": 0.0, "go": 0.01},
    }
    checks = summarize.rule_checks(values)
    by_key = {key: checks[label] for key, (label, _) in summarize.RULE_GUARDRAILS.items()}
    assert by_key["gap"] == (0.051, False)
    assert by_key["epochs"] == (1.9, True)
    assert by_key["mixture"] == (None, False)  # not measured is not a pass
    assert by_key["final_minus_best"] == (0.01, True)


def test_excess_phases_average_the_first_and_last_steps(tmp_path):
    for name, offset in (("a", 0.0), ("b", 1.0)):
        proxy = tmp_path / name / "round1" / "proxy"
        proxy.mkdir(parents=True)
        rows = [{"step": s, "excess": [offset + s, offset + s + 2]} for s in range(1, 51)]
        (proxy / "domain_weights.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    early, late = summarize.excess_phases([tmp_path / "a", tmp_path / "b"])
    n = summarize.PHASE
    assert early == pytest.approx(0.5 + (1 + n) / 2 + 1)
    assert late == pytest.approx(0.5 + (51 - n + 50) / 2 + 1)
