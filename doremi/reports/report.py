"""The experiment report: a per-domain table (mixtures, validation loss, loss above the known
entropy) with average and worst-case rows, and PNG plots, written as `report.md`.

Functions take data, not run directories: the caller reads the run directories. Average and
worst case are over domains, the two summaries of Xie et al. 2023 (Table/Fig. 3-4). Plots use
matplotlib's object API on an Agg canvas (no pyplot, no global backend switch), imported only
when a report is written.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from data.atomic import atomic_path, atomic_write_text
from doremi.outputs.main_runs import REFERENCE_RUN

WEIGHTS_PNG = "domain_weights.png"
VAL_LOSS_PNG = "val_loss.png"
FINAL_LOSS_PNG = "final_loss.png"
DIFF_PNG = "loss_vs_baseline.png"

Vector = Sequence[float]


def _check_len(what: str, values: Sequence, k: int) -> None:
    if len(values) != k:
        raise ValueError(f"{what}: expected {k} values (one per domain), got {len(values)}")


def fmt(x: float | None) -> str:
    """A table cell: 4 decimals, empty for None."""
    return "" if x is None else f"{x:.4f}"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _worst(xs: list[float]) -> float | None:
    return max(xs) if xs else None


def bits_per_byte(loss: float, tokens_per_byte: float | None) -> float | None:
    """Nats per token to bits per byte of text: loss * tokens / bytes / ln 2 (None without
    bytes, e.g. synthetic domains). Unlike nats per token, it compares across tokenizers."""
    return None if tokens_per_byte is None else float(loss) * tokens_per_byte / math.log(2)


def format_table(
    domains: Sequence[str],
    mixtures: Mapping[str, Vector],
    losses: Mapping[str, Vector],
    entropy: Sequence[float | None] | None = None,
    tokens_per_byte: Sequence[float | None] | None = None,
) -> str:
    """A markdown table with one row per domain, then `average` and `worst case` rows.

    Columns: the domain's known entropy H (when any domain has one), each mixture's weight,
    each run's validation loss, each run's loss - H (for domains with known entropy), and each
    run's bits per byte (for domains whose validation bytes are known: `tokens_per_byte`).
    Average and worst case (max) are taken over domains; for loss - H and bits per byte, over
    the domains that have them. Weight columns are left empty in the summary rows.
    """
    k = len(domains)
    for name, w in mixtures.items():
        _check_len(f"mixtures[{name!r}]", w, k)
    for name, l in losses.items():
        _check_len(f"losses[{name!r}]", l, k)
    ent = list(entropy) if entropy is not None else [None] * k
    _check_len("entropy", ent, k)
    tpb = list(tokens_per_byte) if tokens_per_byte is not None else [None] * k
    _check_len("tokens_per_byte", tpb, k)
    known = [i for i in range(k) if ent[i] is not None]
    with_bytes = [i for i in range(k) if tpb[i] is not None]

    header = ["domain"] + (["H"] if known else [])
    header += [f"weight: {m}" for m in mixtures] + [f"loss: {r}" for r in losses]
    header += [f"loss - H: {r}" for r in losses] if known else []
    header += [f"bits/byte: {r}" for r in losses] if with_bytes else []

    rows = []
    for i, d in enumerate(domains):
        row = [d] + ([fmt(ent[i])] if known else [])
        row += [fmt(float(w[i])) for w in mixtures.values()]
        row += [fmt(float(l[i])) for l in losses.values()]
        if known:
            row += [fmt(float(l[i]) - ent[i]) if ent[i] is not None else "" for l in losses.values()]
        if with_bytes:
            row += [fmt(bits_per_byte(l[i], tpb[i])) for l in losses.values()]
        rows.append(row)
    for label, agg in (("average", _mean), ("worst case", _worst)):
        row = [f"**{label}**"] + ([""] if known else []) + [""] * len(mixtures)
        row += [fmt(agg([float(x) for x in l])) for l in losses.values()]
        if known:
            row += [fmt(agg([float(l[i]) - ent[i] for i in known])) for l in losses.values()]
        if with_bytes:
            row += [fmt(agg([bits_per_byte(l[i], tpb[i]) for i in with_bytes])) for l in losses.values()]
        rows.append(row)

    return markdown_table(header, rows)


def format_summary(losses: Mapping[str, Vector], baseline: str | None, width: int = 100) -> str:
    """The closing screen: one row per mixture (best average first) with its average and
    worst-case loss over domains and, against `baseline`, both differences and the domains
    better; the per-domain table is in report.md. Names longer than the screen allows are cut
    so that every line fits `width` columns."""
    if not losses:
        return "no main runs"
    base = losses.get(baseline) if baseline else None
    cols = ["mixture", "average", "worst case"]
    if base is not None:
        cols += [f"avg - {baseline}", f"worst - {baseline}", "domains better"]
    rows = []
    for name, l in sorted(losses.items(), key=lambda kv: _mean([float(x) for x in kv[1]])):
        vals = [float(x) for x in l]
        row = [name, f"{_mean(vals):.4f}", f"{_worst(vals):.4f}"]
        if base is not None:
            b = [float(x) for x in base]
            row += [
                f"{_mean(vals) - _mean(b):+.4f}",
                f"{_worst(vals) - _worst(b):+.4f}",
                f"{domains_better(vals, b)}/{len(vals)}",
            ]
        rows.append(row)
    if sum(len(c) + 2 for c in cols) + 8 > width:  # a baseline's long name in the headers
        cols = [c[: width // len(cols) - 2] for c in cols]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    room = width - sum(widths[1:]) - 2 * (len(cols) - 1)
    widths[0] = max(8, min(widths[0], room))
    cut = [[r[0] if len(r[0]) <= widths[0] else r[0][: widths[0] - 1] + "~", *r[1:]] for r in rows]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [line(cols)] + [line(r) for r in cut]
    note = (
        f"validation loss in nats per token; negative differences: better than {baseline}" if base is not None else ""
    )
    return "\n".join(lines + ([note] if note else []))


def domains_better(losses: Vector, baseline: Vector) -> int:
    """The number of domains where `losses` is strictly below `baseline`."""
    _check_len("baseline", baseline, len(losses))
    return sum(float(a) < float(b) for a, b in zip(losses, baseline))


def steps_to_target(curve: Sequence[tuple[int, float]], target: float) -> int | None:
    """The first evaluation step whose mean validation loss is at or below `target` (None:
    never reached). `curve`: (step, mean validation loss) in step order."""
    return next((step for step, loss in curve if float(loss) <= target), None)


def speedup(baseline_steps: int, step: int | None) -> float | None:
    """How many times fewer steps a run needed to reach the baseline's final loss."""
    return None if step is None or step <= 0 else baseline_steps / step


