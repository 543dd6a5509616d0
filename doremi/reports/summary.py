"""The pipeline's closing table and `report.md`, built from the runs' own files
(weights JSON, domain_weights.jsonl, metrics.jsonl, eval results, the stores' manifest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from data.sampling.weights import resolve_weights
from data.sampling.weights_file import WEIGHTS_FILE
from data.store.store import Manifest, open_stores
from doremi.config import GuardrailConfig
from doremi.methods import registry
from doremi.methods.history import HistoryError, read_history
from doremi.outputs.main_runs import REFERENCE_RUN, method_dir, online_run_name, search_dirs
from doremi.outputs.main_runs import mixtures as mixture_specs
from doremi.outputs.stage_markers import eval_result
from doremi.reports.guardrails import findings, format_guardrail_table, measure_pipeline, warnings, with_advice
from doremi.reports.ledger import compute_ledger
from doremi.reports.report import (
    format_compute,
    format_fit_quality,
    format_reads,
    format_summary,
    markdown_table,
    write_report,
)
from trainer.records.metrics import read_jsonl


def tokens_per_byte(manifest: Manifest) -> list[float | None]:
    """Validation tokens per UTF-8 byte of each domain; None where the manifest has no bytes
    (synthetic domains, stores built before bytes were counted)."""
    out: list[float | None] = []
    for d in manifest.domains:
        nbytes = getattr(d.validation, "bytes", None)
        out.append(d.validation.tokens / nbytes if nbytes else None)
    return out


#: The DoReMi keys a reader needs to know what the proxy did (docs/design.md section 4).
PROXY_KEYS = (
    "eta",
    "smoothing",
    "reference_weights",
    "proxy_sampling",
    "mode",
    "update",
    "reference_fp8",
    "rounds",
    "average_from_step",
)


def _trained_tokens(run: Path) -> int | None:
    """Non-masked label tokens the run trained on, as measured (the last `realised` row of its
    metrics.jsonl); None when it logged none."""
    rows = (
        [r for r in read_jsonl(run / "metrics.jsonl") if isinstance(r.get("realised"), dict)]
        if (run / "metrics.jsonl").is_file()
        else []
    )
    return int(sum(rows[-1]["realised"]["tokens"].values())) if rows else None


def _run_row(label: str, cfg: dict[str, Any], trained: int | None) -> list[str]:
    from trainer.config.schema import ModelConfig
    from trainer.config.tools import from_dict
    from trainer.model.flops import param_count

    m, t, d = cfg["model"], cfg["train"], cfg["data"]
    params = param_count(from_dict(ModelConfig, m, "model"))
    tokens = t["steps"] * t["global_batch_size"] * d["seq_len"]
    return [
        label,
        f"{params / 1e6:.2f}M",
        f"d {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads",
        str(t["steps"]),
        f"{t['global_batch_size']} x {d['seq_len']}",
        "" if trained is None else f"{trained / 1e6:.2f}M",
        f"{tokens / 1e6:.2f}M",
        f"{t['lr']} -> {t['min_lr']}",
        str(t["seed"]),
    ]


def setup_table(root: Path) -> str | None:
    """What a pipeline ran, read from each run's saved config.yaml: model size and shape, steps,
    batch, tokens, learning rate and seed per stage, and the proxy's DoReMi keys. None when the
    pipeline wrote no configs (nothing ran)."""
    from trainer.config.tools import load_yaml

    runs = [
        *sorted(root.glob("round*/reference")),
        *sorted(root.glob("round*/search*/reference")),
        *sorted(root.glob("round*/proxy")),
        *sorted(root.glob("round*/search*/proxy")),
        *sorted(root.glob("methods/*/proxy")),
        *sorted(root.glob("methods/*/search*/proxy")),
        *sorted(root.glob("main/*")),
    ]
    configs = {r: load_yaml((r / "config.yaml").read_text()) for r in runs if (r / "config.yaml").is_file()}
    if not configs:
        return None
    rows = [_run_row(str(r.relative_to(root)), c, _trained_tokens(r)) for r, c in configs.items()]
    table = markdown_table(
        [
            "run",
            "parameters",
            "shape",
            "steps",
            "batch (seq x len)",
            "tokens trained (measured)",
            "tokens (nominal)",
            "lr",
            "seed",
        ],
        rows,
    )
    proxies = [c for r, c in configs.items() if r.name == "proxy"]
    if proxies:
        d = registry.options(proxies[-1], REFERENCE_RUN)
        table += "\nDoReMi: " + ", ".join(f"{k} {d[k]}" for k in PROXY_KEYS if k in d) + ".\n"
    return table


def tuned_methods(root: Path) -> list[str]:
    """The mixing methods whose weights a pipeline root holds: DoReMi (`weights.json`), then the
    others (`methods/<name>/weights.json`) in name order."""
    found = [REFERENCE_RUN] if (root / WEIGHTS_FILE).is_file() else []
    methods = root / "methods"
    if methods.is_dir():
        found += sorted(d.name for d in methods.iterdir() if (d / WEIGHTS_FILE).is_file())
    return found


def online_runs(root: Path) -> list[str]:
    """Main runs of methods run online (`main/<name>-online`)."""
    main = root / "main"
    return sorted(d.name for d in main.glob(online_run_name("*")) if d.is_dir()) if main.is_dir() else []


def run_budget(run: Path) -> int | None:
    """The token budget of a run from its config.yaml (for `unimax:E`); None without one."""
    from trainer.config.tools import load_yaml

    path = run / "config.yaml"
    if not path.is_file():
        return None
    c = load_yaml(path.read_text())
    return c["train"]["steps"] * c["train"]["global_batch_size"] * c["data"]["seq_len"]


def run_max_epochs(run: Path) -> float | None:
    """A run's `data.max_epochs` from its config.yaml (the cap its mixture was read under)."""
    from trainer.config.tools import load_yaml

    path = run / "config.yaml"
    return load_yaml(path.read_text()).get("data", {}).get("max_epochs") if path.is_file() else None


