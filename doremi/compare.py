"""`doremi compare ROOT [ROOT ...] --out DIR`: mixtures against a baseline over several seeds.

Each root is one pipeline run (one seed) with main runs under `main/<mixture>/`. Within a
root, a mixture and the baseline share the seed, so the comparison is paired: per seed, the
difference of mean (and worst-case) validation loss over domains; over seeds, its mean and
standard error (sample std / sqrt(n)). One seed's difference says little; the standard error
says how much the mean would move with other seeds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from data.atomic import atomic_write_text
from doremi.errors import DoReMiError
from doremi.report import _save, domains_better, markdown_table, speedup, steps_to_target
from doremi.stage_markers import eval_result
from trainer.metrics import read_jsonl

COMPARE_MD = "compare.md"
COMPARE_PNG = "compare.png"


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
        return MainRun(list(result["domains"]), [float(x) for x in result["val_loss"]], curve, last, planned, seeds)
    if rows:
        final = rows[-1]["val_loss"]
        return MainRun(list(final), [float(x) for x in final.values()], curve, int(rows[-1]["step"]), planned, seeds)
    return None


def read_root(root: str | os.PathLike) -> dict[str, MainRun]:
    """Mixture name -> its main run, for one pipeline root."""
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


def _speed(s: float | None) -> str:
    return "not reached" if s is None else f"{s:.2f}x"


def format_compare(results: Sequence[Paired], notes: Sequence[str], baseline: str) -> str:
    """The summary table (one row per mixture), the per-seed table, and the notes."""
    summary = markdown_table(
        [
            "mixture",
            "seeds",
            f"mean loss - {baseline}",
            f"worst-case loss - {baseline}",
            "domains better per seed",
            "domains better in the mean",
            "speed-up per seed",
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
            ]
            for p in results
        ],
    )
    per_seed = markdown_table(
        [
            "mixture",
            "root",
            f"mean loss - {baseline}",
            f"worst-case loss - {baseline}",
            "domains better",
            f"speed-up to {baseline}'s final loss",
        ],
        [
            [p.mixture, r, f"{a:+.4f}", f"{w:+.4f}", f"{n}/{p.k}", _speed(s)]
            for p in results
            for r, a, w, n, s in zip(p.roots, p.mean_diff, p.worst_diff, p.improved, p.speedups)
        ],
    )
    parts = [
        f"# Mixtures against {baseline}, paired by seed",
        "",
        summary,
        "Differences are mixture minus baseline in nats per token (negative: the mixture is better), "
        "mean ± standard error over seeds (sample std / sqrt(n)). Domains better: final validation "
        "loss strictly lower. Speed-up: the baseline's steps over the first evaluation step where the "
        "mixture's mean loss reaches the baseline's final mean.",
        "",
        "## Per seed",
        "",
        per_seed,
    ]
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(parts) + "\n"


def plot_compare(path: Path, results: Sequence[Paired], baseline: str) -> None:
    """Per mixture, each seed's difference (dots) and the mean ± standard error (bar), for the
    mean and the worst-case loss."""
    from matplotlib.figure import Figure

    from doremi.report import _colors

    fig = Figure(figsize=(max(6.0, 1.6 * len(results) + 3), 3.8), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, what, attr in ((axes[0], "mean", "mean_diff"), (axes[1], "worst-case", "worst_diff")):
        for i, (p, c) in enumerate(zip(results, _colors(max(len(results), 1)))):
            diffs = getattr(p, attr)
            mean, se = mean_se(diffs)
            ax.scatter([i + 0.15] * len(diffs), diffs, color=c, s=14, alpha=0.7)
            ax.errorbar([i - 0.05], [mean], yerr=[se or 0.0], color=c, fmt="o", capsize=4)
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xticks(range(len(results)), [p.mixture for p in results])
        ax.set(title=f"{what} validation loss - {baseline}", ylabel="nats per token")
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def compare_roots(roots: Sequence[str | os.PathLike], out: str | os.PathLike, baseline: str = "uniform") -> str:
    """Read every root, compare, write `out/compare.md` and `out/compare.png`; return the
    markdown. Roots are named by their directory names (their paths when two share a name).
    Every input is checked before anything is written."""
    if not roots:
        raise DoReMiError("compare: expected at least one pipeline run root, got none")
    paths = [str(r) for r in roots]
    if len(set(paths)) < len(paths):
        raise DoReMiError(f"compare: a root is given twice ({', '.join(paths)})")
    names = [Path(r).resolve().name for r in roots]
    labels = names if len(set(names)) == len(names) else paths
    results, notes = compare({label: read_root(r) for label, r in zip(labels, roots)}, baseline)
    if not results:
        raise DoReMiError(f"compare: no mixture besides {baseline} in {', '.join(labels)}")
    text = format_compare(results, notes, baseline)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_compare(out_dir / COMPARE_PNG, results, baseline)
    atomic_write_text(out_dir / COMPARE_MD, text + f"\n![comparison]({COMPARE_PNG})\n")
    return text
