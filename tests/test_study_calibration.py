"""doremi/study/calibration.py and runs.py: the calibration's noise, throughput and gate from
run directories written here (no training), and `doremi study calibrate` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from doremi.commands.cli import main
from doremi.reports.ledger import train_seconds
from doremi.study import stats
from doremi.study.calibration import CALIBRATION_JSON, CALIBRATION_MD, calibrate, decide, searched_advice
from doremi.study.design import DESIGN, Gate, Rule
from doremi.study.runs import StudyError, find_runs, read_run, throughput

RATES = [100.0, 800_000.0, 820_000.0, 840_000.0]  # the first interval includes compilation
STEPS = DESIGN.main.schedule.steps


def write_run(
    root: Path,
    name: str,
    endpoint: float,
    seed: int,
    final_step: int = STEPS,
    planned: int = STEPS,
    domains: tuple[str, ...] = ("a", "b"),
    spread: float = 0.5,
) -> Path:
    """A finished main run of the design's shape whose final per-domain losses average to
    `endpoint` (domain a below it by `spread`, b above)."""
    run = root / name
    run.mkdir(parents=True)
    s = DESIGN.main.schedule
    cfg = {
        "model": {"vocab_size": 2048, "max_seq_len": 1024, **vars(DESIGN.main.shape)},
        "train": {
            "steps": planned,
            "global_batch_size": s.global_batch_size,
            "lr": s.lr,
            "min_lr": s.min_lr,
            "warmup_steps": s.warmup_steps,
            "decay": s.decay,
            "weight_decay": s.weight_decay,
            "grad_clip": s.grad_clip,
            "seed": seed,
        },
        "data": {"seq_len": s.seq_len, "seed": seed, "domains": [{"name": d} for d in domains]},
    }
    cfg["train"]["eval_sequences"] = 8
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    k = len(domains)
    offsets = [spread * (2 * i - (k - 1)) / max(k - 1, 1) for i in range(k)]
    rows = []
    for i, rate in enumerate(RATES, start=1):
        step = final_step * i // len(RATES)
        rows.append({"step": step, "loss": 3.0, "tokens_per_s": rate})
        if i in (2, len(RATES)):
            rows.append(
                {"step": step, "val_loss": {d: endpoint + o + (0.1 if i == 2 else 0) for d, o in zip(domains, offsets)}}
            )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def write_calibration(root: Path, diffs: list[float], base: float = 3.0) -> None:
    for seed, d in enumerate(diffs, start=1):
        u = base + 0.01 * seed
        write_run(root, f"uniform-seed{seed}", u, seed)
        write_run(root, f"fixed-seed{seed}", u + d, seed)


def test_run_reads_the_last_evaluation_and_the_throughput(tmp_path):
    r = read_run(write_run(tmp_path, "uniform-seed3", 3.25, 3))
    assert (r.arm, r.seed, r.final_step, r.planned, r.loss_key) == ("uniform", 3, STEPS, STEPS, "val_loss")
    assert r.final == (2.75, 3.75) and r.endpoint == 3.25
    assert r.tokens_per_s == 820_000.0  # median of the intervals after the first
    assert r.curve == ((2200, 3.35), (4400, 3.25)) and not r.unfinished
    per_step = 32 * 1024
    assert r.train_seconds == pytest.approx(sum(1100 * per_step / x for x in RATES))
    assert throughput([{"tokens_per_s": 5.0}]) == 5.0 and throughput([]) is None
    assert train_seconds([{"step": 10, "loss": 1.0, "tokens_per_s": 2.0}], 4) == 20.0


def test_gate_table_and_power_rule():
    rule, gate = Rule(), Gate()
    go = decide(0.015, gate, rule)
    assert (go.go, go.pairs, go.table_pairs, go.power_pairs) == (True, 6, 6, 6)
    # sigma_D 0.02: the table says 6, but 6 pairs detect only 0.024 nats: the power rule's 8.
    more = decide(0.02, gate, rule)
    assert (more.go, more.pairs, more.table_pairs, more.power_pairs) == (True, 8, 6, 8)
    over = decide(0.025, gate, rule)
    assert (over.go, over.table_pairs, over.power_pairs) == (False, 10, 12)
    assert over.line() == (
        "NO-GO: sigma_D 0.0250 needs 12 pairs for a detectable effect of 0.02 nats at power 0.8, more than "
        "the budget of 10; raise the budget to 12 pairs (--budget-pairs), or train longer (more tokens per "
        "parameter) or use a smaller model, then calibrate again"
    )
    assert decide(0.025, gate, rule, budget_pairs=12).pairs == 12
    noisy = decide(0.031, gate, rule)
    assert not noisy.go and noisy.line().startswith("NO-GO: sigma_D 0.0310 > 0.03, the gate's largest; train longer")


def test_calibration_measures_sigma_and_goes(tmp_path):
    diffs = [-0.02, -0.01, 0.0, 0.01]  # sd sqrt(0.0005 / 3) = 0.0129
    write_calibration(tmp_path, diffs)
    c = calibrate(find_runs(tmp_path, DESIGN.calibration.arms))
    sd = math.sqrt(0.0005 / 3)
    assert c.seeds == (1, 2, 3, 4) and c.diffs == pytest.approx(diffs, abs=1e-12)
    assert c.sigma_d == pytest.approx(sd, abs=1e-12)
    uniform = [3.01, 3.02, 3.03, 3.04]
    assert c.sigma_run == pytest.approx(stats.sigma_run({"u": uniform, "f": [u + d for u, d in zip(uniform, diffs)]}))
    assert c.decision.go and c.decision.pairs == 6 and c.se_at_pairs == pytest.approx(sd / math.sqrt(6))
    assert c.sigma_d_upper80 == pytest.approx(sd * 1.7275873, rel=1e-6) and c.power_pairs_upper80 == 10
    assert c.tokens_per_s["all"] == 820_000.0
    assert c.main_seconds == pytest.approx(4400 * 32 * 1024 / 820_000.0)
    assert c.setting_differs == []


def test_calibrate_command_writes_files_and_refuses_with_exit_2(tmp_path, capsys):
    write_calibration(tmp_path, [-0.04, 0.0, 0.04, 0.0])  # sd 0.0327 > 0.03
    assert main(["study", "calibrate", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "doremi study: error: NO-GO: sigma_D 0.0327 > 0.03, the gate's largest; train longer (more tokens per "
        "parameter) or use a smaller model, then calibrate again"
    ]
    doc = json.loads((tmp_path / CALIBRATION_JSON).read_text())
    assert doc["decision"]["go"] is False and doc["sigma_d"] == pytest.approx(math.sqrt(0.0032 / 3))
    assert "## Gate: **NO-GO: sigma_D 0.0327" in (tmp_path / CALIBRATION_MD).read_text()


def test_calibrate_command_go(tmp_path, capsys):
    write_calibration(tmp_path, [-0.02, -0.01, 0.0, 0.01])
    out = tmp_path / "out"
    assert main(["study", "calibrate", str(tmp_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "## Gate: **GO with 6 pairs" in printed
    assert json.loads((out / CALIBRATION_JSON).read_text())["decision"]["pairs"] == 6


def test_a_searched_arm_calibrates_with_pilot_pairs_of_itself(tmp_path, capsys):
    """`--arm doremi`: the fixed pairs say GO, the searched arm's own pairs (a spread 3 times
    theirs, from the search's per-seed weights) say NO-GO; the fixed arm is then not needed."""
    write_calibration(tmp_path, [-0.01, -0.005, 0.0, 0.005])  # sd 0.00645: GO with 6
    for seed, d in enumerate([0.0, 0.06, -0.02, 0.04], start=1):  # sd 0.0365 > 0.03
        write_run(tmp_path, f"doremi-seed{seed}", 3.0 + 0.01 * seed + d, seed)
    runs = find_runs(tmp_path, ("uniform", "doremi"))
    c = calibrate(runs, DESIGN, arm="doremi")
    assert c.arms == ("uniform", "doremi") and c.sigma_d == pytest.approx(stats.sigma_d([0.0, 0.06, -0.02, 0.04]))
    assert calibrate(find_runs(tmp_path, DESIGN.calibration.arms), DESIGN).decision.pairs == 6
    out = tmp_path / "out"
    assert main(["study", "calibrate", str(tmp_path), "--arm", "doremi", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        "doremi study: error: NO-GO: sigma_D 0.0365 > 0.03, the gate's largest; its search (reference, proxy) "
        "finds other weights on every seed: make it steadier (a longer proxy), then calibrate again"
    )
    # within the table but over the budget: the budget is the other way
    wide = searched_advice(decide(0.025, DESIGN.gate, DESIGN.rule, 10), DESIGN, "doremi")
    assert wide.change.endswith("or raise the budget (--budget-pairs 12), then calibrate again"), wide
    assert searched_advice(decide(0.025, DESIGN.gate, DESIGN.rule, 10), DESIGN, "fixed").change.startswith("raise")
    assert (out / CALIBRATION_MD).read_text().splitlines()[1] == "# Calibration: doremi against uniform, 4 pairs"
    with pytest.raises(StudyError, match="no natural-seed<k> run"):
        calibrate(runs, DESIGN, arm="natural")
    with pytest.raises(StudyError, match="is the baseline"):
        calibrate(runs, DESIGN, arm="uniform")


def test_unfinished_runs_and_missing_partners_are_refused_by_name(tmp_path):
    write_calibration(tmp_path, [-0.02, -0.01, 0.0])
    write_run(tmp_path, "uniform-seed4", 3.0, 4)
    write_run(tmp_path / "late", "fixed-seed3b", 3.0, 3)  # not <arm>-seed<k>: ignored
    with pytest.raises(StudyError, match=r"^uniform-seed4: its partner fixed-seed4 is missing$"):
        calibrate(find_runs(tmp_path, DESIGN.calibration.arms))
    (tmp_path / "uniform-seed4" / "metrics.jsonl").unlink()
    for f in (tmp_path / "fixed-seed2").iterdir():
        f.unlink()
    (tmp_path / "fixed-seed2").rmdir()
    write_run(tmp_path, "fixed-seed2", 3.0, 2, final_step=2000)
    with pytest.raises(StudyError, match=r"^fixed-seed2: unfinished \(final evaluation at step 2000 of 4400\)$"):
        calibrate(find_runs(tmp_path, DESIGN.calibration.arms))


def test_pairs_must_share_their_seeds(tmp_path):
    write_calibration(tmp_path, [-0.02, -0.01])
    cfg = yaml.safe_load((tmp_path / "fixed-seed2" / "config.yaml").read_text())
    cfg["data"]["seed"] = 7
    (tmp_path / "fixed-seed2" / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(StudyError, match=r"fixed-seed2 and uniform-seed2 are not a pair: .* \(2, 7\) vs \(2, 2\)"):
        calibrate(find_runs(tmp_path, DESIGN.calibration.arms))


def test_a_setting_other_than_the_design_is_named(tmp_path):
    write_calibration(tmp_path, [-0.02, -0.01])
    cfg = yaml.safe_load((tmp_path / "fixed-seed1" / "config.yaml").read_text())
    cfg["train"]["lr"] = 1e-3
    (tmp_path / "fixed-seed1" / "config.yaml").write_text(yaml.safe_dump(cfg))
    c = calibrate(find_runs(tmp_path, DESIGN.calibration.arms))
    assert c.setting_differs == ["fixed-seed1: train.lr 0.001 (design 0.0006)"]


def test_fewer_pairs_than_the_plan_give_a_provisional_go_that_the_study_refuses(tmp_path, capsys):
    import importlib.util
    import sys
    import tarfile

    root = tmp_path / "runs"
    write_calibration(root, [-0.02, -0.01])
    archive = tmp_path / "calibration.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(root, arcname="calibrate")
    out = tmp_path / "out"
    assert main(["study", "calibrate", str(archive), "--out", str(out)]) == 0
    decision = json.loads((out / CALIBRATION_JSON).read_text())["decision"]
    assert decision["go"] and decision["pairs"] == 6
    assert decision["provisional"] == "2 of the plan's 4 pairs: seeds 3, 4 still to run before the study may start"
    assert "## Gate: **PROVISIONAL GO with 6 pairs" in (out / CALIBRATION_MD).read_text()
    assert main(["study", "calibrate", str(archive)]) == 2  # an archive is not written into
    # The launcher's study phase starts only on a final GO, with at least the pairs it decided.
    spec = importlib.util.spec_from_file_location(
        "doremi_study", Path(__file__).parents[1] / "experiments" / "launch" / "doremi_study.py"
    )
    launcher = importlib.util.module_from_spec(spec)
    sys.modules["doremi_study"] = launcher  # its dataclasses look their module up
    spec.loader.exec_module(launcher)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        launcher.check_gate(str(out / CALIBRATION_JSON))
    assert stop.value.code == 2 and "PROVISIONAL GO" in capsys.readouterr().err
    write_calibration(tmp_path / "all", [-0.02, -0.01, 0.0, 0.01])
    assert main(["study", "calibrate", str(tmp_path / "all")]) == 0
    launcher.check_gate(str(tmp_path / "all" / CALIBRATION_JSON))  # a final GO


@pytest.mark.parametrize(
    ("archive", "arm", "folder"),
    [
        ("calibration.tar.xz", None, ""),
        ("study.tar.xz", "doremi_pooled", "calibration_doremi_pooled"),
    ],
)
def test_the_committed_calibrations_are_what_their_commands_write(tmp_path, capsys, archive, arm, folder):
    """experiments/results/doremi_study's calibration files, recomputed from the committed
    archives by the commands doremi_study.md gives."""
    from doremi.study.calibration import run_calibration

    results = Path(__file__).resolve().parents[1] / "experiments" / "results" / "doremi_study"
    run_calibration(results / archive, tmp_path, arm=arm)
    for name in ("calibration.json", "calibration.md"):
        assert (tmp_path / name).read_text() == (results / folder / name).read_text(), name


def test_a_pooled_arm_gets_the_fixed_mixture_advice_not_the_searchs():
    from doremi.study.calibration import GateDecision

    no_go = GateDecision(go=False, pairs=None, table_pairs=None, power_pairs=42, reason="r", change="train longer")
    assert searched_advice(no_go, DESIGN, "doremi_pooled") == no_go
    assert "finds other weights on every seed" in searched_advice(no_go, DESIGN, "doremi").change