def read_mixture(run: Path, domains: list[str]) -> np.ndarray | None:
    """The fixed mixture a run read, from its last logged nominal counts (sum_t B x w_t,
    data/sampling/sampler.py): under `data.max_epochs` the cap depends on the run's sampler pools, so
    the run's log, not its config, says what it read. None before its first logged step."""
    path = run / "metrics.jsonl"
    rows = [r for r in read_jsonl(path) if "nominal_sequences" in r.get("realised", {})] if path.is_file() else []
    if not rows:
        return None
    counts = np.array([float(rows[-1]["realised"]["nominal_sequences"][d]) for d in domains])
    return counts / counts.sum()


def run_mixture(spec: Any, manifest: Manifest, run: Path) -> np.ndarray:
    """A main run's fixed mixture: its config's `data.domain_weights` resolved against its
    stores, or, when it ran under `data.max_epochs`, what it logged it read (`read_mixture`;
    the mixture as given until it has logged a step)."""
    try:
        budget = run_budget(run)  # only `unimax:E` needs it
    except (KeyError, TypeError):
        budget = None
    given = resolve_weights(spec, manifest, budget_tokens=budget)
    if run_max_epochs(run) is None:
        return given
    read = read_mixture(run, manifest.domain_names)
    return given if read is None else read


def logged_weights(run: Path, field: str = "weights") -> list[list[float]]:
    """A run's logged `field` per step. A method run online logs, besides the policy it proposes
    for the next step (`weights`), the weights it sampled this step with (`sampling`); the
    latter is what the run trained on, so it is what the report shows for an online run. A
    method that reweights the loss over a fixed sampling mixture instead (DoGE) logs no
    `sampling`: its loss weights `weights` are what it trained on, in expectation, and are shown."""
    try:
        records = read_history(run)
    except HistoryError:
        return []
    return [h[field] if field in h else h["weights"] for h in records]


def searches_weights(stage_dir: Path) -> list[list[float]]:
    """The logged weights of a round's or a method's proxy; with several searches their mean
    step by step over the steps all of them logged (what the pooled weights average)."""
    runs = [logged_weights(s / "proxy") for s in search_dirs(stage_dir)]
    runs = [r for r in runs if r]
    if len(runs) < 2:
        return runs[0] if runs else []
    steps = min(len(r) for r in runs)
    return [[sum(w) / len(runs) for w in zip(*(r[t] for r in runs))] for t in range(steps)]


def weight_histories(root: Path) -> dict[str, list[list[float]]]:
    """Each method's logged weights over its steps: DoReMi's last round's proxy, the other
    methods' proxies, and the methods run online (their sampling weights)."""
    out: dict[str, list[list[float]]] = {}
    rounds = sorted(
        (p for p in root.glob("round*") if p.is_dir() and p.name[5:].isdigit()), key=lambda p: int(p.name[5:])
    )
    if rounds:
        out[REFERENCE_RUN] = searches_weights(rounds[-1])
    for m in tuned_methods(root):
        if m != REFERENCE_RUN:
            out[m] = searches_weights(method_dir(root, m))
    for name in online_runs(root):
        out[name] = logged_weights(root / "main" / name, "sampling")
    return {k: v for k, v in out.items() if v}


