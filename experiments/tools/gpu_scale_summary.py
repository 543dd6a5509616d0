"""The GPU-scale experiment's write-up (issue 7): DoReMi against uniform and token-proportional
weights over several seeds, from the seed directories that `experiments/launch/gpu_scale.sh` packs.

    python experiments/tools/gpu_scale_summary.py SEED_DIR [SEED_DIR ...]
        [--out experiments/results/gpu_scale.md] [--plots experiments/results/gpu_scale]
        [--notes experiments/results/gpu_scale_notes.md] [--title TITLE]

A seed directory is one unpacked `gpu_scale_seed{N}.tar.gz`: the pipeline's run directory
without checkpoints, plus `stores/manifest.json`, `pipeline.log` and `run_info.json`. Every
number in the write-up is read from those files; the hand-written reading of the results lives
in the notes file, which is copied in at the end so that rerunning the summary keeps it.

The comparison metric ("synthetic domains measured above their entropy"): per domain the
*adjusted loss* is the validation loss minus the known entropy H for the synthetic domains and
the validation loss itself for the real ones; the average and the worst case (max) are taken
over all domains of the adjusted loss. DoReMi wins a seed when both its adjusted average and
its adjusted worst case are below those of every baseline.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from data.errors import DataError  # noqa: E402
from data.store.store import Manifest, read_manifest  # noqa: E402
from doremi.config import ExperimentConfig, load_saved_config  # noqa: E402
from doremi.reports.report import fmt, format_table, markdown_table, plot_final_loss, plot_val_loss, plot_weight_history  # noqa: E402
from doremi.reports.summary import collect_run  # noqa: E402
from trainer.config.tools import ConfigError, read_yaml  # noqa: E402
from trainer.model.flops import param_count  # noqa: E402
from trainer.records.metrics import read_jsonl  # noqa: E402

MIXTURE_ORDER = ("doremi", "uniform", "tokens")
STAGE_LINE = re.compile(r"^\[(\d+):(\d\d)\] (.+?)(?: \.\.\.|: done already .*)$")


class SummaryError(ValueError):
    """Bad input (a missing or unfinished seed directory): one line."""


@dataclass
class Seed:
    """One seed's pipeline, read back: `c` is doremi.reports.summary.collect_run's dictionary."""

    name: str
    root: Path
    manifest: Manifest
    c: dict[str, Any]
    info: dict[str, Any]


# -- reading -------------------------------------------------------------------------------------
def load_seed(root: Path) -> Seed:
    root = Path(root)
    if not root.is_dir():
        raise SummaryError(f"{root}: not a directory (expected an unpacked gpu_scale_seed*.tar.gz)")
    try:
        manifest = read_manifest(root / "stores")
    except DataError as e:
        raise SummaryError(str(e)) from None
    ref_config = root / "round1" / "reference" / "config.yaml"
    if not ref_config.is_file():
        raise SummaryError(f"{ref_config}: missing (did the seed's reference run start?)")
    baselines = read_yaml(ref_config).get("pipeline", {}).get("baselines", ["uniform", "tokens"])
    c = collect_run(root, manifest, baselines)
    missing = [m for m in c["mixtures"] if m not in c["final"]]
    if missing:
        raise SummaryError(f"{root}: main run(s) {', '.join(missing)} have no eval result (did the pipeline finish?)")
    info_path = root / "run_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    return Seed(root.name, root, manifest, c, info)


def check_seeds(seeds: Sequence[Seed]) -> None:
    first = seeds[0]
    for s in seeds[1:]:
        if s.c["domains"] != first.c["domains"] or list(s.c["mixtures"]) != list(first.c["mixtures"]):
            raise SummaryError(f"{s.root}: domains or mixtures differ from {first.root}'s")
    names = [s.name for s in seeds]
    if len(set(names)) != len(names):
        raise SummaryError(f"seed directories must have distinct names, got {', '.join(names)}")


def adjusted(losses: Sequence[float], entropy: Sequence[float | None]) -> list[float]:
    """Loss minus the known entropy where there is one, the loss itself elsewhere."""
    return [float(l) - h if h is not None else float(l) for l, h in zip(losses, entropy)]


def scores(seed: Seed) -> dict[str, dict[str, Any]]:
    """Per mixture: raw average, adjusted average, adjusted worst case and its domain."""
    out = {}
    for name, losses in seed.c["final"].items():
        adj = adjusted(losses, seed.c["entropy"])
        worst = int(np.argmax(adj))
        out[name] = {
            "average": float(np.mean(losses)),
            "adj_average": float(np.mean(adj)),
            "adj_worst": adj[worst],
            "worst_domain": seed.c["domains"][worst],
        }
    return out


def verdict(s: dict[str, dict[str, Any]]) -> str:
    """`win` (adjusted average and worst case both below every baseline's), `mixed`, `lose`."""
    base = [m for m in s if m != "doremi"]
    wins = [all(s["doremi"][key] < s[b][key] for b in base) for key in ("adj_average", "adj_worst")]
    return {2: "win", 1: "mixed", 0: "lose"}[sum(wins)] + (
        f" (average: {'better' if wins[0] else 'not better'}, worst case: "
        f"{'better' if wins[1] else 'not better'} than every baseline)"
    )


def run_config(path: Path) -> ExperimentConfig:
    try:
        return load_saved_config(path)
    except (ConfigError, DataError) as e:
        raise SummaryError(f"{path}: {e}") from None


def last_row(run: Path, key: str) -> dict[str, Any]:
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if key in r]
    if not rows:
        raise SummaryError(f"{run}/metrics.jsonl: no row with {key!r}")
    return rows[-1]


