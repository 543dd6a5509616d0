"""`doremi study calibrate ROOT`: the calibration's noise and the go/no-go gate (issue 34,
docs/design.md section 4e).

Before a study spends its budget, main runs on its exact setting (DESIGN.calibration: uniform
and fixed DoReMi weights, seeds 1-4, paired by seed) measure sigma_run (the endpoint's spread
across seeds within an arm), sigma_D (the spread of the pair differences) and the throughput.
From sigma_D the gate computes the pairs the study needs (the design's table, and the power
rule: a minimum detectable effect of Rule.mde at Rule.power) and says GO with n pairs, or NO-GO
with the reason and what to change. It writes calibration.json and calibration.md either way; a
refusal is then one line and exit status 2.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from data.atomic import atomic_write_text
from doremi.reports.outputs import WRITTEN_BY, check_outputs, md_mark
from doremi.study import stats
from doremi.study.design import DESIGN, Design, Gate, Rule, config_differences
from doremi.study.runs import Pairs, RunResult, StudyError, find_runs, pair_runs
from doremi.study.sharing import shares_of

CALIBRATION_JSON = "calibration.json"
CALIBRATION_MD = "calibration.md"
COMMAND = "doremi study calibrate"


class GateRefused(StudyError):
    """The gate's NO-GO: the reason and what to change, one line."""


@dataclass(frozen=True)
class GateDecision:
    """GO with `pairs`, or NO-GO with `reason` and `change` (what to do before the study)."""

    go: bool
    pairs: int | None
    table_pairs: int | None
    power_pairs: int | None
    reason: str
    change: str = ""
    #: Fewer pairs than the calibration plan's were measured: sigma_D is known too loosely for
    #: the study to start on it (`final`); `provisional` names the pairs still missing.
    provisional: str = ""

    @property
    def final(self) -> bool:
        """Whether the study may start on this decision: GO on every planned pair."""
        return self.go and not self.provisional

    def line(self) -> str:
        if self.go:
            head = f"GO with {self.pairs} pairs ({self.reason})"
            return f"PROVISIONAL {head}; {self.provisional}" if self.provisional else head
        return f"NO-GO: {self.reason}; {self.change}"


def decide(sigma_d: float, gate: Gate, rule: Rule, budget_pairs: int | None = None) -> GateDecision:
    """The gate, a pure function of sigma_D: the table's pairs (the first step whose
    max_sigma_d it is within), the power rule's pairs (stats.pairs_needed for rule.mde at
    rule.power, one-sided rule.alpha); GO with the larger if it is within the budget."""
    budget = gate.budget_pairs if budget_pairs is None else budget_pairs
    table = next((s.pairs for s in gate.steps if sigma_d <= s.max_sigma_d), None)
    power = stats.pairs_needed(sigma_d, rule.mde, rule.alpha, rule.power)
    longer = "train longer (more tokens per parameter) or use a smaller model, then calibrate again"
    if table is None:
        return GateDecision(
            False,
            None,
            None,
            power,
            f"sigma_D {sigma_d:.4f} > {gate.steps[-1].max_sigma_d:g}, the gate's largest",
            longer,
        )
    need = max(table, power or math.inf)
    if need > budget:
        shown = "more than 100000" if power is None else str(power)
        return GateDecision(
            False,
            None,
            table,
            power,
            f"sigma_D {sigma_d:.4f} needs {shown} pairs for a detectable effect of {rule.mde:g} nats at "
            f"power {rule.power:g}, more than the budget of {budget}",
            f"raise the budget to {shown} pairs (--budget-pairs), or {longer}",
        )
    return GateDecision(
        True,
        int(need),
        table,
        power,
        f"sigma_D {sigma_d:.4f}: the table asks for {table}, the power rule for {power}",
    )


@dataclass(frozen=True)
class Calibration:
    """What the calibration measured, and the gate's decision on it."""

    arms: tuple[str, str]
    seeds: tuple[int, ...]
    loss_key: str
    split: str
    endpoints: dict[str, list[float]]
    diffs: list[float]
    sigma_run: float
    sigma_d: float
    sigma_d_upper80: float
    power_pairs_upper80: int | None  # the power rule's pairs if sigma_D were its 80% upper bound
    pairing_correlation: float | None
    mde_at_pairs: float  # the detectable effect at the decided (or the design's) pairs
    se_at_pairs: float
    equivalence_pairs: int | None
    tokens_per_s: dict[str, float | None]
    main_seconds: float | None  # a main run's training time at the measured throughput
    setting_differs: list[str]
    decision: GateDecision


def setting_differences(run: RunResult, design: Design) -> list[str]:
    """The keys of a calibration run's config that differ from the design's main stage
    (design.config_differences): the calibration measures the study's setting, or it measures
    nothing the gate can use."""
    if not run.config:
        return ["no config.yaml"]
    return config_differences(dict(run.config), design.main)


