"""`doremi compare ROOT [ROOT ...] --out DIR`: mixtures against a baseline over several seeds.

Each root is one pipeline run (one seed) with main runs under `main/<mixture>/`. Within a
root, a mixture and the baseline share the seed, so the comparison is paired: per seed, the
difference of mean (and worst-case) validation loss over domains; over seeds, its mean,
standard error (sample std / sqrt(n)), t-based 95% interval and paired t-test. One seed's difference says little; the standard error
says how much the mean would move with other seeds.

Pooling is only sound when the roots differ in their seeds alone: roots run with another eta or
other main-run steps pooled as "2 seeds" give a standard error of something else. So every
run's saved `config.yaml` is compared across the roots (`settings`, `differences`), seeds and the
keys that change no result (`trainer.records.run_dir.NOT_RESULT_KEYS`) aside, paths inside a root read
relative to it; a difference is refused naming the keys, or, with `allow_differences`, listed in
the output. The output also shows each root's seeds and the weights each main run trained on
(docs/design.md section 4b).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data import artifact
from data.atomic import atomic_write_text
from doremi.config import ExperimentConfig, upgrade_saved
from doremi.errors import DoReMiError
from doremi.outputs.stage_markers import eval_result
from doremi.reports.outputs import check_outputs, md_mark, png_metadata
from doremi.reports.report import _save, domains_better, markdown_table, speedup, steps_to_target
from doremi.study.stats import paired_test
from trainer.records.metrics import read_jsonl
from trainer.records.run_dir import NOT_RESULT_KEYS

COMPARE_MD = "compare.md"
COMPARE_PNG = "compare.png"
COMMAND = "doremi compare"


@dataclass
class MainRun:
    """A main run's final per-domain validation loss and its mean-loss curve; `step`: the step
    its final numbers are at, `planned`: the steps its config asks for (None: unknown)."""

    domains: list[str]
    final: list[float]
    curve: list[tuple[int, float]] = field(default_factory=list)
    step: int | None = None
    planned: int | None = None
    # (train.seed, data.seed) of its config; None: unknown.
    seeds: tuple[int, int] | None = None
    # The weights it trained on, one per domain (an online run: the mean of its sampling
    # weights); None: unknown.
    weights: list[float] | None = None

    @property
    def unfinished(self) -> bool:
        return self.step is not None and self.planned is not None and self.step < self.planned


# -- statistics (pure) -----------------------------------------------------------------------


def mean_se(xs: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error (sample standard deviation / sqrt(n)); no error for n = 1."""
    n = len(xs)
    if n == 0:
        raise ValueError("mean_se: expected at least one value, got none")
    mean = sum(xs) / n
    if n == 1:
        return mean, None
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


@dataclass
class Paired:
    """One mixture against the baseline over the roots that have both."""

    mixture: str
    baseline: str
    roots: list[str]
    k: int
    mean_diff: list[float]
    worst_diff: list[float]
    improved: list[int]
    improved_in_mean: int
    speedups: list[float | None]

    @property
    def mean(self) -> tuple[float, float | None]:
        return mean_se(self.mean_diff)

    @property
    def worst(self) -> tuple[float, float | None]:
        return mean_se(self.worst_diff)


def pair(
    mixture: str, baseline: str, roots: Sequence[str], runs: Sequence[MainRun], bases: Sequence[MainRun]
) -> Paired:
    """Per seed (root): mean loss difference (mixture - baseline, negative is better), worst
    case difference, domains improved, and the speed-up to the baseline's final mean loss; and
    the domains whose loss difference averaged over seeds is negative."""
    k = len(runs[0].final)
    mean_diff, worst_diff, improved, speedups = [], [], [], []
    per_domain = [0.0] * k
    for run, base in zip(runs, bases):
        mean_diff.append(sum(run.final) / k - sum(base.final) / k)
        worst_diff.append(max(run.final) - max(base.final))
        improved.append(domains_better(run.final, base.final))
        per_domain = [acc + a - b for acc, a, b in zip(per_domain, run.final, base.final)]
        if run.curve and base.curve:
            speedups.append(speedup(base.curve[-1][0], steps_to_target(run.curve, base.curve[-1][1])))
        else:
            speedups.append(None)
    return Paired(
        mixture,
        baseline,
        list(roots),
        k,
        mean_diff,
        worst_diff,
        improved,
        sum(d / len(runs) < 0 for d in per_domain),
        speedups,
    )


# -- reading roots -------------------------------------------------------------------------