def stage_times(log: Path) -> list[tuple[str, int]]:
    """(stage, start second) of each stage the pipeline started or skipped, from its log."""
    if not log.is_file():
        return []
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = STAGE_LINE.match(line.strip())
        if m:
            out.append((m.group(3), int(m.group(1)) * 60 + int(m.group(2))))
    return out


# -- tables ---------------------------------------------------------------------------------------
def mean_weights(seeds: Sequence[Seed]) -> np.ndarray:
    return np.mean([s.c["mixtures"]["doremi"] for s in seeds], axis=0)


def mean_final(seeds: Sequence[Seed]) -> dict[str, list[float]]:
    return {m: np.mean([s.c["final"][m] for s in seeds], axis=0).tolist() for m in seeds[0].c["final"]}


def setup_section(seeds: Sequence[Seed]) -> str:
    s = seeds[0]
    ref = run_config(s.root / "round1" / "reference" / "config.yaml")
    main = run_config(s.root / "main" / "doremi" / "config.yaml")
    rows = []
    for label, cfg in (("reference / proxy", ref), ("main runs", main)):
        m, t = cfg.model, cfg.train
        rows.append(
            [
                label,
                f"{param_count(m) / 1e6:.1f}M",
                f"d {m.d_model}, {m.n_layers} layers, {m.n_heads} heads ({m.n_kv_heads} kv), ffn {m.ffn_dim}",
                str(t.steps),
                f"{t.global_batch_size} x {cfg.data.seq_len}",
                f"{t.steps * t.global_batch_size * cfg.data.seq_len / 1e6:.1f}M",
                f"{t.lr:g} -> {t.min_lr:g} ({t.decay})",
                str(t.eval_sequences),
            ]
        )
    table = markdown_table(
        ["stage", "parameters", "shape", "steps", "batch (seq x len)", "tokens", "lr", "eval sequences / domain"], rows
    )
    info = s.info
    lines = [
        "## Setup",
        "",
        table,
        f"Parameters: trainer/model/flops.py `param_count` (untied embeddings counted). "
        f"DoReMi: eta {ref.mixing.doremi.eta:g}, smoothing {ref.mixing.doremi.smoothing:g}, reference on "
        f"`{ref.mixing.doremi.reference_weights}` weights, proxy sampling `{ref.mixing.doremi.proxy_sampling}`, "
        f"update `{ref.mixing.doremi.update}`; seeds {', '.join(str(x.info.get('seed', x.name)) for x in seeds)} "
        f"(train.seed and data.seed of every stage).",
    ]
    if info:
        lines += [
            "",
            f"Device: {info.get('device')}, torch {info.get('torch')}, commit {info.get('commit')}.",
            "",
            "Command (from the repository root of the GPU machine, as `run_info.json` recorded it):",
            "",
            f"    {info.get('command')}",
        ]
    return "\n".join(lines) + "\n"