def calibration_arms(design: Design, arm: str | None = None) -> tuple[str, str]:
    """(baseline, arm): the plan's, or the plan's baseline against `arm`. A fixed-weight arm
    measures the main runs' noise only; an arm whose mixture a search finds on every seed
    (DoReMi's reference and proxy) adds the spread of what the search finds, which the first
    study measured at 6 times the fixed pairs' sigma_D (docs/design.md section 4e): such a
    method calibrates with pilot pairs of itself."""
    baseline, planned = design.calibration.arms
    if arm == baseline:
        raise StudyError(f"calibration: --arm {arm} is the baseline; name the arm paired with it")
    return baseline, planned if arm is None else arm


def searched_advice(decision: GateDecision, design: Design, arm: str) -> GateDecision:
    """A NO-GO on an arm whose mixture a search finds on every seed: the spread is the search's
    more than the main runs', so the change to make is to the search (or the budget), not the
    main runs' length. A pooled arm's one mixture is not searched per seed: the usual advice."""
    stages = next((a.search_stages for a in design.arms if a.name == arm and not a.pooled), ())
    if decision.go or not stages:
        return decision
    steadier = (
        f"its search ({', '.join(stages)}) finds other weights on every seed: make it steadier (a longer {stages[-1]})"
    )
    if decision.table_pairs is None:  # beyond the table's largest spread no budget is enough
        return replace(decision, change=f"{steadier}, then calibrate again")
    more = f"--budget-pairs {decision.power_pairs}" if decision.power_pairs else "--budget-pairs"
    return replace(decision, change=f"{steadier} or raise the budget ({more}), then calibrate again")


def calibration_pairs(runs: Mapping[tuple[str, int], RunResult], baseline: str, arm: str) -> Pairs:
    """`arm` against `baseline`, paired by seed: both arms present, at least 2 pairs, every run
    evaluated on one split (else StudyError naming what is missing)."""
    for name in (baseline, arm):
        if not any(a == name for a, _ in runs):
            raise StudyError(f"calibration: no {name}-seed<k> run (expected arms {baseline}, {arm})")
    pairs = pair_runs(runs, arm, baseline, strict=True)
    if len(pairs.seeds) < 2:
        raise StudyError(f"calibration: {len(pairs.seeds)} pair ({arm} against {baseline}); sigma_D needs at least 2")
    keys = {(r.loss_key, r.split) for r in (*pairs.runs, *pairs.bases)}
    if len(keys) > 1:
        raise StudyError(f"calibration: runs evaluated on different splits ({', '.join(sorted(map(str, keys)))})")
    return pairs