def mean_curve(points: Sequence[tuple[int, Vector]]) -> list[tuple[int, float]]:
    """(step, per-domain losses) to (step, mean over domains)."""
    return [(step, sum(map(float, l)) / len(l)) for step, l in points]


def fmt_speedup(baseline_steps: int, step: int | None) -> str:
    s = speedup(baseline_steps, step)
    return "not reached" if s is None else f"{s:.2f}x (step {step})"


def format_vs_baselines(
    domains: Sequence[str],
    final_losses: Mapping[str, Vector],
    main_runs: Mapping[str, Sequence[tuple[int, Vector]]],
    baselines: Sequence[str],
) -> str:
    """Each run against each baseline: the domains where its final loss is lower (of k), the
    change of the mean loss, and steps-to-target: the first evaluation where its mean loss
    reaches the baseline's final mean, as a speed-up (baseline steps / that step)."""
    k = len(domains)
    header = ["run"]
    for b in baselines:
        header += [f"domains better than {b} (of {k})", f"mean loss - {b}", f"speed-up to {b}'s final loss"]
    rows = []
    for name, losses in final_losses.items():
        if name in baselines and len(baselines) == 1:
            continue
        row = [name]
        for b in baselines:
            if b == name or b not in final_losses:
                row += ["", "", ""]
                continue
            base = final_losses[b]
            row += [str(domains_better(losses, base)), fmt(sum(map(float, losses)) / k - sum(map(float, base)) / k)]
            base_curve, curve = mean_curve(main_runs.get(b, [])), mean_curve(main_runs.get(name, []))
            if base_curve and curve:
                row.append(fmt_speedup(base_curve[-1][0], steps_to_target(curve, base_curve[-1][1])))
            else:
                row.append("")
        rows.append(row)
    return markdown_table(header, rows)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table: the first column left-aligned, the others (numbers) right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _colors(k: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if k <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(k)]