def _planned(run: Path) -> tuple[int | None, tuple[int, int] | None]:
    """train.steps and (train.seed, data.seed) of the run's saved config.yaml; None without one."""
    import yaml

    path = run / "config.yaml"
    if not path.is_file():
        return None, None
    cfg = yaml.safe_load(path.read_text()) or {}
    train, data = cfg.get("train", {}), cfg.get("data", {})
    steps = train.get("steps")
    seeds = (train.get("seed"), data.get("seed"))
    return (int(steps) if isinstance(steps, int) else None), (seeds if None not in seeds else None)


def read_main_run(run: Path) -> MainRun | None:
    """The run's eval result (the pipeline's eval stage, of its last checkpoint: at its last
    logged step), else its last validation row; the curve from its validation rows. None when
    it has neither."""
    all_rows = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    rows = [r for r in all_rows if isinstance(r.get("val_loss"), dict)]
    curve = [(int(r["step"]), sum(r["val_loss"].values()) / len(r["val_loss"])) for r in rows]
    planned, seeds = _planned(run)
    result = eval_result(run)
    if result is not None:
        last = max((int(r["step"]) for r in all_rows if "step" in r), default=None)
        domains = list(result["domains"])
        final = [float(x) for x in result["val_loss"]]
        return MainRun(domains, final, curve, last, planned, seeds, weights_used(run, domains))
    if rows:
        val = rows[-1]["val_loss"]
        domains = list(val)
        return MainRun(
            domains,
            [float(x) for x in val.values()],
            curve,
            int(rows[-1]["step"]),
            planned,
            seeds,
            weights_used(run, domains),
        )
    return None