def data_section(seeds: Sequence[Seed]) -> str:
    s = seeds[0]
    epochs = {
        m: [[last_row(x.root / "main" / m, "epochs")["epochs"][d] for d in s.c["domains"]] for x in seeds]
        for m in s.c["final"]
    }
    rows = []
    for i, d in enumerate(s.manifest.domains):
        rows.append(
            [d.name, fmt(d.entropy), f"{d.train.tokens:,}", f"{d.validation.tokens:,}"]
            + [f"{np.mean([e[i] for e in epochs[m]]):.2f}" for m in epochs]
        )
    header = ["domain", "H", "train tokens", "validation tokens"] + [f"epochs: {m}" for m in epochs]
    return (
        "## Data\n\n"
        + markdown_table(header, rows)
        + "\nEpochs: passes over the domain's train tokens by the end of each main run (mean over "
        "seeds). The real domains are the whole embedded corpus, so their validation sets are small "
        "(a few thousand tokens for `notes`): their per-domain numbers are the noisiest.\n"
    )


def weights_section(seeds: Sequence[Seed]) -> str:
    s = seeds[0]
    mix = s.c["mixtures"]
    baselines = [m for m in mix if m != "doremi"]
    mean = mean_weights(seeds)
    rows = [
        [d, fmt(s.c["entropy"][i])]
        + [fmt(float(mix[b][i])) for b in baselines]
        + [fmt(float(x.c["mixtures"]["doremi"][i])) for x in seeds]
        + [fmt(float(mean[i]))]
        for i, d in enumerate(s.c["domains"])
    ]
    header = ["domain", "H"] + baselines + [f"doremi {x.name}" for x in seeds] + ["doremi mean"]
    return "## Domain weights\n\n" + markdown_table(header, rows)


def seed_tables(seeds: Sequence[Seed]) -> str:
    parts = [
        "## Final validation loss per seed",
        "",
        "doremi.reports.report.format_table: average and worst case over all domains of the raw loss; "
        "the `loss - H` columns' average and worst case are over the synthetic domains only.",
        "",
    ]
    for x in seeds:
        parts += [f"### {x.name}", "", format_table(x.c["domains"], x.c["mixtures"], x.c["final"], x.c["entropy"])]
    s = seeds[0]
    mixtures = {m: mean_weights(seeds) if m == "doremi" else w for m, w in s.c["mixtures"].items()}
    parts += [
        "### mean over seeds",
        "",
        "Losses are the mean of the seeds' losses; `weight: doremi` is the mean of the seeds' DoReMi "
        "weights (each seed's main run trained on its own).",
        "",
        format_table(s.c["domains"], mixtures, mean_final(seeds), s.c["entropy"]),
    ]
    return "\n".join(parts)


def comparison_section(seeds: Sequence[Seed]) -> str:
    per_seed = {x.name: scores(x) for x in seeds}
    mixtures = list(seeds[0].c["final"])
    rows = []
    for m in mixtures:
        for x in seeds:
            sc = per_seed[x.name][m]
            rows.append(
                [
                    m,
                    x.name,
                    fmt(sc["average"]),
                    fmt(sc["adj_average"]),
                    f"{fmt(sc['adj_worst'])} ({sc['worst_domain']})",
                ]
            )
        rows.append(
            [
                f"**{m}**",
                "mean",
                *(
                    fmt(statistics.mean(per_seed[x.name][m][k] for x in seeds))
                    for k in ("average", "adj_average", "adj_worst")
                ),
            ]
        )
    header = ["mixture", "seed", "average loss", "average adjusted loss", "worst-case adjusted loss (domain)"]
    verdicts = [f"- {x.name}: DoReMi **{verdict(per_seed[x.name])}**." for x in seeds]
    mean_scores = {
        m: {k: statistics.mean(per_seed[x.name][m][k] for x in seeds) for k in ("adj_average", "adj_worst")}
        for m in mixtures
    }
    verdicts.append(f"- mean over seeds: DoReMi **{verdict(mean_scores)}**.")
    return (
        "## DoReMi against the baselines\n\n"
        "Adjusted loss: validation loss minus the known entropy H on the synthetic domains (what a "
        "model could still learn there), the validation loss itself on the real domains. Average "
        "and worst case (max) are over all domains of the adjusted loss; the average adjusted loss "
        "is the raw average minus the mean entropy, so both rank the mixtures alike. `mean`: mean "
        "over seeds of each seed's number.\n\n" + markdown_table(header, rows) + "\n" + "\n".join(verdicts) + "\n"
    )


