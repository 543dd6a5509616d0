"""doremi/study/comparison/summary.py (`doremi study compare-methods`): the comparison's two views
from synthetic run directories (tests/test_study_verdict.py's), against numbers computed here
by hand: a paired difference, a compute multiple, a baseline interpolated at it; an arm short of
a seed withheld; Holm's column; a guardrail voiding the arms that use its run; the plot's baseline
curve; two archives round trip; bad sources refused in one line."""

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
from doremi.study.comparison.cost import EQUAL_COMPUTE, EQUAL_TOKENS
from doremi.study.comparison.guards import voided_by
from doremi.study.comparison.protocol import CORPUS, PROTOCOL
from doremi.study.comparison.summary import COMPARISON_JSON, COMPARISON_MD, COMPARISON_PNG, compare, format_markdown
from doremi.study.design import DESIGN, SMALL, SMALL_SCHEDULE
from doremi.study.runs import StudyError
from tests.test_study_calibration import write_run
from tests.test_study_verdict import _flops, write_search_run

ARMS = {a.name for a in PROTOCOL.arms}

SEEDS = (1, 2, 3)
STEPS = DESIGN.main.schedule.steps
MAIN_TOKENS = DESIGN.main.schedule.tokens
DOMAINS = CORPUS.domains
ODM = [-0.02, -0.03, -0.025]
ONLINE = [-0.05, -0.04, -0.06]
X2 = -0.1  # uniform_x2 minus uniform, every domain
ONLINE_EVAL_TOKENS = 3 * MAIN_TOKENS // 2  # a forward of 1.5 main runs' tokens: multiple 1.5
PLAIN = _flops(DESIGN.main.shape, 1024) * MAIN_TOKENS
SWEEP = (1.25 * PLAIN, 0.25 * PLAIN)  # training and evaluations: pooled over 3 seeds, multiple 5.5


def losses(endpoint: float) -> np.ndarray:
    """write_run's per-domain losses: the endpoint plus offsets from -0.5 to +0.5."""
    k = len(DOMAINS)
    return np.array([endpoint + 0.5 * (2 * i - (k - 1)) / (k - 1) for i in range(k)])


def uniform(seed: int) -> float:
    return 3.0 + 0.02 * seed


def main_run(root: Path, name: str, endpoint: float, seed: int, multiple: int = 1) -> Path:
    return write_run(root, name, endpoint, seed, final_step=STEPS * multiple, planned=STEPS * multiple, domains=DOMAINS)


def online_run(root: Path, name: str, endpoint: float, seed: int) -> None:
    """A method on the main run: its config names it and its metrics count its validation passes."""
    run = main_run(root, name, endpoint, seed)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["mixing"] = {"main": "odm"}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": STEPS, "method_evals": {"tokens": ONLINE_EVAL_TOKENS, "seconds": 2.0}}) + "\n")


def search_run(root: Path, name: str, seed: int, gap: float = 0.0) -> Path:
    """write_search_run's run on the comparison's corpus (check_corpus reads its config's domains)."""
    run = write_search_run(root, name, seed, gap=gap)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["data"]["domains"] = [{"name": d} for d in DOMAINS]
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


def write_pool(root: Path, pool: str, file: str, kind: str, made_from: list[str], mains: list[Path]) -> Path:
    """A pooled arm's one mixture (`root/pool/file`, its sources `made_from` of `kind`: proxies
    averaged or sweeps fitted) and each of its main runs' run.json recording that file's content."""
    from data import artifact
    from data.sampling.weights_file import write_weights_file
    from trainer.records.run_dir import content_id

    weights = root / pool / file
    weights.parent.mkdir(exist_ok=True)
    sources = [artifact.Source(kind, str(root / n), f"{i:016x}") for i, n in enumerate(made_from)]
    write_weights_file(weights, list(DOMAINS), [1 / len(DOMAINS)] * len(DOMAINS), {"method": pool}, sources=sources)
    for run in mains:
        (run / "run.json").write_text(json.dumps({"keys": {"data.domain_weights (content)": content_id(str(weights))}}))
    return weights