def collect_run(
    root: Path, manifest: Manifest, baselines: list[str], guardrails: GuardrailConfig | None = None
) -> dict[str, Any]:
    """The same from a pipeline's run directory alone (e.g. one copied off the machine that ran
    it) and the manifest of its stores: domains, mixture weights (each method's averaged
    weights, the baselines, and for a method run online the mean of its sampling weights),
    final and per-eval validation losses of the main runs, each method's weight history (DoReMi's
    last round's alpha_t as `history`), the domains' entropies and tokens per byte, the compute
    each method spent, and the guardrails' measures and findings over every run."""
    root = Path(root)
    domains = manifest.domain_names
    methods = tuned_methods(root)
    histories = weight_histories(root)
    mixtures: dict[str, np.ndarray] = {}
    for name, spec in mixture_specs(root / WEIGHTS_FILE, baselines, methods).items():
        run = root / "main" / name
        mixtures[name] = run_mixture(spec, manifest, run)
    for name in online_runs(root):
        if histories.get(name):
            mixtures[name] = np.mean(np.asarray(histories[name], dtype=np.float64), axis=0)
    final: dict[str, list[float]] = {}
    curves: dict[str, list[tuple[int, list[float]]]] = {}
    for name in [*mixtures, *(n for n in online_runs(root) if n not in mixtures)]:
        run = root / "main" / name
        result = eval_result(run)
        if result is not None:
            final[name] = result["val_loss"]
        curves[name] = [
            (r["step"], [r["val_loss"][d] for d in domains])
            for r in (read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else [])
            if "val_loss" in r
        ]
    entropy = manifest.entropies
    measures = measure_pipeline(root, manifest=manifest)
    cfg = guardrails or GuardrailConfig()
    found = [f for m in measures for f in findings(m, cfg)]
    return {
        "domains": domains,
        "mixtures": mixtures,
        "final": final,
        "curves": curves,
        "history": histories.get(REFERENCE_RUN, []),
        "histories": histories,
        "compute": compute_ledger(root, methods, online_runs(root)),
        "entropy": entropy,
        "tokens_per_byte": tokens_per_byte(manifest),
        "measures": measures,
        "findings": found,
        "baselines": [n for n in mixtures if n not in methods and n not in online_runs(root)],
        "fits": fit_qualities(root, methods),
        "reads": method_reads([*methods, *online_runs(root)]),
    }


def method_reads(runs: list[str]) -> dict[str, str]:
    """What each method of the report read (its spec's `reads`, described), by its run's name
    (`<method>-online` for one run online)."""
    out = {}
    for run in runs:
        method = run.removesuffix(online_run_name(""))
        known = method in registry.specs()
        out[run] = registry.reads(method).describe() if known else "not in the catalog (doremi/methods/registry.py)"
    return out


def fit_qualities(root: Path, methods: list[str]) -> dict[str, dict[str, Any]]:
    """Each offline method's held-out quality (`doremi.offline.propose.fit_quality`), from its weights file."""
    import json

    from doremi.offline.propose import fit_quality

    out = {}
    for m in methods:
        path = root / WEIGHTS_FILE if m == REFERENCE_RUN else method_dir(root, m) / WEIGHTS_FILE
        if json.loads(path.read_text()).get("source") == "fit":
            out[m] = fit_quality(path)
    return out


def summarize(root: Path, store_dir: str, baselines: list[str], guardrails: GuardrailConfig) -> str:
    """Write a finished pipeline's `report.md` (and plots) into `root` and return the closing
    table for the terminal. Takes the pipeline's paths and keys, not the pipeline, so that this
    module does not import the pipeline back."""
    c = collect_run(root, open_stores(store_dir).manifest, baselines, guardrails)
    report = write_report(
        root,
        c["domains"],
        c["histories"],
        c["curves"],
        c["final"],
        c["mixtures"],
        c["entropy"],
        tokens_per_byte=c["tokens_per_byte"],
        baselines=c["baselines"],
        warnings=[f.message + (f"\n  {a}" if a else "") for f, a in with_advice(warnings(c["findings"]))],
        guardrail_table=format_guardrail_table(c["domains"], c["measures"]),
        setup_table=setup_table(root),
        compute_table=format_compute(c["compute"]) if c["compute"] else None,
        fit_table=(
            format_fit_quality(c["fits"], guardrails.min_fit_spearman, GuardrailConfig().min_fit_spearman)
            if c["fits"]
            else None
        ),
        reads_table=format_reads(c["reads"]) if c["reads"] else None,
    )
    table = format_summary(c["final"], baselines[0] if baselines else None)
    n = len(warnings(c["findings"]))
    return f"{table}\n\nguardrail warnings: {n} (each explained in the report)\nreport: {report} (every domain)"


def log_comparison(root: Path, store_dir: str, baselines: list[str], project: str, group: str | None) -> None:
    """The closing comparison as one wandb run in the pipeline's group (the stage runs log their
    own curves): final per-domain validation loss and weight of every mixture as a table, and
    each mixture's average and worst case over domains as summary values."""
    from trainer.records.metric_sinks import import_wandb

    wandb = import_wandb()
    c = collect_run(root, open_stores(store_dir).manifest, baselines)
    run = wandb.init(
        project=project,
        name=f"pipeline:{root}",
        group=group,
        job_type="comparison",
        dir=str(root),
        resume="allow",
        settings=wandb.Settings(quiet=True),
    )
    rows = [
        [name, d, float(losses[i]), float(c["mixtures"][name][i])]
        for name, losses in c["final"].items()
        for i, d in enumerate(c["domains"])
    ]
    run.log({"comparison": wandb.Table(columns=["mixture", "domain", "final_val_loss", "weight"], data=rows)})
    for name, losses in c["final"].items():
        values = [float(x) for x in losses]
        run.summary[f"{name}/average_val_loss"] = sum(values) / len(values)
        run.summary[f"{name}/worst_val_loss"] = max(values)
    run.finish()