def calibrate(
    runs: Mapping[tuple[str, int], RunResult],
    design: Design = DESIGN,
    budget_pairs: int | None = None,
    arm: str | None = None,
) -> Calibration:
    """The calibration of `runs` (the baseline's and `arm`'s runs, default the plan's, finished
    and paired by seed, else StudyError naming the runs): sigma_run, sigma_D, throughput, the
    gate's decision."""
    baseline, arm = calibration_arms(design, arm)
    pairs = calibration_pairs(runs, baseline, arm)
    (loss_key, split) = {(r.loss_key, r.split) for r in (*pairs.runs, *pairs.bases)}.pop()
    endpoints = {baseline: [r.endpoint for r in pairs.bases], arm: [r.endpoint for r in pairs.runs]}
    diffs = pairs.diffs
    s_run, s_d = stats.sigma_run(endpoints), stats.sigma_d(diffs)
    decision = searched_advice(decide(s_d, design.gate, design.rule, budget_pairs), design, arm)
    missing = [s for s in design.calibration.seeds if s not in pairs.seeds]
    if missing and decision.go:
        decision = replace(
            decision,
            provisional=(
                f"{len(pairs.seeds)} of the plan's {len(design.calibration.seeds)} pairs: seeds "
                f"{', '.join(map(str, missing))} still to run before the study may start"
            ),
        )
    n = decision.pairs or design.rule.pairs
    upper = stats.sd_upper_bound(s_d, len(diffs), 0.8)
    shares = shares_of(r.path for r in (*pairs.runs, *pairs.bases))

    def rate_of(r: RunResult) -> float | None:
        """The run's tokens/s over its share of the GPU (runs side by side each measure a slice)."""
        return None if r.tokens_per_s is None else r.tokens_per_s / shares.get(r.name, 1.0)

    rates = {
        name: _mean([x for x in map(rate_of, rs) if x is not None])
        for name, rs in ((baseline, pairs.bases), (arm, pairs.runs))
    }
    all_rates = [x for x in map(rate_of, (*pairs.runs, *pairs.bases)) if x is not None]
    rate = _mean(all_rates)
    differs = sorted({f"{r.name}: {x}" for r in (*pairs.runs, *pairs.bases) for x in setting_differences(r, design)})
    return Calibration(
        arms=(baseline, arm),
        seeds=pairs.seeds,
        loss_key=loss_key,
        split=split,
        endpoints=endpoints,
        diffs=diffs,
        sigma_run=s_run,
        sigma_d=s_d,
        sigma_d_upper80=upper,
        power_pairs_upper80=stats.pairs_needed(upper, design.rule.mde, design.rule.alpha, design.rule.power),
        pairing_correlation=stats.pairing_correlation(s_run, s_d),
        mde_at_pairs=stats.detectable_effect(s_d, n, design.rule.alpha, design.rule.power),
        se_at_pairs=s_d / math.sqrt(n),
        equivalence_pairs=stats.equivalence_pairs_needed(s_d, design.rule.margin, design.rule.alpha, design.rule.power),
        tokens_per_s={**rates, "all": rate},
        main_seconds=None if not rate else design.main.schedule.tokens / rate,
        setting_differs=differs,
        decision=decision,
    )


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _f(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def format_markdown(c: Calibration, design: Design = DESIGN) -> str:
    """calibration.md: the runs' endpoints, the measured noise, the gate's decision."""
    from doremi.reports.report import markdown_table

    base, arm = c.arms
    rows = [
        [f"seed {s}", _f(b), _f(a), f"{d:+.4f}"]
        for s, b, a, d in zip(c.seeds, c.endpoints[base], c.endpoints[arm], c.diffs)
    ]
    table = markdown_table(["seed", f"{base} endpoint", f"{arm} endpoint", f"{arm} - {base}"], rows)
    r = design.rule
    n = c.decision.pairs or r.pairs
    measured = markdown_table(
        ["quantity", "value"],
        [
            ["sigma_run (pooled within-arm sd of the endpoint)", _f(c.sigma_run)],
            ["sigma_D (sd of the pair differences)", _f(c.sigma_d)],
            [f"sigma_D, 80% upper bound ({len(c.diffs)} pairs)", _f(c.sigma_d_upper80)],
            ["pairs the power rule would ask at that bound (not gated)", str(c.power_pairs_upper80)],
            ["pairing correlation (1 - sigma_D^2 / (2 sigma_run^2))", _f(c.pairing_correlation, 3)],
            [f"SE of the primary difference at {n} pairs (rule: <= {r.max_se:g})", _f(c.se_at_pairs)],
            [f"detectable effect at {n} pairs (power {r.power:g}, one-sided alpha {r.alpha:g})", _f(c.mde_at_pairs)],
            [f"pairs for TOST at +-{r.margin:g} to show equivalence (true difference 0)", str(c.equivalence_pairs)],
            ["pairs: the design's table", str(c.decision.table_pairs)],
            [f"pairs: the power rule (detectable effect {r.mde:g})", str(c.decision.power_pairs)],
        ]
        + [
            [f"tokens/s, {k} (median of logged intervals over the run's share of the GPU, mean over runs)", _f(v, 0)]
            for k, v in c.tokens_per_s.items()
        ]
        + [["a main run's training at that rate (s)", _f(c.main_seconds, 1)]],
    )
    differs = (
        "\nThe runs' setting differs from the design's main stage (doremi/study/design.py):\n\n"
        + "\n".join(f"- {x}" for x in c.setting_differs)
        + "\n"
        if c.setting_differs
        else "\nThe runs' setting is the design's main stage.\n"
    )
    return f"""# Calibration: {arm} against {base}, {len(c.seeds)} pairs

Endpoint: mean {c.split} loss over domains (`{c.loss_key}`) at the final step. Written by
`doremi study calibrate`.

## Gate: **{c.decision.line()}**

{table}
{measured}{differs}
The mean difference of the calibration pairs ({_f(_mean(c.diffs))}) is not used by the gate.
"""


def to_json(c: Calibration) -> dict[str, Any]:
    out = asdict(c)
    out["decision"]["line"] = c.decision.line()
    out["seeds"] = list(c.seeds)
    return out


def run_calibration(
    root: str | Path, out: str | Path | None = None, budget_pairs: int | None = None, arm: str | None = None
) -> Calibration:
    """Read ROOT's runs, calibrate, write calibration.json and calibration.md to `out` (default
    ROOT), print the table; a NO-GO raises GateRefused after the files are written."""
    from doremi.study.summarize import ARCHIVES, unpack

    source = Path(root)
    if source.is_file() and not source.name.endswith(ARCHIVES):
        raise StudyError(f"{source}: expected a directory or a {', '.join(ARCHIVES)} archive")
    if source.is_file() and out is None:
        raise StudyError(f"{source}: an archive is read, not written into: give --out")
    dest = Path(out) if out is not None else source
    check_outputs(dest, (CALIBRATION_JSON, CALIBRATION_MD), COMMAND)
    with tempfile.TemporaryDirectory(prefix="doremi-calibration-") as tmp:
        runs_root = unpack(source, Path(tmp)) if source.is_file() else source
        c = calibrate(find_runs(runs_root, calibration_arms(DESIGN, arm)), DESIGN, budget_pairs, arm)
    dest.mkdir(parents=True, exist_ok=True)
    atomic_write_text(dest / CALIBRATION_JSON, json.dumps({WRITTEN_BY: COMMAND, **to_json(c)}, indent=1) + "\n")
    text = format_markdown(c)
    atomic_write_text(dest / CALIBRATION_MD, md_mark(COMMAND) + text)
    print(text, end="")
    print(f"written: {dest / CALIBRATION_JSON}, {dest / CALIBRATION_MD}")
    if not c.decision.go:
        raise GateRefused(c.decision.line())
    return c