def weights_used(run: Path, domains: list[str]) -> list[float] | None:
    """The weights a main run trained on: the mean of the sampling weights it logged (a method
    run online), else its fixed mixture (`doremi.reports.summary.run_mixture`); None
    when neither can be read (the table then says so)."""
    import yaml

    from data.errors import UserError
    from data.store.store import read_manifest
    from doremi.reports.summary import logged_weights, run_mixture

    history = logged_weights(run, "sampling") if (run / "domain_weights.jsonl").is_file() else []
    if history:
        return [float(x) for x in (sum(h[i] for h in history) / len(history) for i in range(len(domains)))]
    path = run / "config.yaml"
    if not path.is_file():
        return None
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
        data = cfg.get("data", {})
        manifest = read_manifest(data["store_dir"])
        if manifest.domain_names != domains:
            return None
        return [float(x) for x in run_mixture(data["domain_weights"], manifest, run)]
    except (UserError, OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


# -- settings: roots must differ in their seeds only -------------------------------------------

#: The runs of a root whose saved configs are compared (the sweep's many runs are not: its
#: `sweep.json` keys are the stage's own check).
SETTING_RUNS = (
    "round*/reference",
    "round*/proxy",
    "round*/search*/reference",
    "round*/search*/proxy",
    "methods/*/proxy",
    "methods/*/search*/proxy",
    "main/*",
)


def is_seed(key: str) -> bool:
    """A key that is a seed (`train.seed`, `data.seed`, `data.split_seed`, `sweep.seed`, ...):
    the one thing the roots of a comparison are meant to differ in."""
    return key.rsplit(".", 1)[-1].endswith("seed")


def _flat(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flat(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = value


def _new_path(record_key: str) -> str:
    """A record key (a moved section named by its old path) as the config writes it now."""
    for old, new in ExperimentConfig.MOVED.items():
        if record_key == old or record_key.startswith(old + "."):
            return new + record_key[len(old) :]
    return record_key


def _relative(value: Any, root: str) -> Any:
    """A path inside `root` as `<root>/...`, so that a root's own files compare equal."""
    if isinstance(value, str) and (value == root or value.startswith(root + os.sep)):
        return "<root>" + value[len(root) :]
    if isinstance(value, list):
        return [_relative(v, root) for v in value]
    return value


def settings(root: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Run (relative to the root) -> its saved config's keys that can change a result, flat
    (`mixing.doremi.eta`), seeds left out, paths inside the root relative to it."""
    import yaml

    base = Path(root).resolve()
    out: dict[str, dict[str, Any]] = {}
    for pattern in SETTING_RUNS:
        for run in sorted(base.glob(pattern)):
            path = run / "config.yaml"
            if not path.is_file():
                continue
            flat: dict[str, Any] = {}
            _flat(upgrade_saved(yaml.safe_load(path.read_text()) or {}), "", flat)
            ignored = (*NOT_RESULT_KEYS, *(_new_path(k) for k in ExperimentConfig.RECORD_IGNORES))
            out[str(run.relative_to(base))] = {
                k: _relative(v, str(base))
                for k, v in flat.items()
                if not is_seed(k) and not any(k == p or k.startswith(p + ".") for p in ignored)
            }
    return out


@dataclass
class Difference:
    """A key whose value differs between roots: the runs it differs in, its value per root."""

    key: str
    runs: list[str]
    values: dict[str, Any]

    def describe(self, total_runs: int) -> str:
        where = "" if len(self.runs) == total_runs else " in " + _some(self.runs)
        return f"{self.key}{where} (" + ", ".join(f"{r}: {_short(v)}" for r, v in self.values.items()) + ")"


def differences(by_root: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[Difference]:
    """The keys whose values differ between roots, over the runs the roots have in common
    (`settings` per root); a key absent from a run reads as `<absent>`."""
    roots = list(by_root)
    if len(roots) < 2:
        return []
    common = [r for r in by_root[roots[0]] if all(r in by_root[x] for x in roots[1:])]
    found: dict[str, Difference] = {}
    for run in common:
        keys = sorted(set().union(*(by_root[x][run] for x in roots)))
        for key in keys:
            values = {x: by_root[x][run].get(key, "<absent>") for x in roots}
            if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
                found.setdefault(key, Difference(key, [], values)).runs.append(run)
    return list(found.values())


def _short(value: Any, width: int = 40) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def _some(items: Sequence[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def read_root(root: str | os.PathLike) -> dict[str, MainRun]:
    """Mixture name -> its main run, for one pipeline root (a root whose artifact header says
    it is something else, a run directory say, is refused; one made before headers is read)."""
    artifact.require(root, "pipeline", finished=False, what="pipeline run root")
    main = Path(root) / "main"
    runs = {}
    if main.is_dir():
        for d in sorted(main.iterdir()):
            run = read_main_run(d) if d.is_dir() else None
            if run is not None:
                runs[d.name] = run
    if not runs:
        raise DoReMiError(
            f"{root}: not a pipeline run (expected main/<mixture>/ with eval results or "
            f"validation rows in metrics.jsonl)"
        )
    return runs


def compare(roots: dict[str, dict[str, MainRun]], baseline: str) -> tuple[list[Paired], list[str]]:
    """Every mixture against `baseline`, each over the roots that have both; and notes saying
    which roots a comparison left out."""
    names = list(roots)
    with_base = [r for r in names if baseline in roots[r]]
    if not with_base:
        raise DoReMiError(
            f"--baseline {baseline}: no root has main/{baseline} "
            f"(mixtures found: {', '.join(sorted({m for r in roots.values() for m in r}))})"
        )
    notes = [f"{r}: no main/{baseline}; left out of every comparison" for r in names if r not in with_base]
    domains = roots[with_base[0]][baseline].domains
    for r in list(with_base):
        if roots[r][baseline].unfinished:
            with_base.remove(r)
            notes.append(
                f"{r}: main/{baseline} is unfinished ({_at(roots[r][baseline])}); left out of every comparison"
            )
    if not with_base:
        raise DoReMiError(f"--baseline {baseline}: unfinished in every root ({'; '.join(notes)})")
    notes += _same_seeds({r: roots[r][baseline] for r in with_base}, baseline)
    for r in names:
        for m, run in roots[r].items():
            if run.domains != domains:
                raise DoReMiError(
                    f"{r}/main/{m}: domains {run.domains} differ from {domains} ({with_base[0]}/main/{baseline})"
                )
    mixtures = sorted({m for r in with_base for m in roots[r] if m != baseline})
    out = []
    for m in mixtures:
        have = []
        for r in (r for r in with_base if m in roots[r]):
            run, base = roots[r][m], roots[r][baseline]
            if run.unfinished:
                notes.append(f"{r}/main/{m}: unfinished ({_at(run)}); left out")
            elif None not in (run.step, base.step) and run.step != base.step:
                notes.append(f"{r}/main/{m}: final loss at step {run.step}, {baseline}'s at {base.step}; left out")
            else:
                have.append(r)
        if not have:
            continue
        if len(have) < len(with_base):
            missing = [r for r in with_base if m not in roots[r]]
            where = f" (missing in {', '.join(missing)})" if missing else ""
            notes.append(f"{m}: compared over {len(have)} of {len(with_base)} roots{where}")
        out.append(pair(m, baseline, have, [roots[r][m] for r in have], [roots[r][baseline] for r in have]))
    return out, notes


def _same_seeds(bases: dict[str, MainRun], baseline: str) -> list[str]:
    """Roots whose baselines ran the same seeds: their differences are not independent draws,
    so the standard error over them understates the seed-to-seed noise."""
    by_seeds: dict[tuple[int, int], list[str]] = {}
    for r, run in bases.items():
        if run.seeds is not None:
            by_seeds.setdefault(run.seeds, []).append(r)
    return [
        f"{', '.join(rs)}: main/{baseline} ran the same seeds (train.seed {t}, data.seed {d}): not independent "
        "seeds, so the standard error understates the noise"
        for (t, d), rs in by_seeds.items()
        if len(rs) > 1
    ]


def _at(run: MainRun) -> str:
    return f"final loss at step {run.step} of {run.planned}"


# -- output --------------------------------------------------------------------------------


def _pm(mean: float, se: float | None) -> str:
    return f"{mean:+.4f}" + ("" if se is None else f" ± {se:.4f}")


def _t_columns(diffs: Sequence[float]) -> list[str]:
    """The t-based 95% interval of the mean difference and its paired t-test (t, two-sided p);
    `-` with fewer than two seeds."""
    if len(diffs) < 2:
        return ["-", "-"]
    test = paired_test(diffs)
    p = min(1.0, 2 * min(test.p_lower, test.p_upper))
    return [f"[{test.ci[0]:+.4f}, {test.ci[1]:+.4f}]", f"t {test.t:+.2f}, p {p:.3f}"]


def _loss_columns(baseline: str) -> list[str]:
    """The headers of the two differences both tables show (`Paired.mean`/`mean_diff` and
    `worst`/`worst_diff`), one wording for the summary and the per-seed rows."""
    return [f"mean loss - {baseline}", f"worst-case loss - {baseline}"]


def _speed(s: float | None) -> str:
    return "not reached" if s is None else f"{s:.2f}x"


def roots_table(roots: Mapping[str, Mapping[str, MainRun]], diffs: Sequence[Difference], baseline: str) -> str:
    """One row per root: its seeds (its baseline's config) and its value of each key the roots
    differ in."""
    rows = []
    for label, runs in roots.items():
        any_run = runs.get(baseline) or next(iter(runs.values()))
        seeds = any_run.seeds or ("?", "?")
        rows.append([label, str(seeds[0]), str(seeds[1]), *(_short(d.values[label]) for d in diffs)])
    return markdown_table(["root", "train.seed", "data.seed", *(d.key for d in diffs)], rows)


def weights_table(roots: Mapping[str, Mapping[str, MainRun]]) -> str | None:
    """Per mixture and root, the weights its main run trained on (None: no domains known)."""
    first = next((run for runs in roots.values() for run in runs.values()), None)
    if first is None:
        return None
    mixtures = sorted({m for runs in roots.values() for m in runs})
    rows = [
        [m, label, *(f"{w:.4f}" for w in run.weights)]
        if run.weights is not None
        else [m, label, *(["?"] * len(first.domains))]
        for m in mixtures
        for label, runs in roots.items()
        if (run := runs.get(m)) is not None
    ]
    return markdown_table(["mixture", "root", *first.domains], rows)


def _summary_table(results: Sequence[Paired], baseline: str) -> str:
    """One row per mixture: mean ± SE over seeds, per-seed counts, and the mean's t columns."""
    return markdown_table(
        [
            "mixture",
            "seeds",
            *_loss_columns(baseline),
            "domains better per seed",
            "domains better in the mean",
            "speed-up per seed",
            "mean: 95% interval",
            "mean: paired t-test",
        ],
        [
            [
                p.mixture,
                str(len(p.roots)),
                _pm(*p.mean),
                _pm(*p.worst),
                ", ".join(f"{n}/{p.k}" for n in p.improved),
                f"{p.improved_in_mean}/{p.k}",
                ", ".join(_speed(s) for s in p.speedups),
                *_t_columns(p.mean_diff),
            ]
            for p in results
        ],
    )


def _per_seed_table(results: Sequence[Paired], baseline: str) -> str:
    """One row per (mixture, seed): the differences each seed's pair gives."""
    return markdown_table(
        [
            "mixture",
            "root",
            *_loss_columns(baseline),
            "domains better",
            f"speed-up to {baseline}'s final loss",
        ],
        [
            [p.mixture, r, f"{a:+.4f}", f"{w:+.4f}", f"{n}/{p.k}", _speed(s)]
            for p in results
            for r, a, w, n, s in zip(p.roots, p.mean_diff, p.worst_diff, p.improved, p.speedups)
        ],
    )


def format_compare(
    results: Sequence[Paired],
    notes: Sequence[str],
    baseline: str,
    roots: str | None = None,
    weights: str | None = None,
) -> str:
    """The summary table (one row per mixture), the per-seed table, the roots' seeds and
    differing keys (`roots`), the weights each seed trained on (`weights`; `?`: unknown), and
    the notes."""
    summary = _summary_table(results, baseline)
    per_seed = _per_seed_table(results, baseline)
    parts = [
        f"# Mixtures against {baseline}, paired by seed",
        "",
        summary,
        "Differences are mixture minus baseline in nats per token (negative: the mixture is better), "
        "mean ± standard error over seeds (sample std / sqrt(n)); the mean's 95% interval is t-based "
        "(mean ± t_{0.975,n-1} SE: with 4 seeds ± 3.18 SE, not ± 2) and its paired t-test two-sided "
        "(doremi/study/stats.py paired_test). Domains better: final validation "
        "loss strictly lower. Speed-up: the baseline's steps over the first evaluation step where the "
        "mixture's mean loss reaches the baseline's final mean.",
        "",
        "## Per seed",
        "",
        per_seed,
    ]
    if roots:
        parts += ["## Roots", "", roots, "Seeds of each root, and its value of every key the roots differ in.", ""]
    if weights:
        parts += ["## Weights per seed", "", weights, "The weights each main run trained on.", ""]
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(parts) + "\n"


def plot_compare(path: Path, results: Sequence[Paired], baseline: str) -> None:
    """Per mixture, each seed's difference (dots) and the mean with its t-based 95% interval
    (bar), for the mean and the worst-case loss."""
    from matplotlib.figure import Figure

    from doremi.reports.report import _colors

    fig = Figure(figsize=(max(6.0, 1.6 * len(results) + 3), 3.8), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, what, attr in ((axes[0], "mean", "mean_diff"), (axes[1], "worst-case", "worst_diff")):
        for i, (p, c) in enumerate(zip(results, _colors(max(len(results), 1)))):
            diffs = getattr(p, attr)
            mean, se = mean_se(diffs)
            half = paired_test(diffs).ci[1] - mean if len(diffs) > 1 else 0.0
            ax.scatter([i + 0.15] * len(diffs), diffs, color=c, s=14, alpha=0.7)
            ax.errorbar([i - 0.05], [mean], yerr=[half], color=c, fmt="o", capsize=4)
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xticks(range(len(results)), [p.mixture for p in results])
        ax.set(title=f"{what} validation loss - {baseline}", ylabel="nats per token")
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path, png_metadata(COMMAND))


def compare_roots(
    roots: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    baseline: str = "uniform",
    allow_differences: bool = False,
) -> str:
    """Read every root, compare, write `out/compare.md` and `out/compare.png`; return the
    markdown. Roots are named by their directory names (their paths when two share a name).
    Every input is checked before anything is written: roots that differ in anything but their
    seeds are refused, naming the keys, unless `allow_differences` (then listed in the output)."""
    if not roots:
        raise DoReMiError("compare: expected at least one pipeline run root, got none")
    paths = [str(r) for r in roots]
    if len(set(paths)) < len(paths):
        raise DoReMiError(f"compare: a root is given twice ({', '.join(paths)})")
    check_outputs(Path(out), (COMPARE_MD, COMPARE_PNG), COMMAND)
    names = [Path(r).resolve().name for r in roots]
    labels = names if len(set(names)) == len(names) else paths
    read = {label: read_root(r) for label, r in zip(labels, roots)}
    by_root = {label: settings(r) for label, r in zip(labels, roots)}
    diffs = differences(by_root)
    runs = len([r for r in by_root[labels[0]] if all(r in by_root[x] for x in labels[1:])])
    if diffs and not allow_differences:
        raise DoReMiError(
            "compare: the roots differ in more than their seeds: "
            + "; ".join(d.describe(runs) for d in diffs)
            + "; pooling them measures those differences, not seed noise (--allow-differences compares them anyway)"
        )
    results, notes = compare(read, baseline)
    if not results:
        raise DoReMiError(f"compare: no mixture besides {baseline} in {', '.join(labels)}")
    if diffs:
        notes.append(
            f"the roots differ in {len(diffs)} key(s) besides their seeds (table 'Roots'): the standard "
            "error mixes those differences with seed noise"
        )
    unknown = [x for x in labels if not by_root[x]]
    if unknown and len(labels) > 1:
        notes.append(f"{', '.join(unknown)}: no saved config.yaml; settings not compared")
    text = format_compare(results, notes, baseline, roots_table(read, diffs, baseline), weights_table(read))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_compare(out_dir / COMPARE_PNG, results, baseline)
    atomic_write_text(out_dir / COMPARE_MD, md_mark(COMMAND) + text + f"\n![comparison]({COMPARE_PNG})\n")
    return text
