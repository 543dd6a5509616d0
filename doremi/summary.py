"""The pipeline's closing table and `report.md`, built from the runs' own files
(weights JSON, domain_weights.jsonl, metrics.jsonl, eval results, the stores' manifest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from data.store import Manifest, open_stores
from data.weights import resolve_weights
from data.weights_file import WEIGHTS_FILE
from doremi.config import GuardrailConfig
from doremi.guardrails import findings, format_guardrail_table, measure_pipeline, warnings
from doremi.history import HistoryError, read_history
from doremi.main_runs import DOREMI_RUN
from doremi.main_runs import mixtures as mixture_specs
from doremi.report import format_table, markdown_table, write_report
from doremi.stage_markers import eval_result
from trainer.metrics import read_jsonl


def tokens_per_byte(manifest: Manifest) -> list[float | None]:
    """Validation tokens per UTF-8 byte of each domain; None where the manifest has no bytes
    (synthetic domains, stores built before bytes were counted)."""
    out: list[float | None] = []
    for d in manifest.domains:
        nbytes = getattr(d.validation, "bytes", None)
        out.append(d.validation.tokens / nbytes if nbytes else None)
    return out


#: The DoReMi keys a reader needs to know what the proxy did (docs/design.md section 4).
PROXY_KEYS = ("eta", "smoothing", "reference_weights", "proxy_sampling", "mode", "rounds", "average_from_step")


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
    from trainer.config import ModelConfig
    from trainer.configtools import from_dict
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
    import yaml

    runs = [*sorted(root.glob("round*/reference")), *sorted(root.glob("round*/proxy")), *sorted(root.glob("main/*"))]
    configs = {r: yaml.safe_load((r / "config.yaml").read_text()) for r in runs if (r / "config.yaml").is_file()}
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
        d = proxies[-1].get("doremi", {})
        table += "\nDoReMi: " + ", ".join(f"{k} {d[k]}" for k in PROXY_KEYS if k in d) + ".\n"
    return table


def collect_run(
    root: Path, manifest: Manifest, baselines: list[str], guardrails: GuardrailConfig | None = None
) -> dict[str, Any]:
    """The same from a pipeline's run directory alone (e.g. one copied off the machine that ran
    it) and the manifest of its stores: domains, mixture weights, final and per-eval validation
    losses of the main runs, the last round's alpha_t history, the domains' entropies and tokens
    per byte, and the guardrails' measures and findings over every run."""
    root = Path(root)
    domains = manifest.domain_names
    mixtures: dict[str, np.ndarray] = {}
    for name, spec in mixture_specs(root / WEIGHTS_FILE, baselines).items():
        mixtures[name] = resolve_weights(spec, manifest)
    final: dict[str, list[float]] = {}
    curves: dict[str, list[tuple[int, list[float]]]] = {}
    for name in mixtures:
        run = root / "main" / name
        result = eval_result(run)
        if result is not None:
            final[name] = result["val_loss"]
        curves[name] = [
            (r["step"], [r["val_loss"][d] for d in domains])
            for r in read_jsonl(run / "metrics.jsonl")
            if "val_loss" in r
        ]
    rounds = sorted(root.glob("round*/proxy"), key=lambda p: int(p.parent.name.removeprefix("round")))
    try:
        history = read_history(rounds[-1]) if rounds else []
    except HistoryError:
        history = []
    entropy = manifest.entropies
    measures = measure_pipeline(root)
    cfg = guardrails or GuardrailConfig()
    found = [f for m in measures for f in findings(m, cfg)]
    return {
        "domains": domains,
        "mixtures": mixtures,
        "final": final,
        "curves": curves,
        "history": [h["weights"] for h in history],
        "entropy": entropy,
        "tokens_per_byte": tokens_per_byte(manifest),
        "measures": measures,
        "findings": found,
        "baselines": [n for n in mixtures if n != DOREMI_RUN],
    }


def summarize(root: Path, store_dir: str, baselines: list[str], guardrails: GuardrailConfig) -> str:
    """Write a finished pipeline's `report.md` (and plots) into `root` and return the closing
    table for the terminal. Takes the pipeline's paths and keys, not the pipeline, so that this
    module does not import the pipeline back."""
    c = collect_run(root, open_stores(store_dir).manifest, baselines, guardrails)
    report = write_report(
        root,
        c["domains"],
        c["history"],
        c["curves"],
        c["final"],
        c["mixtures"],
        c["entropy"],
        tokens_per_byte=c["tokens_per_byte"],
        baselines=c["baselines"],
        warnings=[f.message for f in warnings(c["findings"])],
        guardrail_table=format_guardrail_table(c["domains"], c["measures"]),
        setup_table=setup_table(root),
    )
    table = format_table(c["domains"], c["mixtures"], c["final"], c["entropy"], c["tokens_per_byte"])
    n = len(warnings(c["findings"]))
    return f"{table}\n\nguardrail warnings: {n}\nreport: {report}"


def log_comparison(root: Path, store_dir: str, baselines: list[str], project: str, group: str | None) -> None:
    """The closing comparison as one wandb run in the pipeline's group (the stage runs log their
    own curves): final per-domain validation loss and weight of every mixture as a table, and
    each mixture's average and worst case over domains as summary values."""
    import wandb

    c = collect_run(root, open_stores(store_dir).manifest, baselines)
    run = wandb.init(
        project=project, name=f"pipeline:{root}", group=group, job_type="comparison", dir=str(root), resume="allow"
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