def write_comparison(study: Path, comparison: Path, seeds: tuple[int, ...] = SEEDS) -> None:
    """The study's runs (uniform, natural) under `study`; the comparison's (baselines at 2x, ODM as a
    pooled proxy and online, RegMix as a pooled fit of the seeds' sweeps, UniMax short of seed 3)
    under `comparison`."""
    odm, regmix = [], []
    for s in seeds:
        u = uniform(s)
        main_run(study, f"uniform-seed{s}", u, s)
        main_run(study, f"natural-seed{s}", u + 0.03, s)
        main_run(comparison, f"uniform_x2-seed{s}", u + X2, s, multiple=2)
        main_run(comparison, f"natural_x2-seed{s}", u + 0.03 - 0.08, s, multiple=2)
        search_run(comparison, f"odm_proxy-seed{s}", s)
        odm.append(main_run(comparison, f"odm-seed{s}", u + ODM[s - 1], s))
        online_run(comparison, f"odm_online-seed{s}", u + ONLINE[s - 1], s)
        if s < 3:
            main_run(comparison, f"unimax-seed{s}", u - 0.01, s)
        sweep = comparison / f"sweep-seed{s}"
        sweep.mkdir(parents=True)
        (sweep / "sweep.json").write_text(json.dumps({"compute": {"train_flops": SWEEP[0], "eval_flops": SWEEP[1]}}))
        regmix.append(main_run(comparison, f"regmix-seed{s}", u + 0.01, s))
    write_pool(comparison, "odm_pooled", "weights.json", "run", [f"odm_proxy-seed{s}" for s in seeds], odm)
    write_pool(comparison, "regmix_pooled", "regmix.json", "sweep", [f"sweep-seed{s}" for s in seeds], regmix)