def _save(fig, path: Path, metadata: dict[str, str] | None = None) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight", metadata=metadata)


def plot_weight_history(path: Path, domains: Sequence[str], weight_history: Sequence[Vector]) -> None:
    """alpha_t per domain over the proxy's steps, and its running mean from step 1 (the tuned
    weights if the run stopped at t and averaged from step 1, `mixing.doremi.average_from_step`)."""
    from matplotlib.figure import Figure

    k, steps = len(domains), list(range(1, len(weight_history) + 1))
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_w, ax_m = fig.subplots(1, 2, sharey=True)
    for i, (d, c) in enumerate(zip(domains, _colors(k))):
        series = [float(w[i]) for w in weight_history]
        running, total = [], 0.0
        for t, x in enumerate(series, start=1):
            total += x
            running.append(total / t)
        ax_w.plot(steps, series, color=c, label=d, lw=1.2)
        ax_m.plot(steps, running, color=c, label=d, lw=1.2)
    ax_w.set(title="domain weights $\\alpha_t$", xlabel="proxy step", ylabel="weight")
    ax_m.set(title="running mean of $\\alpha_t$ from step 1", xlabel="proxy step")
    ax_w.grid(alpha=0.3)
    ax_m.grid(alpha=0.3)
    ax_m.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    _save(fig, path)


