"""The compute each mixing method spent to find its mixture, read back from a pipeline root.

Per method, the runs it needed (DoReMi: every round's reference and proxy; another method: its
proxy; a method run online: its main run; RegMix and the mixing law: the sweep they share) and, per run, model FLOPs by the count of
`trainer.model.flops.flops_per_token` (6 N + attention per trained token, forward and backward;
a forward alone is a third of it):

    training                 flops_per_token x steps x global batch x seq_len
    DoReMi's reference       a forward of the reference per proxy token (online or cached: the
                             cache is computed once, by the same forward)
    DoGE's target gradient   flops_per_token x the target sequences x seq_len per step
    validation passes        a forward over the validation tokens of every pass the method
                             asked for (the trainer counts them: `method_evals` in metrics.jsonl)

the tokens those passes processed (nominal: steps x batch x sequence length), beside the
non-masked tokens the training steps measured (`realised` in metrics.jsonl; none for a stacked
sweep), the measured wall-clock seconds its stages took (the pipeline's stage markers,
`seconds`), and of those the seconds its validation passes took (`method_evals`' `seconds`,
timed by the trainer around each pass on the device, trainer/run/device_timer.py; none for a
sweep, whose evaluations are not timed apart).
`train_flops` and `forward_flops` are the two formulas, pure, so that a method's cost at its
default setting is a number a test asserts (Aioli's validation within 10% of its training).

A study's ledger (`study_run_cost`, `arm_ledger`; docs/design.md section 4e) counts every stage
of an arm, main run included, with its periodic evaluations and the GPU-seconds of its training
steps measured from metrics.jsonl, so that a report shows each method's total cost beside its
result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from doremi.config import OFFLINE_METHODS
from doremi.methods import registry
from doremi.outputs.main_runs import REFERENCE_RUN, SWEEP_DIR, method_dir, search_dirs
from doremi.outputs.stage_markers import dir_marker
from trainer.records.metrics import read_jsonl


def _config(run: Path) -> dict[str, Any] | None:
    from trainer.config.tools import load_yaml

    path = run / "config.yaml"
    return load_yaml(path.read_text()) if path.is_file() else None


def _flops_per_token(cfg: dict[str, Any]) -> int:
    from trainer.config.schema import ModelConfig
    from trainer.config.tools import from_dict
    from trainer.model.flops import flops_per_token

    return flops_per_token(from_dict(ModelConfig, cfg["model"], "model"), cfg["data"]["seq_len"])


def train_flops(flops_per_token: float, tokens: float) -> float:
    """A forward and a backward over `tokens` trained tokens (`trainer.model.flops`' count)."""
    return float(flops_per_token * tokens)


def forward_flops(flops_per_token: float, tokens: float) -> float:
    """A forward alone over `tokens` (a reference's, a validation pass's): a third of training's."""
    return flops_per_token / 3 * tokens


def run_cost(run: Path, kind: str) -> dict[str, float] | None:
    """{train, reference, target, validation, total} FLOPs and `seconds` of one run; None when
    the run has no config. `kind`: reference, proxy (DoReMi's), method (another proxy) or online."""
    cfg = _config(run)
    if cfg is None:
        return None
    t, seq = cfg["train"], cfg["data"]["seq_len"]
    fpt = _flops_per_token(cfg)
    tokens = t["steps"] * t["global_batch_size"] * seq
    cost = {"train": train_flops(fpt, tokens), "reference": 0.0, "target": 0.0, "validation": 0.0}
    method = cfg.get("mixing", {}).get("method" if kind == "method" else "main")
    if kind == "proxy":
        cost["reference"] = forward_flops(fpt, tokens)
    extra = registry.spec(method).extra_sequences if method in registry.specs() else None
    if extra is not None and kind in ("method", "online"):
        target = extra(registry.options(cfg, method), t["global_batch_size"])
        cost["target"] = train_flops(fpt, target * seq * t["steps"])
    rows = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    evals = next((r["method_evals"] for r in reversed(rows) if "method_evals" in r), None)
    if evals:
        cost["validation"] = forward_flops(fpt, evals["tokens"])
    cost["total"] = sum(cost.values())
    cost["validation_seconds"] = float(evals.get("seconds", 0.0)) if evals else 0.0
    # Tokens processed: trained, forwarded by the reference, DoGE's target (trained) and validated.
    cost["trained_measured"] = trained_measured(rows)
    target_tokens = cost["target"] / fpt if fpt else 0.0
    cost["tokens"] = tokens + (tokens if kind == "proxy" else 0) + target_tokens + (evals or {}).get("tokens", 0)
    marker = dir_marker(run)
    if marker.is_file():
        import json

        cost["seconds"] = json.loads(marker.read_text()).get("seconds")
    return cost


def method_runs(root: Path, method: str, online: bool = False) -> list[tuple[str, Path]]:
    """(kind, run directory) of the runs a method needed to find its mixture."""
    if online:
        return [("online", root / "main" / method)]
    if method == REFERENCE_RUN:
        rounds = sorted(root.glob("round*"), key=lambda p: int(p.name.removeprefix("round") or 0))
        return [
            (kind, s / kind)
            for r in rounds
            if r.name[5:].isdigit()
            for s in search_dirs(r)
            for kind in ("reference", "proxy")
        ]
    return [("method", s / "proxy") for s in search_dirs(method_dir(root, method))]


def trained_measured(rows: list[dict]) -> float | None:
    """The tokens a run drew, from its metrics rows (the last `realised` counts, cumulative);
    None for a run that logged none."""
    realised = next((r["realised"]["tokens"] for r in reversed(rows) if isinstance(r.get("realised"), dict)), None)
    return float(sum(realised.values())) if realised else None


def sweep_cost(root: Path) -> dict[str, float] | None:
    """The offline methods' cost: their shared sweep (`sweep.json`'s compute: every small run's
    training and evaluations) and its measured seconds; None before the sweep ran."""
    return sweep_dir_cost(root / SWEEP_DIR)


def sweep_dir_cost(sweep: Path) -> dict[str, float] | None:
    """`sweep_cost` of the sweep directory `sweep` itself (a pipeline's `sweep/`, a comparison's
    `sweep-seed<k>/`)."""
    meta = sweep / "sweep.json"
    if not meta.is_file():
        return None
    import json

    compute = json.loads(meta.read_text()).get("compute", {})
    cost = {"train": float(compute.get("train_flops", 0.0)), "reference": 0.0, "target": 0.0}
    cost["validation"] = float(compute.get("eval_flops", 0.0))
    cost["total"] = cost["train"] + cost["validation"]
    cost["tokens"] = float(compute.get("train_tokens", 0) + compute.get("eval_tokens", 0))
    runs = sorted((sweep / "runs").glob("*/metrics.jsonl"))
    measured = [trained_measured(read_jsonl(m)) for m in runs]
    cost["trained_measured"] = sum(measured) if runs and all(m is not None for m in measured) else None
    marker = dir_marker(sweep)
    cost["seconds"] = json.loads(marker.read_text()).get("seconds") if marker.is_file() else None
    cost["validation_seconds"] = None
    return cost


def compute_ledger(root: Path, methods: list[str], online: list[str]) -> dict[str, dict[str, float]]:
    """Method (or online run) -> summed FLOPs by part, total and measured seconds over its runs
    (the offline methods each show the sweep they share)."""
    out: dict[str, dict[str, float]] = {}
    for name in methods:
        if name in OFFLINE_METHODS and (cost := sweep_cost(root)) is not None:
            out[name] = cost
    for name, is_online in [*((m, False) for m in methods if m not in OFFLINE_METHODS), *((m, True) for m in online)]:
        costs = [c for kind, run in method_runs(root, name, is_online) if (c := run_cost(run, kind)) is not None]
        if not costs:
            continue
        total = {
            key: sum(c.get(key) or 0.0 for c in costs)
            for key in ("train", "reference", "target", "validation", "total", "tokens")
        }
        measured = [c.get("trained_measured") for c in costs]
        total["trained_measured"] = sum(measured) if all(m is not None for m in measured) else None
        for key in ("seconds", "validation_seconds"):
            secs = [c.get(key) for c in costs]
            total[key] = sum(secs) if all(x is not None for x in secs) else None
        out[name] = total
    return out


# -- a study's stages: every run's FLOPs and GPU-seconds (issue 34) ---------------------------

#: The parts of a run's cost, in the order a study's ledger shows them.
STUDY_PARTS = ("train", "reference", "target", "validation", "evaluation")


def evaluation_tokens(
    cfg: dict[str, Any], passes: int, run: Path | None = None, logged: Sequence[Any] = ()
) -> float | None:
    """Tokens the run's periodic evaluations forwarded: the sum of their logged `eval_tokens`
    (`logged`, one per pass) where every pass logged it; else passes x (train.eval_sequences x
    domains x seq_len); with `eval_sequences: 0` (the whole split, the same sequences every
    pass) passes x the sequences of the run's per-sequence file (eval_sequences/*.npz, section
    3b) x seq_len, else the stores' validation tokens (their manifest, where the stores are
    still there and the run read the whole split); None when unknown."""
    if passes == 0:
        return 0.0
    if len(logged) == passes and all(isinstance(t, (int, float)) for t in logged):
        return float(sum(logged))
    n, seq = cfg.get("train", {}).get("eval_sequences"), cfg["data"]["seq_len"]
    domains = cfg["data"].get("domains") or []
    if isinstance(n, int) and n > 0 and domains:
        return float(passes * n * len(domains) * seq)
    if n != 0:
        return None
    files = sorted((run / "eval_sequences").glob("step_*.npz")) if run is not None else []
    if files:
        import numpy as np

        with np.load(files[-1], allow_pickle=False) as z:
            return float(passes * len(z["tokens"]) * seq)
    store = cfg["data"].get("store_dir")
    whole = cfg["data"].get("validation_split", "none") == "none"  # dev_test: a half, by documents
    if whole and store and (Path(store) / "manifest.json").is_file():
        from data.store.store import read_manifest

        return float(passes * sum(d.validation.tokens for d in read_manifest(store).domains))
    return None


def holdout_tokens(cfg: dict[str, Any], rows: list[dict]) -> float:
    """Tokens of the final memorisation evaluation (`seen_loss`, `heldout_loss`): as many
    trained-on as held-back sequences, `data.holdout_sequences` of each domain."""
    if not any(isinstance(r.get("seen_loss"), dict) for r in rows):
        return 0.0
    data = cfg["data"]
    return float(2 * int(data.get("holdout_sequences") or 0) * len(data.get("domains") or []) * data["seq_len"])


def train_seconds(rows: Iterable[Mapping[str, Any]], tokens_per_step: int) -> float | None:
    """Seconds the training steps took: each logged interval's tokens over its measured rate
    (the trainer times an interval's steps only, not evaluations or checkpoints)."""
    total, prev, any_row = 0.0, 0, False
    for r in rows:
        rate = r.get("tokens_per_s")
        if "loss" not in r or not isinstance(rate, (int, float)) or rate <= 0:
            continue
        step = int(r["step"])
        total += max(step - prev, 0) * tokens_per_step / float(rate)
        prev, any_row = step, True
    return total if any_row else None


def study_run_cost(run: Path, kind: str) -> dict[str, float | None] | None:
    """One run of a study, for its arm's ledger: `run_cost`'s parts (training, DoReMi's
    reference forward for a proxy, DoGE's target, a method's validation passes) plus
    `evaluation`, the forward FLOPs of its periodic evaluations and its final memorisation
    evaluation (the same for every arm of a stage; None when their tokens are unknown), `total` (all parts known), and `gpu_seconds`,
    the training steps' time measured from metrics.jsonl (each logged interval's tokens over
    its tokens_per_s; a stage marker's wall-clock `seconds` where a pipeline wrote one).
    None without a config.yaml. `kind`: reference, proxy, method, online or main."""
    cost: dict[str, float | None] | None = run_cost(run, "online" if kind == "main" else kind)  # type: ignore[assignment]
    cfg = _config(run)
    if cost is None or cfg is None:
        return None
    rows = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    evals = [r for r in rows if isinstance(r.get("val_loss"), dict) or isinstance(r.get("test_loss"), dict)]
    tokens = evaluation_tokens(cfg, len(evals), run, [r.get("eval_tokens") for r in evals])
    if tokens is not None:
        tokens += holdout_tokens(cfg, rows)
    cost["evaluation"] = None if tokens is None else _flops_per_token(cfg) / 3 * tokens
    cost["total"] = None if tokens is None else float(cost["total"] or 0.0) + float(cost["evaluation"] or 0.0)
    cost["train_flops_total"] = sum(float(cost[p] or 0.0) for p in ("train", "reference", "target", "validation"))
    per_step = cfg["train"]["global_batch_size"] * cfg["data"]["seq_len"]
    cost["gpu_seconds"] = train_seconds(rows, per_step)
    return cost


def sum_costs(costs: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Part by part over an arm's runs; a part is None when any run lacks it."""
    keys = (*STUDY_PARTS, "total", "train_flops_total", "gpu_seconds", "seconds")
    out: dict[str, float | None] = {}
    for key in keys:
        values = [c.get(key) for c in costs]
        out[key] = sum(float(v) for v in values if v is not None) if all(v is not None for v in values) else None
    return out


def arm_ledger(
    runs: list[tuple[str, Path]], shares: Mapping[str, float] | None = None, by_run: bool = False
) -> dict[str, Any]:
    """An arm's compute for one seed: per stage (`kind`, run directory; with `by_run` the run's
    name, for several runs of one kind), then summed; a stage whose directory has no
    config.yaml is listed under `missing` and left out of the sums. `shares`: run name -> the
    fraction of a GPU the run had (several runs side by side time-slice one; the study's
    launcher records it, doremi/study/sharing.py): its measured GPU-seconds are scaled by it."""
    stages, missing = {}, []
    for kind, run in runs:
        c = study_run_cost(run, kind)
        if c is None:
            missing.append(f"{kind}: {run}")
            continue
        if c.get("gpu_seconds") is not None and shares and run.name in shares:
            c["gpu_seconds"] = float(c["gpu_seconds"]) * shares[run.name]
        stages[run.name if by_run else kind] = c
    return {"stages": stages, "sum": sum_costs(list(stages.values())), "missing": missing}


def sweep_stage_cost(sweep: Path) -> dict[str, float | None] | None:
    """A sweep as one stage of a study arm's ledger (`arm_ledger`'s parts): its training and
    evaluations are search (its fit reads the evaluations), so both are in `train_flops_total`;
    its GPU-seconds are its measured wall-clock seconds. None before the sweep ran."""
    cost: dict[str, float | None] | None = sweep_dir_cost(sweep)  # type: ignore[assignment]
    if cost is None:
        return None
    return {**cost, "evaluation": 0.0, "train_flops_total": cost["total"], "gpu_seconds": cost.get("seconds")}