def diagnostics_section(seeds: Sequence[Seed]) -> str:
    s = seeds[0]
    domains = s.c["domains"]
    k = len(domains)

    def final_val(run: Path) -> list[float]:
        return [last_row(run, "val_loss")["val_loss"][d] for d in domains]

    def proxy_history(x: Seed) -> list[dict[str, Any]]:
        return read_jsonl(x.root / "round1" / "proxy" / "domain_weights.jsonl")

    def late_excess(x: Seed) -> list[float]:
        hist = proxy_history(x)
        tail = hist[-max(1, len(hist) // 10) :]
        return np.mean([h["excess"] for h in tail], axis=0).tolist()

    def ref_on_train(x: Seed) -> list[float]:
        return np.mean([h["ref_loss"] for h in proxy_history(x)], axis=0).tolist()

    def overfit(run: Path) -> list[float]:
        curve = [[r["val_loss"][d] for d in domains] for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
        return (np.array(curve[-1]) - np.min(curve, axis=0)).tolist()

    ref = np.mean([final_val(x.root / "round1" / "reference") for x in seeds], axis=0)
    proxy = np.mean([final_val(x.root / "round1" / "proxy") for x in seeds], axis=0)
    ref_train = np.mean([ref_on_train(x) for x in seeds], axis=0)
    excess = np.mean([late_excess(x) for x in seeds], axis=0)
    over = {m: np.mean([overfit(x.root / "main" / m) for x in seeds], axis=0) for m in s.c["final"]}
    rows = [
        [domains[i], fmt(float(ref[i])), fmt(float(ref_train[i])), fmt(float(proxy[i])), fmt(float(excess[i]))]
        + [fmt(float(over[m][i])) for m in over]
        for i in range(k)
    ]
    header = [
        "domain",
        "reference val loss",
        "reference loss on proxy batches",
        "proxy val loss",
        "proxy excess (last 10%)",
    ] + [f"final - best: {m}" for m in over]
    return (
        "## Diagnostics\n\n"
        + markdown_table(header, rows)
        + "\nMeans over seeds. Reference and proxy: final validation loss of round 1. Reference loss "
        "on proxy batches: the frozen reference's per-token loss on the training batches the proxy "
        "saw, averaged over the proxy's steps (far below its validation loss: the reference "
        "memorised that domain, so its loss is no estimate of the loss a model can reach there). Proxy excess: "
        "lambda_t (mean per-token max(proxy - reference, 0)) averaged over the proxy's last 10% of "
        "steps, what drives the weights at the end. final - best: the main run's final validation "
        "loss minus its lowest over the evaluations (> 0: it got worse, e.g. by overfitting a "
        "domain it saw many epochs of).\n"
    )


def timing_section(seeds: Sequence[Seed]) -> str:
    rows = []
    for x in seeds:
        times = stage_times(x.root / "pipeline.log")
        for j, (stage, start) in enumerate(times):
            dur = times[j + 1][1] - start if j + 1 < len(times) else None
            run = stage_run_dir(x.root, stage)
            rate, mem = throughput(run) if run is not None else (None, None)
            rows.append(
                [
                    x.name,
                    stage,
                    f"{start}",
                    "" if dur is None else f"{dur}",
                    "" if rate is None else f"{rate:,.0f}",
                    "" if mem is None else f"{mem:.1f}",
                ]
            )
    if not rows:
        return ""
    return (
        "## Timing\n\n"
        + markdown_table(["seed", "stage", "start (s)", "duration (s)", "median tokens/s", "peak GiB"], rows)
        + "\nFrom each pipeline's log (1 s resolution; the last stage's end is not logged); the seeds ran at "
        "the same time on one device. Tokens/s: median over the logged steps of the stage's run.\n"
    )


def stage_run_dir(root: Path, stage: str) -> Path | None:
    m = re.match(r"round (\d+): (reference|proxy)$", stage)
    if m:
        return root / f"round{m.group(1)}" / m.group(2)
    m = re.match(r"main run: (\S+)$", stage)
    return root / "main" / m.group(1) if m else None


def throughput(run: Path) -> tuple[float | None, float | None]:
    if not (run / "metrics.jsonl").is_file():
        return None, None
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "tokens_per_s" in r]
    if not rows:
        return None, None
    mem = [r["peak_memory_gb"] for r in rows if "peak_memory_gb" in r]
    return statistics.median(r["tokens_per_s"] for r in rows), (max(mem) if mem else None)


# -- plots ------------------------------------------------------------------------------------------
def write_plots(seeds: Sequence[Seed], plots: Path, rel: str) -> str:
    """PNGs into `plots`; returns their markdown (paths relative to the write-up: `rel`)."""
    plots.mkdir(parents=True, exist_ok=True)
    s = seeds[0]
    domains, entropy = s.c["domains"], s.c["entropy"]
    parts = ["## Plots", ""]
    for x in seeds:
        name = f"domain_weights_{x.name}.png"
        plot_weight_history(plots / name, domains, x.c["history"])
        parts += [f"DoReMi weights over the proxy's steps, {x.name}:", "", f"![weights {x.name}]({rel}/{name})", ""]
    for x in seeds:
        name = f"val_loss_{x.name}.png"
        plot_val_loss(plots / name, domains, {m: x.c["curves"][m] for m in x.c["final"]}, entropy)
        parts += [
            f"Validation loss per domain over the main runs' steps, {x.name}:",
            "",
            f"![val loss {x.name}]({rel}/{name})",
            "",
        ]
    bars = {f"{m} {x.name}": adjusted(x.c["final"][m], entropy) for m in s.c["final"] for x in seeds}
    log = all(v > 0 for vals in bars.values() for v in vals)
    plot_final_loss(
        plots / "final_adjusted_loss.png",
        domains,
        bars,
        [None] * len(domains),
        ylabel="final loss - H (synthetic), loss (real), nats",
        log=log,
        title="final adjusted validation loss per domain" + (" (log scale)" if log else ""),
    )
    parts += [
        "Final adjusted loss per domain (loss - H on the synthetic domains), every mixture and seed:",
        "",
        f"![final adjusted loss]({rel}/final_adjusted_loss.png)",
        "",
    ]
    return "\n".join(parts)


# -- the write-up -------------------------------------------------------------------------------------
def summarize(
    seed_dirs: Sequence[Path], out: Path, plots: Path, notes: Path | None, title: str = "GPU-scale DoReMi (issue 7)"
) -> Path:
    seeds = [load_seed(Path(d)) for d in seed_dirs]
    check_seeds(seeds)
    try:
        rel = str(plots.resolve().relative_to(out.resolve().parent))
    except ValueError:
        rel = str(plots.resolve())
    parts = [
        f"# {title}",
        "",
        "Written by `experiments/tools/gpu_scale_summary.py` from the runs' files (metrics.jsonl, "
        "weights.json, domain_weights.jsonl, the eval results and the stores' manifest); "
        "validation loss in nats per token.",
        "",
        setup_section(seeds),
        data_section(seeds),
        weights_section(seeds),
        comparison_section(seeds),
        seed_tables(seeds),
        diagnostics_section(seeds),
        timing_section(seeds),
        write_plots(seeds, plots, rel),
    ]
    if notes is not None and notes.is_file():
        parts += [notes.read_text()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(p.strip("\n") for p in parts if p.strip()) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("seed_dirs", nargs="+", type=Path, help="unpacked seed directories (seed1 seed2 ...)")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "gpu_scale.md")
    p.add_argument("--plots", type=Path, default=ROOT / "experiments" / "results" / "gpu_scale")
    p.add_argument(
        "--notes",
        type=Path,
        default=ROOT / "experiments" / "results" / "gpu_scale_notes.md",
        help="hand-written reading appended at the end (if the file exists)",
    )
    p.add_argument("--title", default="GPU-scale DoReMi (issue 7)")
    args = p.parse_args(argv)
    try:
        path = summarize(args.seed_dirs, args.out, args.plots, args.notes, args.title)
    except (SummaryError, DataError, ConfigError) as e:
        print(f"gpu_scale_summary: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
