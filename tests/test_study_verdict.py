"""doremi/study/verdict.py and summarize.py: the study table from run directories and from an
archive of them, its numbers against stats.py, clustered per-domain SEs, the compute ledger per
arm and the guardrail that voids a study."""

from __future__ import annotations

import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from doremi.commands.cli import main
from doremi.study import stats
from doremi.study.design import DESIGN, SMALL, SMALL_SCHEDULE
from doremi.study.runs import find_runs, pair_runs
from doremi.study.summarize import STUDY_JSON, STUDY_MD, STUDY_PNG, primary_line, summarize
from doremi.study.verdict import arm_result, domain_diff
from tests.test_study_calibration import write_run

DOREMI = [-0.03, -0.02, -0.025, -0.015, -0.035, -0.02]
NATURAL = [0.05, 0.01, 0.03, -0.01, 0.06, 0.02]  # SE 0.0105 > 0.008: flagged
DOCS = np.array([0, 0, 1, 2, 2, 3])  # six sequences of four documents, per domain


def write_search_run(root: Path, name: str, seed: int, gap: float = 0.0, gap_se: float = 0.05) -> Path:
    run = root / name
    run.mkdir(parents=True)
    s = SMALL_SCHEDULE
    cfg = {
        "model": {"vocab_size": 2048, "max_seq_len": 1024, **vars(SMALL)},
        "train": {"steps": s.steps, "global_batch_size": s.global_batch_size, "seed": seed, "eval_sequences": 8},
        "data": {"seq_len": s.seq_len, "seed": seed, "domains": [{"name": "a"}, {"name": "b"}]},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    val = {"a": 3.0, "b": 4.0}
    rows = [
        {"step": 500, "loss": 3.5, "tokens_per_s": 2_000_000.0},
        {"step": 1000, "loss": 3.0, "tokens_per_s": 2_500_000.0},
        {
            "step": 1000,
            "val_loss": val,
            "seen_loss": {"a": 3.0, "b": 4.0},
            "heldout_loss": {"a": 3.0 + gap, "b": 4.0},
            "seen_loss_se": {"a": gap_se / math.sqrt(2), "b": 0.01},
            "heldout_loss_se": {"a": gap_se / math.sqrt(2), "b": 0.01},
        },
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def write_sequences(run: Path, shift: float) -> None:
    """An eval_sequences file (trainer/records/eval_sequences.py's columns) at the final step: six
    sequences per domain, losses 3 + shift + a fixed pattern."""
    pattern = np.array([0.0, 0.01, -0.02, 0.03, 0.0, -0.01])
    k = 2
    (run / "eval_sequences").mkdir()
    np.savez(
        run / "eval_sequences" / f"step_{DESIGN.main.schedule.steps:07d}.npz",
        domain=np.repeat(np.arange(k, dtype=np.int32), 6),
        sequence=np.tile(np.arange(6, dtype=np.int32), k),
        loss_sum=np.tile((3.0 + shift + pattern * shift * 100) * 1024, k),
        tokens=np.full(6 * k, 1024, dtype=np.int32),
        doc_first=np.tile(DOCS, k),
        doc_last=np.tile(DOCS, k),
        domains=np.array(["a", "b"]),
        split=np.array("test"),
        step=np.array(DESIGN.main.schedule.steps),
    )


def write_study(root: Path, big_gap: bool = False) -> None:
    for seed, (dd, nd) in enumerate(zip(DOREMI, NATURAL), start=1):
        u = 3.0 + 0.02 * seed
        write_sequences(write_run(root, f"uniform-seed{seed}", u, seed), 0.0)
        write_sequences(write_run(root, f"doremi-seed{seed}", u + dd, seed, spread=0.4), dd)
        write_run(root, f"natural-seed{seed}", u + nd, seed)
        write_search_run(root, f"reference-seed{seed}", seed, gap=0.3 if big_gap and seed == 2 else 0.12)
        write_search_run(root, f"proxy-seed{seed}", seed)


def _flops(shape, seq_len: int) -> int:
    from trainer.config.schema import ModelConfig
    from trainer.config.tools import from_dict
    from trainer.model.flops import flops_per_token

    return flops_per_token(
        from_dict(ModelConfig, {"vocab_size": 2048, "max_seq_len": 1024, **vars(shape)}, "model"), seq_len
    )


def test_domain_diff_clusters_by_document_and_seed():
    per_seed = [-0.01, -0.03]
    seqs = [
        (np.array([0.1, 0.2, -0.1, 0.0]), np.array([0, 0, 1, 2])),
        (np.array([0.0, 0.1, 0.2, -0.2]), np.array([0, 0, 1, 2])),
    ]
    d = domain_diff("a", per_seed, seqs)
    values = np.concatenate([s for s, _ in seqs])
    assert d.mean == pytest.approx(-0.02) and d.se_kind == "clustered"
    assert d.se == pytest.approx(stats.two_way_cluster_se(values, [0, 0, 1, 2] * 2, [0] * 4 + [1] * 4))
    assert domain_diff("a", per_seed).se == pytest.approx(0.01)  # sd 0.01414 / sqrt(2)
    assert domain_diff("a", [0.5]).se is None


def test_arm_result_is_the_rule_on_the_paired_differences(tmp_path):
    write_study(tmp_path)
    runs = find_runs(tmp_path, ["uniform", "doremi", "natural"])
    r = arm_result(pair_runs(runs, "doremi", "uniform"), DESIGN)
    p = stats.paired_test(DOREMI)
    assert r.paired.mean == pytest.approx(p.mean, abs=1e-12) and r.paired.se == pytest.approx(p.se, abs=1e-12)
    assert r.paired.verdict == "works" and r.se_ok
    assert r.tost.decision == "not shown"  # -0.0242 is beyond the -0.01 margin
    # Spread 0.4 against uniform's 0.5: domain a is 0.1 worse, b 0.1 better, on every seed.
    assert r.worst_domain.domain == "a" and r.worst_domain.mean == pytest.approx(0.1 + p.mean, abs=1e-12)
    assert r.worst_case[0] == pytest.approx(p.mean - 0.1, abs=1e-12)
    assert r.better == 1 and r.domains[0].se_kind == "per-seed"
    nat = arm_result(pair_runs(runs, "natural", "uniform"), DESIGN)
    assert nat.paired.verdict == "worse" and nat.se_ok is False
    assert nat.paired.se == pytest.approx(stats.paired_test(NATURAL).se, abs=1e-12) and nat.paired.se > 0.008


def test_summarize_from_an_archive_with_compute_and_clustered_ses(tmp_path, capsys):
    study = tmp_path / "study"
    write_study(study)
    archive = tmp_path / "raw_logs.tar.xz"
    with tarfile.open(archive, "w:xz") as tf:
        tf.add(study, arcname="study")
    out = tmp_path / "out"
    assert main(["study", "summarize", str(archive), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("doremi vs uniform: works (-0.0242 nats, 95% CI [")
    # NATURAL's sd 0.0258: (0.0258 / 0.008)^2 = 10.4 -> 11 pairs for the SE; 12 for 0.02 at 80%
    # power (detectable effect 0.0199 at 12 pairs).
    assert printed[1].endswith(
        "SE 0.0105 > 0.008: the study is under-powered (the pairs' own spread, sigma_D 0.0258, "
        "asks for 11 pairs for SE <= 0.008 and 12 to detect 0.02 nats)"
    )
    doc = json.loads((out / STUDY_JSON).read_text())
    assert [r["arm"] for r in doc["results"]] == ["uniform", "doremi", "natural"]
    dore = doc["results"][1]
    assert dore["paired"]["mean"] == pytest.approx(np.mean(DOREMI), abs=1e-12)
    assert dore["domains"][0]["se_kind"] == "clustered"
    # The doremi sequences differ from uniform's by shift x (1 + 100 x pattern), the same on both
    # domains; two-way clustered over the 6 seeds.
    pattern = np.array([0.0, 0.01, -0.02, 0.03, 0.0, -0.01])
    values = np.concatenate([d * (1 + 100 * pattern) for d in DOREMI])
    want = stats.two_way_cluster_se(values, np.tile(DOCS, 6), np.repeat(np.arange(6), 6))
    assert dore["domains"][0]["se"] == pytest.approx(want, abs=1e-9)
    # Compute per seed: reference + proxy (training and the reference's forward) + main.
    small, big = _flops(SMALL, 1024), _flops(DESIGN.main.shape, 1024)
    search_tokens, main_tokens = SMALL_SCHEDULE.tokens, DESIGN.main.schedule.tokens
    want_flops = small * search_tokens * (2 + 1 / 3) + big * main_tokens
    assert dore["compute"]["per_seed_mean"]["train_flops_total"] == pytest.approx(want_flops, rel=1e-12)
    assert doc["results"][0]["compute"]["per_seed_mean"]["train_flops_total"] == pytest.approx(big * main_tokens)
    ref_seconds = 500 * 96 * 1024 / 2_000_000 + 500 * 96 * 1024 / 2_500_000
    main_seconds = sum(1100 * 32 * 1024 / x for x in (100.0, 800_000.0, 820_000.0, 840_000.0))
    assert dore["compute"]["per_seed_mean"]["gpu_seconds"] == pytest.approx(2 * ref_seconds + main_seconds)
    # Periodic evaluations: 2 passes x 8 sequences x 2 domains x 1024 tokens, a forward each.
    assert dore["compute"]["per_seed"]["1"]["stages"]["main"]["evaluation"] == pytest.approx(big / 3 * 2 * 8 * 2 * 1024)
    md = (out / STUDY_MD).read_text()
    assert "Every guardrail of the rule holds" in md and (out / STUDY_PNG).is_file()
    assert "| doremi | 6 |" in md and "clustered SE" in md
    # Per seed, the differences sigma_D is the spread of (DOREMI and NATURAL, seed by seed)
    per_seed = md.split("## Per seed\n\n")[1].split("\n## ")[0].splitlines()
    assert per_seed[0] == "| seed | doremi - uniform | natural - uniform |"
    assert per_seed[2] == "| seed 1 | -0.0300 | +0.0500 |" and per_seed[7] == "| seed 6 | -0.0200 | +0.0200 |"
    assert dore["diffs"] == pytest.approx(DOREMI, abs=1e-12)
    # The same numbers from the directory itself.
    again = summarize(study)
    assert again["results"][1].paired.mean == pytest.approx(dore["paired"]["mean"], abs=0)


def test_a_memorisation_gap_beyond_its_noise_voids_the_study(tmp_path, capsys):
    write_study(tmp_path / "s", big_gap=True)  # seed 2: 0.3 - 2 x 0.05 > 0.05; the others 0.12 - 0.1 < 0.05
    summary = summarize(tmp_path / "s")
    assert len(summary["guardrails"]) == 1
    assert summary["guardrails"][0].startswith("reference-seed2: a: memorisation gap (heldout - seen loss) 0.3 ± 0.05")


def test_missing_and_unfinished_seeds_are_left_out_by_name(tmp_path):
    write_study(tmp_path)
    for f in (tmp_path / "natural-seed6").iterdir():
        f.unlink()
    (tmp_path / "natural-seed6").rmdir()
    write_run(tmp_path, "natural-seed6", 3.0, 6, final_step=2200)
    summary = summarize(tmp_path)
    nat = summary["results"][2]
    assert nat.seeds == (1, 2, 3, 4, 5) and nat.notes == (
        "natural-seed6: unfinished (final evaluation at step 2200 of 4400)",
    )


def test_a_diverged_run_is_refused_by_name(tmp_path):
    from doremi.study.runs import StudyError

    write_study(tmp_path)
    for f in (tmp_path / "natural-seed6").iterdir():
        f.unlink()
    (tmp_path / "natural-seed6").rmdir()
    write_run(tmp_path, "natural-seed6", float("nan"), 6)
    with pytest.raises(StudyError, match=r"natural-seed6: step \d+: \w+ is not finite for a, b; a diverged run"):
        summarize(tmp_path)


def test_bad_source_is_one_line(tmp_path, capsys):
    bad = tmp_path / "logs.zip"
    bad.write_text("x")
    assert main(["study", "summarize", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"doremi study: error: {bad}: expected a directory or a .tar.xz, .tar.gz, .tgz, .tar archive"
    )
    assert not (tmp_path / "o").exists()


def _gate(tmp_path: Path, pairs: int) -> Path:
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps({"decision": {"go": True, "pairs": pairs, "line": f"GO with {pairs} pairs"}}))
    return cal


def test_an_arm_short_of_the_gates_pairs_gets_no_verdict(tmp_path, capsys):
    """The gate asked 8 pairs and the study has 6: no arm is judged (compare-methods' rule too)."""
    write_study(tmp_path / "s")
    out = tmp_path / "out"
    cal = _gate(tmp_path, 8)
    assert main(["study", "summarize", str(tmp_path / "s"), "--out", str(out), "--calibration", str(cal)]) == 0
    doc = json.loads((out / STUDY_JSON).read_text())
    assert [r["arm"] for r in doc["results"]] == ["uniform"]
    assert [(w["arm"], w["pairs"], w["need"]) for w in doc["withheld"]] == [
        ("doremi", 6, 8),
        ("natural", 6, 8),
        ("doremi_pooled", 0, 8),
    ]
    assert doc["withheld"][0]["lacks"] == [
        "doremi-seed7 missing",
        "uniform-seed7 missing",
        "doremi-seed8 missing",
        "uniform-seed8 missing",
    ]
    printed = capsys.readouterr().out
    assert "doremi: incomplete, 6 of 8 pairs (doremi-seed7 missing; uniform-seed7 missing; " in printed
    assert "works" not in printed and "worse" not in printed
    md = (out / STUDY_MD).read_text()
    assert "| doremi | 6 of 8 |  |  |  | incomplete |" in md
    assert "## Per seed\n\nNo arm is paired with the baseline (every arm is withheld, below).\n" in md
    assert (out / STUDY_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # no verdict to plot: said so, not left out


def test_the_gates_pairs_are_the_seeds_judged(tmp_path, capsys):
    """Gate 4 with 6 seeds on disk: the arms are judged on seeds 1-4 exactly, the rest named;
    an arm missing one of those four pairs is withheld while the other stands."""
    write_study(tmp_path / "s")
    for f in (tmp_path / "s" / "natural-seed3").iterdir():
        f.unlink()
    (tmp_path / "s" / "natural-seed3").rmdir()
    summary = summarize(tmp_path / "s", gate={"go": True, "pairs": 4})
    dore = summary["results"][1]
    assert dore.arm == "doremi" and dore.seeds == (1, 2, 3, 4)
    assert dore.paired.mean == pytest.approx(np.mean(DOREMI[:4]), abs=1e-12)
    assert [w.line() for w in summary["withheld"]] == [
        "natural: incomplete, 3 of 4 pairs (natural-seed3 missing); no verdict",
        "doremi_pooled: incomplete, 0 of 4 pairs (doremi_pooled-seed1 missing; doremi_pooled-seed2 missing; "
        "doremi_pooled-seed3 missing; doremi_pooled-seed4 missing); no verdict",
    ]
    assert summary["gate"] == [
        "doremi-seed5, doremi-seed6, natural-seed5, natural-seed6, uniform-seed5, uniform-seed6: "
        "beyond the gate's 4 pairs, not judged"
    ]
    # Without a gate, every pair there is.
    assert summarize(tmp_path / "s")["results"][1].seeds == (1, 2, 3, 4, 5, 6)


def test_a_refusing_gate_is_said(tmp_path):
    write_study(tmp_path / "s")
    summary = summarize(tmp_path / "s", gate={"go": False, "pairs": 40, "line": "NO-GO: 40 pairs > 12"})
    assert summary["gate"] == ["the calibration's gate refused the study: NO-GO: 40 pairs > 12"]
    assert [r.arm for r in summary["results"]] == ["uniform", "doremi", "natural"]


def test_summarize_replaces_only_its_own_files(tmp_path, capsys):
    """A second run replaces study.*; a study.md of a researcher's is refused, nothing written."""
    write_study(tmp_path / "s")
    out = tmp_path / "out"
    assert main(["study", "summarize", str(tmp_path / "s"), "--out", str(out)]) == 0
    first = (out / STUDY_JSON).read_text()
    assert json.loads(first)["written_by"] == "doremi study summarize"
    assert (out / STUDY_MD).read_text().startswith("<!-- written by doremi study summarize -->\n# The DoReMi study")
    assert main(["study", "summarize", str(tmp_path / "s"), "--out", str(out)]) == 0
    assert (out / STUDY_JSON).read_text() == first
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / STUDY_MD).write_text("my notes\n")
    capsys.readouterr()
    assert main(["study", "summarize", str(tmp_path / "s"), "--out", str(mine)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"doremi study: error: {mine / STUDY_MD}: exists and was not written by doremi; "
        "`doremi study summarize` replaces only its own study.md: choose another --out"
    )
    assert sorted(p.name for p in mine.iterdir()) == [STUDY_MD] and (mine / STUDY_MD).read_text() == "my notes\n"


POOLED = [-0.011, -0.01, -0.012, -0.009, -0.01, -0.008]


def write_pooled(root: Path, made_from: range = range(1, 7), odd_seed: int | None = None) -> Path:
    """The pooled arm's weights file (made from the proxies of `made_from`) and its main runs,
    each run.json recording that file's content (`odd_seed`: another file's)."""
    from data import artifact
    from data.sampling.weights_file import write_weights_file
    from trainer.records.run_dir import content_id

    weights = root / "pooled" / "weights.json"
    weights.parent.mkdir()
    sources = [artifact.Source("run", str(root / f"proxy-seed{k}"), f"{k:016x}") for k in made_from]
    write_weights_file(weights, ["a", "b"], [0.6, 0.4], {"method": "doremi"}, sources=sources)
    for seed, d in enumerate(POOLED, start=1):
        run = write_run(root, f"doremi_pooled-seed{seed}", 3.0 + 0.02 * seed + d, seed)
        read = "0123456789abcdef" if seed == odd_seed else content_id(str(weights))
        (run / "run.json").write_text(json.dumps({"keys": {"data.domain_weights (content)": read}}))
    return weights


def test_a_pooled_arm_is_judged_on_its_pairs_and_charged_every_seeds_search(tmp_path):
    write_study(tmp_path / "s")
    write_pooled(tmp_path / "s")
    summary = summarize(tmp_path / "s", gate={"go": True, "pairs": 6})
    pooled = summary["results"][-1]
    assert pooled.arm == "doremi_pooled" and pooled.seeds == (1, 2, 3, 4, 5, 6) and not summary["withheld"]
    assert summary["primary"] == "doremi_pooled"
    assert primary_line(summary["results"], DESIGN) == (
        f"**Primary difference** (doremi_pooled - uniform): {np.mean(POOLED):+.4f} nats, "
        f"SE {stats.paired_test(POOLED).se:.4f}, within the rule's 0.008."
    )
    p = stats.paired_test(POOLED)
    assert pooled.paired.mean == pytest.approx(p.mean, abs=1e-12) and pooled.paired.se == pytest.approx(p.se)
    # Each seed: its main run and all six seeds' references and proxies.
    small, big = _flops(SMALL, 1024), _flops(DESIGN.main.shape, 1024)
    want = 6 * small * SMALL_SCHEDULE.tokens * (2 + 1 / 3) + big * DESIGN.main.schedule.tokens
    assert pooled.compute["per_seed_mean"]["train_flops_total"] == pytest.approx(want, rel=1e-12)
    stages = pooled.compute["per_seed"][3]["stages"]
    assert sorted(stages) == sorted(["main", *(f"{st}-seed{k}" for st in ("reference", "proxy") for k in range(1, 7))])
    doremi = summary["results"][1]
    assert doremi.compute["per_seed_mean"]["train_flops_total"] == pytest.approx(
        small * SMALL_SCHEDULE.tokens * (2 + 1 / 3) + big * DESIGN.main.schedule.tokens, rel=1e-12
    )


@pytest.mark.parametrize("fault", ["one seed on other weights", "pooled from five proxies", "a damaged run record"])
def test_a_pooled_arm_not_on_its_pre_registered_mixture_is_refused(tmp_path, capsys, fault):
    write_study(tmp_path / "s")
    if fault == "a damaged run record":
        write_pooled(tmp_path / "s")
        record = tmp_path / "s" / "doremi_pooled-seed2" / "run.json"
        record.write_text('{"keys": ')
        needle = f"{record}: damaged, not a run record"
    elif fault == "one seed on other weights":
        write_pooled(tmp_path / "s", odd_seed=4)
        needle = "a pooled arm trains every seed on one weights file, but its runs read doremi_pooled-seed1 "
    else:
        write_pooled(tmp_path / "s", made_from=range(1, 6))
        needle = (
            "doremi_pooled: its weights pooled/weights.json pool proxy-seed1, proxy-seed2, proxy-seed3, "
            "proxy-seed4, proxy-seed5; the design pools proxy-seed1, "
        )
    cal = _gate(tmp_path, 6)
    out = tmp_path / "out"
    assert main(["study", "summarize", str(tmp_path / "s"), "--out", str(out), "--calibration", str(cal)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_the_committed_study_is_what_its_committed_command_writes(tmp_path, monkeypatch, capsys):
    """experiments/results/doremi_study/study.{md,json}: recomputed from the committed archive
    by the command doremi_study.md gives (issue 34: every number from the archive)."""
    root = Path(__file__).resolve().parents[1]
    results = "experiments/results/doremi_study"
    monkeypatch.chdir(root)
    argv = ["study", "summarize", f"{results}/study.tar.xz", "--out", str(tmp_path)]
    assert main([*argv, "--calibration", f"{results}/calibration.json"]) == 0
    for name in (STUDY_JSON, STUDY_MD):
        assert (tmp_path / name).read_text() == (root / results / name).read_text(), name