def plot_weight_histories(path: Path, domains: Sequence[str], histories: Mapping[str, Sequence[Vector]]) -> None:
    """One row per method: its logged domain weights over its steps, and their running mean
    (the mixture it hands on if it stopped at t)."""
    from matplotlib.figure import Figure

    k = len(domains)
    fig = Figure(figsize=(11, 2.6 * len(histories) + 0.6), layout="constrained")
    axes = fig.subplots(len(histories), 2, sharey=True, squeeze=False)
    for (name, history), (ax_w, ax_m) in zip(histories.items(), axes):
        steps = list(range(1, len(history) + 1))
        for i, (d, c) in enumerate(zip(domains, _colors(k))):
            series = [float(w[i]) for w in history]
            running = list(itertools.accumulate(series))
            ax_w.plot(steps, series, color=c, label=d, lw=1.2)
            ax_m.plot(steps, [x / t for t, x in enumerate(running, start=1)], color=c, label=d, lw=1.2)
        ax_w.set(title=f"{name}: domain weights", ylabel="weight")
        ax_m.set(title=f"{name}: running mean")
        ax_w.grid(alpha=0.3)
        ax_m.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    axes[-1][1].set_xlabel("step")
    axes[0][1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    _save(fig, path)


def format_compute(ledger: Mapping[str, Mapping[str, float | None]]) -> str:
    """The compute each method spent to find its mixture (doremi/reports/ledger.py), a markdown table."""
    rows = []
    for name, c in ledger.items():
        secs, measured, val_secs = c.get("seconds"), c.get("trained_measured"), c.get("validation_seconds")
        rows.append(
            [name]
            + [f"{c.get(key) or 0.0:.3g}" for key in ("train", "reference", "target", "validation", "total", "tokens")]
            + ["" if measured is None else f"{measured:.3g}", "" if secs is None else f"{secs:.1f}"]
            + ["" if val_secs is None else f"{val_secs:.1f}"]
        )
    header = [
        "method",
        "training FLOPs",
        "reference FLOPs",
        "target FLOPs",
        "validation FLOPs",
        "total FLOPs",
        "tokens (nominal)",
        "trained tokens (measured)",
        "seconds",
        "of which validation seconds",
    ]
    from doremi.config import OFFLINE_METHODS

    table = markdown_table(header, rows)
    shared = [n for n in ledger if n in OFFLINE_METHODS]
    if shared:
        unmeasured = [n for n in shared if ledger[n].get("trained_measured") is None]
        table += (
            f"\n{' and '.join(shared)}: the fit of one shared sweep of small runs; "
            + ("each row shows the whole sweep (count it once)" if len(shared) > 1 else "the row shows the whole sweep")
            + ("; its stacked runs log no draws, so no tokens are measured." if unmeasured else ".")
            + "\n"
        )
    return table


def plot_val_loss(
    path: Path,
    domains: Sequence[str],
    main_runs: Mapping[str, Sequence[tuple[int, Vector]]],
    entropy: Sequence[float | None],
) -> None:
    """Validation loss per domain (one panel each) over the main runs' steps (integer ticks:
    steps are counts); known entropy dashed."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    k = len(domains)
    ncols = min(4, k)
    nrows = math.ceil(k / ncols)
    fig = Figure(figsize=(3.2 * ncols, 2.6 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    colors = _colors(len(main_runs))
    for i, (ax, d) in enumerate(zip(axes, domains)):
        for (name, points), c in zip(main_runs.items(), colors):
            ax.plot(
                [s for s, _ in points],
                [float(l[i]) for _, l in points],
                color=c,
                label=name,
                lw=1.2,
                marker="o" if len(points) < 20 else None,
                ms=3,
            )
        if entropy[i] is not None:
            ax.axhline(entropy[i], color="k", ls="--", lw=0.8, label="entropy")
        ax.set_title(d, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes[:k]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[k:]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncols=len(labels), fontsize=8)
    fig.supxlabel("training step", fontsize=9)
    fig.supylabel("validation loss", fontsize=9)
    _save(fig, path)


def plot_final_loss(
    path: Path,
    domains: Sequence[str],
    final_losses: Mapping[str, Vector],
    entropy: Sequence[float | None],
    ylabel: str = "final validation loss",
    title: str = "final validation loss per domain",
    log: bool = False,
) -> None:
    """Final validation loss per domain, one bar per run (grouped), values written, known entropy
    as a mark; the y-axis starts near the smallest value, not at 0, so that differences show.

    `log`: a log y-axis, for values spanning decades (loss above entropy next to raw loss);
    it needs every value > 0."""
    from matplotlib.figure import Figure

    k, n = len(domains), len(final_losses)
    fig = Figure(figsize=(max(6.0, 0.9 * k * max(n, 1) * 0.5 + 2), 4), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(n, 1)
    for j, ((name, l), c) in enumerate(zip(final_losses.items(), _colors(n))):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(k)]
        bars = ax.bar(xs, [float(x) for x in l], width=width, color=c, label=name)
        ax.bar_label(bars, labels=[f"{float(x):.3f}" for x in l], fontsize=6, padding=1, rotation=90)
    known = [i for i in range(k) if entropy[i] is not None]
    if known:
        ax.hlines(
            [entropy[i] for i in known],
            [i - 0.45 for i in known],
            [i + 0.45 for i in known],
            colors="k",
            linestyles="--",
            lw=1,
            label="entropy",
            zorder=3,
        )
    ax.set_xticks(range(k), domains, rotation=30 if k > 6 else 0, ha="right" if k > 6 else "center")
    if log:
        bad = [f"{name}: {x}" for name, l in final_losses.items() for x in l if not float(x) > 0]
        if bad:
            raise ValueError(f"plot_final_loss: a log axis needs values > 0, got {bad[0]}")
        ax.set_yscale("log")
    else:
        values = [float(x) for l in final_losses.values() for x in l]
        lo, hi = min(values), max(values)
        ax.set_ylim(bottom=max(0.0, lo - 0.15 * (hi - lo) - 1e-3), top=hi + 0.25 * (hi - lo) + 1e-3)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def summary_groups(losses: Vector) -> list[float]:
    """Per-domain values followed by the two summaries over domains: average and worst case."""
    values = [float(x) for x in losses]
    return values + [sum(values) / len(values), max(values)]


def plot_differences(path: Path, domains: Sequence[str], final_losses: Mapping[str, Vector], baseline: str) -> None:
    """Each run's final validation loss minus the baseline's, as small multiples: one panel per
    domain and for the average and the worst case over domains, the runs as horizontal bars with
    their values written on them (the differences that decide a comparison are a few hundredths
    of a nat, invisible on bars of the losses themselves). Below zero: the run is better. At most
    four panels a row, so that the figure reads at 100% zoom whatever the number of runs."""
    import math

    from matplotlib.figure import Figure

    others = [name for name in final_losses if name != baseline]
    labels = [*domains, "average", "worst case"]
    base = summary_groups(final_losses[baseline])
    diffs = {name: [x - b for x, b in zip(summary_groups(final_losses[name]), base)] for name in others}
    n, m = max(len(others), 1), len(labels)
    cols = min(4, m)
    rows = math.ceil(m / cols)
    fig = Figure(figsize=(3.3 * cols, rows * (0.22 * n + 1.1)), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    colors = list(_colors(n))
    for i, label in enumerate(labels):
        ax = axes[i // cols][i % cols]
        values = [diffs[name][i] for name in others]
        bars = ax.barh(range(len(others)), values, color=colors[: len(others)])
        ax.bar_label(bars, labels=[f"{v:+.3f}" for v in values], fontsize=7, padding=2)
        ax.axvline(0.0, color="k", lw=0.8)
        ax.set_title(label, fontsize=9, fontweight="bold" if i >= len(domains) else "normal")
        ax.set_yticks(range(len(others)), others, fontsize=8)
        if i == 0:
            ax.invert_yaxis()  # the axes share y: once puts the first run on top in every panel
        ax.margins(x=0.35)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    for k in range(m, rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    fig.suptitle(f"final validation loss minus {baseline}, nats (below 0: better)", fontsize=10)
    _save(fig, path)


def format_fit_quality(fits: Mapping[str, Mapping[str, Any]], threshold: float, default: float = 0.3) -> str:
    """One row per offline fit: runs, folds, held-out Spearman and mean absolute error, and its
    verdict against `pipeline.guardrails.min_fit_spearman` (`threshold`; a fit below `default`,
    the key's default, was trained on only because the key was lowered, and says so). `fits`:
    `doremi.offline.propose.fit_quality` per method."""
    rows = []
    lowered = f"trained on as pipeline.guardrails.min_fit_spearman is {threshold:g}"
    for name, q in fits.items():
        if "skipped" in q:
            rows.append([name, str(q.get("n") or ""), "", "not checked", "", f"unchecked ({q['skipped']}); {lowered}"])
            continue
        rho = q["spearman"]
        ok = rho is not None and rho >= max(threshold, default)
        verdict = "passed" if ok else f"below {default:g}: {lowered}"
        rows.append(
            [
                name,
                str(q["n"]),
                str(q["folds"]),
                "undefined" if rho is None else f"{rho:.3f}",
                f"{q['mae']:.4g}",
                verdict,
            ]
        )
    table = markdown_table(["fit", "runs", "folds", "held-out Spearman", "held-out MAE", "verdict"], rows)
    laws = [f"- {name}: {q['laws']}" for name, q in fits.items() if q.get("laws")]
    return table + (
        "\nWhat each fit extrapolated, each law checked on points it did not see:\n\n" + "\n".join(laws) + "\n"
        if laws
        else ""
    )


def format_reads(reads: Mapping[str, str]) -> str:
    """One row per method of the report: the data it read to choose its mixture
    (`doremi.methods.registry.READS`, described), so that a reader sees which methods saw
    validation losses (the dev half only) and which saw gradients or a sweep."""
    return markdown_table(["method", "reads"], [[name, what] for name, what in reads.items()])


def write_report(
    out_dir: str | os.PathLike,
    domains: Sequence[str],
    weight_history: Sequence[Vector] | Mapping[str, Sequence[Vector]],
    main_runs: Mapping[str, Sequence[tuple[int, Vector]]],
    final_losses: Mapping[str, Vector],
    mixtures: Mapping[str, Vector],
    entropy: Sequence[float | None] | None = None,
    title: str = "DoReMi report",
    tokens_per_byte: Sequence[float | None] | None = None,
    baselines: Sequence[str] = (),
    warnings: Sequence[str] | None = None,
    guardrail_table: str | None = None,
    setup_table: str | None = None,
    compute_table: str | None = None,
    fit_table: str | None = None,
    reads_table: str | None = None,
) -> Path:
    """Write `out_dir/report.md` and its PNGs; return the report's path.

    Args:
        weight_history: alpha_t per proxy step t = 1..T (empty: no weights plot), or method
            name -> its logged weights per step (one row of plots each).
        main_runs: run name -> [(step, per-domain validation loss)] (runs without points are
            left out; none: no curves plot).
        final_losses: run name -> final per-domain validation loss (the table's loss columns).
        mixtures: mixture name -> domain weights (e.g. reference, doremi).
        entropy: per-domain known entropy in nats, None where unknown (real domains).
        tokens_per_byte: per-domain validation tokens / UTF-8 bytes, None where unknown (adds
            bits-per-byte columns).
        baselines: run names the others are compared with (domains better, speed-up).
        warnings: guardrail warnings, one line each (None: no guardrails were run).
        guardrail_table: the per-domain guardrail measures, a markdown table.
        setup_table: what was run (sizes, steps, tokens, the method's keys), a markdown table.
        compute_table: the compute each method spent to find its mixture, a markdown table.
        fit_table: the offline fits' held-out quality (`format_fit_quality`).
        reads_table: the data each method read (`format_reads`).
    """
    out = Path(out_dir)
    ent, histories, main_runs = _checked_inputs(domains, weight_history, main_runs, entropy)
    table = format_table(domains, mixtures, final_losses, ent, tokens_per_byte)
    baselines = [b for b in baselines if b in final_losses]
    vs = format_vs_baselines(domains, final_losses, main_runs, baselines) if baselines else None

    out.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title}", ""]
    parts += _warnings_section(warnings)
    parts += _inputs_sections(setup_table, compute_table, reads_table, fit_table)
    parts += _table_section(table, tokens_per_byte, ent, len(final_losses))
    parts += _comparison_sections(vs, guardrail_table)
    parts += _plot_sections(out, domains, histories, main_runs, final_losses, baselines, ent)
    report = out / "report.md"
    atomic_write_text(report, "\n".join(parts) + "\n")
    return report


def _checked_inputs(
    domains: Sequence[str],
    weight_history: Sequence[Vector] | Mapping[str, Sequence[Vector]],
    main_runs: Mapping[str, Sequence[tuple[int, Vector]]],
    entropy: Sequence[float | None] | None,
) -> tuple[list[float | None], dict[str, Sequence[Vector]], dict[str, Sequence[tuple[int, Vector]]]]:
    """(entropy per domain, the non-empty weight histories, the main runs with points), each
    vector checked to have one value per domain before anything is written."""
    k = len(domains)
    ent = list(entropy) if entropy is not None else [None] * k
    _check_len("entropy", ent, k)
    histories = dict(weight_history) if isinstance(weight_history, Mapping) else {REFERENCE_RUN: weight_history}
    histories = {name: h for name, h in histories.items() if len(h)}
    for name, history in histories.items():
        for t, w in enumerate(history, start=1):
            _check_len(f"weight_history[{name}, step {t}]" if len(histories) > 1 else f"weight_history[step {t}]", w, k)
    for name, points in main_runs.items():
        for step, l in points:
            _check_len(f"main_runs[{name!r}] at step {step}", l, k)
    return ent, histories, {name: points for name, points in main_runs.items() if points}


def _warnings_section(warnings: Sequence[str] | None) -> list[str]:
    """The guardrail warnings, or that every guardrail passed (nothing when none were run)."""
    if warnings is None:
        return []
    parts = ["## Warnings", ""]
    parts += [f"- {w}" for w in warnings] if warnings else ["None: every guardrail passed."]
    return parts + [""]


def _inputs_sections(
    setup_table: str | None, compute_table: str | None, reads_table: str | None, fit_table: str | None
) -> list[str]:
    """What was run, the compute and data each method spent, and the offline fits' quality."""
    parts: list[str] = []
    if setup_table:
        parts += ["## What was run", "", setup_table]
    if compute_table:
        parts += [
            "## Compute spent to find each mixture",
            "",
            compute_table,
            "Model FLOPs (6N + attention per trained token; a forward is a third): training steps, "
            "the reference's forwards, DoGE's target gradients and the validation passes a method "
            "asked for (doremi/reports/ledger.py); the tokens those passes processed (nominal), beside the "
            "non-masked tokens the training steps drew (measured); seconds as measured by the pipeline, and "
            "of those the seconds of the method's validation passes as the trainer timed them (none for a "
            "sweep, whose evaluations are not timed apart).",
            "",
        ]
    if reads_table:
        parts += [
            "## What each method read",
            "",
            reads_table,
            "Validation reads are of the dev half under data.validation_split: dev_test (the verdict's "
            "losses are the test half's); a method declaring another is refused (docs/design.md 3b).",
            "",
        ]
    if fit_table:
        parts += [
            "## Offline fits: held-out quality",
            "",
            fit_table,
            "K-fold cross-validation over the sweep's runs: each run's target loss predicted by a fit "
            "that did not see it. Spearman: rank correlation of those predictions with the observed "
            "losses (what choosing a mixture needs); a fit below pipeline.guardrails.min_fit_spearman "
            "is not trained on unless the threshold is lowered.",
            "",
        ]
    return parts


def _table_section(
    table: str, tokens_per_byte: Sequence[float | None] | None, ent: Sequence[float | None], n_runs: int
) -> list[str]:
    """The mixtures and final losses, with what its optional columns mean and why one seed
    names no best mixture."""
    parts = [
        "## Mixtures and final validation loss",
        "",
        table,
        "Average and worst case are over domains (validation loss, nats per token).",
    ]
    if tokens_per_byte is not None and any(t is not None for t in tokens_per_byte):
        parts.append(
            "Bits per byte = loss x validation tokens / validation UTF-8 bytes / ln 2 (comparable across tokenizers)."
        )
    if any(e is not None for e in ent):
        parts.append(
            "H is the domain's known entropy (synthetic domains): loss - H is the part a model could still learn."
        )
    if n_runs > 1:
        parts += [
            "",
            "One seed: no mixture is named best here. A difference between mixtures means "
            "something only against the seed-to-seed noise; run the pipeline with several seeds "
            "and compare them with `doremi compare` (paired differences with their standard error).",
        ]
    return parts


def _comparison_sections(vs: str | None, guardrail_table: str | None) -> list[str]:
    """The runs against the baselines, and the per-domain guardrail measures."""
    parts: list[str] = []
    if vs:
        parts += [
            "",
            "## Against the baselines",
            "",
            vs,
            "Domains better: final validation loss strictly lower. Speed-up: the baseline's "
            "steps over the first evaluation step where the run's mean validation loss reaches "
            "the baseline's final mean.",
        ]
    if guardrail_table:
        parts += [
            "",
            "## Guardrails",
            "",
            guardrail_table,
            "epochs: epochs of the domain's train split read; realised - nominal: share of "
            "sequences drawn minus the weights' share; memorisation gap: held-out minus seen "
            "training loss of the reference; shift: validation minus held-out loss; proxy lag: "
            "proxy minus reference final validation loss; final - best: main run's final minus "
            "lowest validation loss (nats per token).",
        ]
    return parts


def _plot_sections(
    out: Path,
    domains: Sequence[str],
    histories: Mapping[str, Sequence[Vector]],
    main_runs: Mapping[str, Sequence[tuple[int, Vector]]],
    final_losses: Mapping[str, Vector],
    baselines: Sequence[str],
    ent: Sequence[float | None],
) -> list[str]:
    """Draw the report's PNGs into `out` and return the sections that show them."""
    parts: list[str] = []
    if list(histories) == [REFERENCE_RUN]:
        plot_weight_history(out / WEIGHTS_PNG, domains, histories[REFERENCE_RUN])
        parts += ["", "## Domain weights during the proxy run", "", f"![domain weights]({WEIGHTS_PNG})"]
    elif histories:
        plot_weight_histories(out / WEIGHTS_PNG, domains, histories)
        parts += ["", "## Each method's domain weights over its steps", "", f"![domain weights]({WEIGHTS_PNG})"]
    if main_runs:
        plot_val_loss(out / VAL_LOSS_PNG, domains, main_runs, ent)
        parts += ["", "## Validation loss during the main runs", "", f"![validation loss]({VAL_LOSS_PNG})"]
    if baselines and len(final_losses) > 1:
        plot_differences(out / DIFF_PNG, domains, final_losses, baselines[0])
        parts += ["", f"## Final validation loss against {baselines[0]}", "", f"![against {baselines[0]}]({DIFF_PNG})"]
    elif final_losses:
        plot_final_loss(out / FINAL_LOSS_PNG, domains, final_losses, ent)
        parts += ["", "## Final validation loss per domain", "", f"![final validation loss]({FINAL_LOSS_PNG})"]
    return parts