def _pack(folder: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:xz") as tf:
        tf.add(folder, arcname=folder.name)
    return archive


def test_both_views_against_hand_computed_numbers(tmp_path):
    write_comparison(tmp_path / "study", tmp_path / "comparison")
    s = compare([tmp_path / "study", tmp_path / "comparison"], PROTOCOL)
    assert s["pairs"] == 3 and s["seeds"] == [1, 2, 3]
    by_arm = {r.arm: r for r in s["results"]}
    assert list(by_arm) == ["uniform", "natural", "odm", "odm_online", "regmix"]
    # View 1: the study's rule on odm - uniform per seed.
    odm = by_arm["odm"]
    assert odm.paired.mean == pytest.approx(np.mean(ODM), abs=1e-12)
    assert odm.paired.se == pytest.approx(stats.paired_test(ODM).se, abs=1e-12)
    assert odm.paired.verdict == "works"
    big, small = _flops(DESIGN.main.shape, 1024), _flops(SMALL, 1024)
    proxy_flops = small * SMALL_SCHEDULE.tokens
    # Pooled: every seed is charged the three seeds' proxies (the sum of its searches).
    assert odm.compute["per_seed_mean"]["train_flops_total"] == pytest.approx(
        3 * proxy_flops + big * MAIN_TOKENS, rel=1e-12
    )
    assert sorted(odm.compute["per_seed"][2]["stages"]) == [
        "main",
        "odm_proxy-seed1",
        "odm_proxy-seed2",
        "odm_proxy-seed3",
    ]
    # Search: the proxies' training; online, the main run's validation passes (a forward, a third).
    assert odm.compute["search_flops_mean"] == pytest.approx(3 * proxy_flops, rel=1e-12)
    assert by_arm["odm_online"].compute["search_flops_mean"] == pytest.approx(big / 3 * ONLINE_EVAL_TOKENS, rel=1e-12)
    # View 2, against uniform: the compute multiples 1 + search / plain main.
    at = {r.result.arm: r for r in s["at_compute"]["uniform"]}
    assert [b.multiple for b in at["odm"].at] == pytest.approx(
        [1 + 3 * proxy_flops / (big * MAIN_TOKENS)] * 3, rel=1e-12
    )
    assert [b.multiple for b in at["odm_online"].at] == pytest.approx([1.5] * 3, rel=1e-12)
    assert {b.how for b in at["odm_online"].at} == {"interpolated"}
    # The baseline at 1.5x, per domain the power law through 1x and 2x: L1 (L2 / L1)^log2(1.5).
    x = math.log(1.5) / math.log(2)
    want = [losses(uniform(k)) * (losses(uniform(k) + X2) / losses(uniform(k))) ** x for k in SEEDS]
    assert at["odm_online"].at[0].losses == pytest.approx(tuple(want[0]), rel=1e-12)
    diffs = [uniform(k) + ONLINE[k - 1] - w.mean() for k, w in zip(SEEDS, want)]
    assert at["odm_online"].result.paired.mean == pytest.approx(np.mean(diffs), abs=1e-12)
    assert at["odm_online"].result.paired.ci == pytest.approx(stats.paired_test(diffs).ci, abs=1e-12)
    # RegMix, pooled: the three sweeps' training and evaluations, 1.5 plain main runs each, on
    # every seed: 5.5x, extrapolated, beyond the corpus.
    assert [b.multiple for b in at["regmix"].at] == pytest.approx([5.5] * 3, rel=1e-12)
    assert sorted(by_arm["regmix"].compute["per_seed"][1]["stages"]) == [
        "main",
        "sweep-seed1",
        "sweep-seed2",
        "sweep-seed3",
    ]
    assert (
        at["regmix"].at[0].flag()
        == "extrapolated beyond the largest measured multiple; beyond the corpus's 2-epoch capacity"
    )
    want = losses(uniform(1)) * (losses(uniform(1) + X2) / losses(uniform(1))) ** (math.log(5.5) / math.log(2))
    assert at["regmix"].at[0].losses == pytest.approx(tuple(want), rel=1e-12)
    # natural: no search, so the baseline there is the measured 1x run, and view 2 is view 1.
    assert [b.how for b in at["natural"].at] == ["measured"] * 3
    assert at["natural"].result.paired.mean == pytest.approx(by_arm["natural"].paired.mean, abs=1e-12)
    # Against natural at the arm's compute: natural itself is not an arm there.
    assert [r.result.arm for r in s["at_compute"]["natural"]] == ["odm", "odm_online", "regmix"]


def test_an_arm_short_of_a_seed_is_withheld_by_name(tmp_path):
    write_comparison(tmp_path / "study", tmp_path / "comparison")
    s = compare([tmp_path / "study", tmp_path / "comparison"], PROTOCOL)
    unimax = next(w for w in s["withheld"]["equal main-run tokens"] if w.arm == "unimax")
    assert (unimax.pairs, unimax.need, unimax.lacks) == (2, 3, ("unimax-seed3 missing",))
    assert unimax.line() == "unimax: incomplete, 2 of 3 pairs (unimax-seed3 missing); no verdict"
    assert "unimax" not in {r.arm for r in s["results"]}
    # A calibration asking 4 pairs withholds every arm, the ones with 3 too.
    s4 = compare([tmp_path / "study", tmp_path / "comparison"], PROTOCOL, {"go": True, "pairs": 4})
    assert [r.arm for r in s4["results"]] == ["uniform"]
    odm = next(w for w in s4["withheld"]["uniform"] if w.arm == "odm")
    assert odm.pairs == 3 and odm.lacks == ("odm-seed4 missing", "uniform-seed4 missing")
    # Without its 2x run, a seed's baseline above 1x cannot be had: the arm is withheld in view 2 only.
    for f in (tmp_path / "comparison" / "uniform_x2-seed2").iterdir():
        f.unlink()
    (tmp_path / "comparison" / "uniform_x2-seed2").rmdir()
    s = compare([tmp_path / "study", tmp_path / "comparison"], PROTOCOL)
    assert "odm_online" in {r.arm for r in s["results"]}
    online = next(w for w in s["withheld"]["uniform"] if w.arm == "odm_online")
    assert online.pairs == 2 and online.lacks == (
        "seed 2: uniform at the arm's compute: multiple 1.5: beyond the only measured one (1); no uniform_x2-seed2",
    )
    assert [r.result.arm for r in s["at_compute"]["uniform"]] == ["natural"]  # natural: 1x, measured


def test_two_archives_round_trip_through_the_command(tmp_path, capsys):
    write_comparison(tmp_path / "study", tmp_path / "comparison")
    sources = [_pack(tmp_path / d, tmp_path / f"{d}.tar.xz") for d in ("study", "comparison")]
    out = tmp_path / "out"
    assert main(["study", "compare-methods", *map(str, sources), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("odm vs uniform: works (-0.0250 nats, 95% CI [")
    assert "unimax: incomplete, 2 of 3 pairs (unimax-seed3 missing); no verdict" in printed
    doc = json.loads((out / COMPARISON_JSON).read_text())
    again = compare([tmp_path / "study", tmp_path / "comparison"], PROTOCOL)
    assert [r["paired"] and r["paired"]["mean"] for r in doc["results"]] == [
        r.paired and r.paired.mean for r in again["results"]
    ]
    online = next(r for r in doc[EQUAL_COMPUTE]["uniform"] if r["arm"] == "odm_online")
    assert online["paired"]["mean"] == next(
        r.result.paired.mean for r in again["at_compute"]["uniform"] if r.result.arm == "odm_online"
    )
    md = (out / COMPARISON_MD).read_text()
    assert "| odm_online | 3 |" in md and "| unimax | 2 of 3 |" in md and "1.500 | interpolated;" in md
    assert "| 5.500 | extrapolated beyond the largest measured multiple; beyond the corpus" in md
    assert f"doremi study compare-methods {sources[0]} {sources[1]} --out {out}" in md
    assert (out / COMPARISON_PNG).is_file()


def _p_works(t: float) -> float:
    from scipy import stats as st

    return float(st.t.cdf(t, 2))


def test_holm_column_over_the_arms_of_each_view(tmp_path):
    write_comparison(tmp_path / "study", tmp_path / "comparison")
    s = compare([tmp_path / "study", tmp_path / "comparison"], PROTOCOL)
    # View 1's family is the protocol's 14 arms against uniform, fixed before the runs; the 10
    # without a verdict count with p = 1. Judged: natural and regmix (constant differences, p ~ 0),
    # odm and odm_online (both t = mean / SE = -0.025 / (0.005 / sqrt 3) = -5 sqrt 3 on 2 df):
    # sorted p x 14, 13, 12, 11 with the step-down's running maximum: 12 p for both.
    p = _p_works(-5 * math.sqrt(3))
    holm = s["holm"][EQUAL_TOKENS]
    assert sorted(holm) == ["natural", "odm", "odm_online", "regmix"]
    assert {a: h.family for a, h in holm.items()} == dict.fromkeys(holm, 14)
    assert holm["odm"].p_adjusted == pytest.approx(12 * p, rel=1e-9) and 12 * p > 0.05
    assert holm["odm_online"].p_adjusted == pytest.approx(12 * p, rel=1e-9)
    assert holm["odm"].cell() == f"inconclusive (p {12 * p:.3f}, 14 arms)" and holm["natural"].verdict == "worse"
    # View 2 against natural: the protocol's arms less uniform and natural itself.
    assert {h.family for h in s["holm"]["natural"].values()} == {13}
    md = format_markdown(s, PROTOCOL)
    assert "| of which search, per seed | Holm |" in md and "| natural there | Holm |" in md
    assert f"| inconclusive (p {12 * p:.3f}, 14 arms) |" in md


def test_voided_by_scopes_a_run_to_the_arms_that_use_it():
    stages = {"doremi": ("reference", "proxy"), "odm": ("odm_proxy",)}
    others = ARMS - {"uniform"}  # the rule's baseline is no arm of any view
    doremi = {"doremi"}
    assert voided_by(PROTOCOL, "reference", stages) == {EQUAL_TOKENS: doremi, "uniform": doremi, "natural": doremi}
    assert voided_by(PROTOCOL, "odm_proxy", stages)[EQUAL_TOKENS] == {"odm"}
    # A baseline's runs: every arm judged against it, in the view that reads them.
    assert voided_by(PROTOCOL, "uniform_x2", stages) == {EQUAL_TOKENS: set(), "uniform": others, "natural": set()}
    assert voided_by(PROTOCOL, "uniform", stages) == {EQUAL_TOKENS: others, "uniform": others, "natural": set()}
    nat = voided_by(PROTOCOL, "natural", stages)
    assert nat == {EQUAL_TOKENS: {"natural"}, "uniform": {"natural"}, "natural": others - {"natural"}}


def test_a_guardrail_voids_that_arm_only_in_both_views(tmp_path, capsys):
    study, comparison = tmp_path / "study", tmp_path / "comparison"
    write_comparison(study, comparison)
    for s_ in SEEDS:  # DoReMi on the study's reference and proxy; seed 2's reference memorised
        search_run(study, f"reference-seed{s_}", s_, gap=0.3 if s_ == 2 else 0.12)
        search_run(study, f"proxy-seed{s_}", s_)
        main_run(study, f"doremi-seed{s_}", uniform(s_) - 0.02 - 0.001 * s_, s_)
    epochs = {d: 2.5 if d == "prose" else 0.5 for d in DOMAINS}
    with (comparison / "odm-seed2" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": STEPS, "epochs": epochs}) + "\n")
    out = tmp_path / "out"
    assert main(["study", "compare-methods", str(study), str(comparison), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    s = compare([study, comparison], PROTOCOL)
    odm_void, doremi_void = "epochs of odm-seed2", "memorisation of reference-seed2"
    views = [s["results"], *([a.result for a in s["at_compute"][b]] for b in ("uniform", "natural"))]
    for rows in views:
        by_arm = {r.arm: r for r in rows}
        assert by_arm["odm"].void == odm_void and by_arm["odm"].verdict == f"void (guardrail: {odm_void})"
        online = by_arm["odm_online"]
        assert online.void is None and online.verdict == online.paired.verdict  # it stands
        if "doremi" in by_arm:
            assert by_arm["doremi"].verdict == f"void (guardrail: {doremi_void})"
    assert "doremi" in {r.arm for r in s["results"]}
    assert "odm vs uniform: void (guardrail: epochs of odm-seed2) (-0.0250 nats" in printed
    # Holm's family keeps the voided arm at p = 1: judged natural, regmix (p ~ 0) and odm_online
    # (rank 3 of the 14: multiplier 12).
    holm = s["holm"][EQUAL_TOKENS]
    assert sorted(holm) == ["natural", "odm_online", "regmix"]
    assert holm["odm_online"].p_adjusted == pytest.approx(12 * _p_works(-5 * math.sqrt(3)), rel=1e-9)
    md = (out / COMPARISON_MD).read_text()
    assert md.count(f"| void (guardrail: {odm_void}) |") == 3 and "| void |" in md
    assert "The study does not count" not in md and "the others stand" in md
    assert s["guardrails"][0].startswith("odm-seed2: prose: ") and len(s["guardrails"]) == 2
    doc = json.loads((out / COMPARISON_JSON).read_text())
    assert next(r for r in doc["results"] if r["arm"] == "odm")["void"] == odm_void
    assert next(r for r in doc[EQUAL_COMPUTE]["uniform"] if r["arm"] == "odm")["void"] == odm_void
    assert doc["holm"][EQUAL_TOKENS]["odm_online"]["family"] == 14 and "odm" not in doc["holm"]["uniform"]


def test_the_plots_baseline_curve_is_the_tables_interpolation(tmp_path):
    write_comparison(tmp_path / "study", tmp_path / "comparison")
    s = compare([tmp_path / "study", tmp_path / "comparison"], PROTOCOL)
    line = s["baseline_line"]["uniform"]
    assert len(line) == 33
    assert [f for f, _ in line[::32]] == pytest.approx([PLAIN, 2 * PLAIN], rel=1e-12)
    # The middle point, at sqrt(2)x: per seed and domain L1 (L2 / L1)^(1/2), mean over both.
    mid = np.mean([np.mean(np.sqrt(losses(uniform(k)) * losses(uniform(k) + X2))) for k in SEEDS])
    assert line[16] == pytest.approx((math.sqrt(2) * PLAIN, mid), rel=1e-12)
    assert line[0][1] == pytest.approx(np.mean([uniform(k) for k in SEEDS]), rel=1e-12)
    # A straight segment on the log axis would be the mean of the endpoints there; the curve is below.
    assert line[16][1] < np.mean([uniform(k) + X2 / 2 for k in SEEDS])


@pytest.mark.parametrize("bad", ["archive", "corpus", "search_corpus", "no_uniform"])
def test_bad_sources_are_one_line_and_write_nothing(tmp_path, capsys, bad):
    study, comparison = tmp_path / "study", tmp_path / "comparison"
    write_comparison(study, comparison)
    sources = [study, comparison]
    if bad == "archive":
        sources[1] = tmp_path / "comparison.tar.xz"
        sources[1].write_bytes(b"not xz")
        want = f"{sources[1]}: not a readable tar archive"
    elif bad == "corpus":
        write_run(comparison, "temperature-seed1", 3.0, 1)  # domains a, b
        want = f"{comparison / 'temperature-seed1'}: domains a, b are not the comparison's corpus"
    elif bad == "search_corpus":
        write_search_run(comparison, "doge_proxy-seed1", 1)  # domains a, b
        want = f"{comparison / 'doge_proxy-seed1'}: domains a, b are not the comparison's corpus"
    else:
        for s in SEEDS:
            for f in (study / f"uniform-seed{s}").iterdir():
                f.unlink()
            (study / f"uniform-seed{s}").rmdir()
        want = f"{study}, {comparison}: no uniform-seed<k> run"
    out = tmp_path / "out"
    assert main(["study", "compare-methods", *map(str, sources), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"doremi study: error: {want}")
    assert not out.exists()


def test_online_arms_own_pairs_go_through_the_gate_and_a_no_go_is_flagged(tmp_path, capsys):
    """An online arm's search is its main run, so it is not pooled: its own pairs' sigma_D goes
    through the calibration's gate (as the study's calibration_doremi/), and a NO-GO is reported
    with the pairs it would need, its verdict flagged, and no seed added. The per-seed doremi is a
    secondary row: reported, outside Holm's family."""
    import shutil

    from doremi.study.calibration import decide

    study, comparison = tmp_path / "study", tmp_path / "comparison"
    write_comparison(study, comparison)
    s = compare([study, comparison], PROTOCOL)
    assert list(s["own_gate"]) == ["odm_online"]  # only the online arms; the pooled and static have the calibration's
    spread = stats.sigma_d(ONLINE)
    assert s["own_gate"]["odm_online"] == decide(spread, DESIGN.gate, DESIGN.rule) and s["own_gate"]["odm_online"].go
    wide = [-0.10, 0.0, 0.05]
    for seed, d in zip(SEEDS, wide):
        shutil.rmtree(comparison / f"odm_online-seed{seed}")
        online_run(comparison, f"odm_online-seed{seed}", uniform(seed) + d, seed)
    for seed in SEEDS:  # the study's per-seed DoReMi, every guardrail holding
        search_run(study, f"reference-seed{seed}", seed)
        search_run(study, f"proxy-seed{seed}", seed)
        main_run(study, f"doremi-seed{seed}", uniform(seed) - 0.02 - 0.001 * seed, seed)
    out = tmp_path / "out"
    assert main(["study", "compare-methods", str(study), str(comparison), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    s = compare([study, comparison], PROTOCOL)
    gate = s["own_gate"]["odm_online"]
    need = stats.pairs_needed(stats.sigma_d(wide), DESIGN.rule.mde, DESIGN.rule.alpha, DESIGN.rule.power)
    assert not gate.go and gate.power_pairs == need and need > 6
    assert len(s["seeds"]) == 3 and {r.arm: len(r.seeds) for r in s["results"]}["odm_online"] == 3  # no seed added
    assert f"[NO-GO on its own pairs: needs {need}; underpowered]" in printed
    md = (out / COMPARISON_MD).read_text()
    assert f"| **NO-GO**: needs {need} pairs for 0.02 nats; verdict underpowered, no seeds added |" in md
    # the secondary doremi: judged by the rule, outside Holm's family (still 14 arms), said so
    assert "doremi" in {r.arm for r in s["results"]} and "doremi" not in s["holm"][EQUAL_TOKENS]
    assert {h.family for h in s["holm"][EQUAL_TOKENS].values()} == {14}
    assert "| outside the family (secondary) |" in md
    assert "[secondary: outside Holm's family, not judged for the comparison]" in printed
    assert "doremi: a secondary row, outside Holm's family and not judged for the comparison's question" in md
    doc = json.loads((out / COMPARISON_JSON).read_text())
    assert doc["own_gate"]["odm_online"]["go"] is False and doc["own_gate"]["odm_online"]["power_pairs"] == need


def test_a_pooled_arm_off_its_pool_is_one_line_and_writes_nothing(tmp_path, capsys):
    """The study's check_pooled, reused: one seed's main run on another weights file, or a pool of
    other seeds' searches, refuses the comparison."""
    study, comparison = tmp_path / "study", tmp_path / "comparison"
    write_comparison(study, comparison)
    (comparison / "regmix-seed2" / "run.json").write_text(
        json.dumps({"keys": {"data.domain_weights (content)": "0123456789abcdef"}})
    )
    out = tmp_path / "out"
    assert main(["study", "compare-methods", str(study), str(comparison), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "regmix: a pooled arm trains every seed on one weights file, but its runs read" in err[0]
    assert not out.exists()
    regmix = [comparison / f"regmix-seed{k}" for k in SEEDS]
    (comparison / "regmix_pooled" / "regmix.json").unlink()
    write_pool(comparison, "regmix_pooled", "regmix.json", "sweep", [f"sweep-seed{k}" for k in SEEDS], regmix)
    compare([study, comparison], PROTOCOL)  # every seed back on the pool
    odm = [comparison / f"odm-seed{k}" for k in SEEDS]
    (comparison / "odm_pooled" / "weights.json").unlink()
    write_pool(comparison, "odm_pooled", "weights.json", "run", ["odm_proxy-seed1", "odm_proxy-seed2"], odm)
    with pytest.raises(
        StudyError,
        match="odm: its weights odm_pooled/weights.json pool odm_proxy-seed1, odm_proxy-seed2; the design pools odm_proxy-seed1, odm_proxy-seed2, odm_proxy-seed3",
    ):
        compare([study, comparison], PROTOCOL)
