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
sweep), and the measured wall-clock seconds its stages took (the
pipeline's stage markers, `seconds`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from doremi.config import OFFLINE_METHODS
from doremi.main_runs import DOREMI_RUN, SWEEP_DIR, method_dir
from doremi.stage_markers import dir_marker
from trainer.metrics import read_jsonl


def _config(run: Path) -> dict[str, Any] | None:
    import yaml

    path = run / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def _flops_per_token(cfg: dict[str, Any]) -> int:
    from trainer.config import ModelConfig
    from trainer.configtools import from_dict
    from trainer.model.flops import flops_per_token

    return flops_per_token(from_dict(ModelConfig, cfg["model"], "model"), cfg["data"]["seq_len"])


def run_cost(run: Path, kind: str) -> dict[str, float] | None:
    """{train, reference, target, validation, total} FLOPs and `seconds` of one run; None when
    the run has no config. `kind`: reference, proxy (DoReMi's), method (another proxy) or online."""
    cfg = _config(run)
    if cfg is None:
        return None
    t, seq = cfg["train"], cfg["data"]["seq_len"]
    fpt = _flops_per_token(cfg)
    tokens = t["steps"] * t["global_batch_size"] * seq
    cost = {"train": float(fpt * tokens), "reference": 0.0, "target": 0.0, "validation": 0.0}
    method = cfg.get("mixing", {}).get("method" if kind == "method" else "main")
    if kind == "proxy":
        cost["reference"] = fpt / 3 * tokens
    if method == "doge" and kind in ("method", "online"):
        from doremi.methods.doge import DoGEConfig, target_sequences

        doge = DoGEConfig(target_sequences=cfg["mixing"]["doge"].get("target_sequences"))
        target = target_sequences(doge, t["global_batch_size"])
        cost["target"] = float(fpt * target * seq * t["steps"])
    rows = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    evals = next((r["method_evals"] for r in reversed(rows) if "method_evals" in r), None)
    if evals:
        cost["validation"] = fpt / 3 * evals["tokens"]
    cost["total"] = sum(cost.values())
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
    if method == DOREMI_RUN:
        rounds = sorted(root.glob("round*"), key=lambda p: int(p.name.removeprefix("round") or 0))
        return [(kind, r / kind) for r in rounds if r.name[5:].isdigit() for kind in ("reference", "proxy")]
    return [("method", method_dir(root, method) / "proxy")]


def trained_measured(rows: list[dict]) -> float | None:
    """The tokens a run drew, from its metrics rows (the last `realised` counts, cumulative);
    None for a run that logged none."""
    realised = next((r["realised"]["tokens"] for r in reversed(rows) if isinstance(r.get("realised"), dict)), None)
    return float(sum(realised.values())) if realised else None


def sweep_cost(root: Path) -> dict[str, float] | None:
    """The offline methods' cost: their shared sweep (`sweep.json`'s compute: every small run's
    training and evaluations) and its measured seconds; None before the sweep ran."""
    meta = root / SWEEP_DIR / "sweep.json"
    if not meta.is_file():
        return None
    import json

    compute = json.loads(meta.read_text()).get("compute", {})
    cost = {"train": float(compute.get("train_flops", 0.0)), "reference": 0.0, "target": 0.0}
    cost["validation"] = float(compute.get("eval_flops", 0.0))
    cost["total"] = cost["train"] + cost["validation"]
    cost["tokens"] = float(compute.get("train_tokens", 0) + compute.get("eval_tokens", 0))
    runs = sorted((root / SWEEP_DIR / "runs").glob("*/metrics.jsonl"))
    measured = [trained_measured(read_jsonl(m)) for m in runs]
    cost["trained_measured"] = sum(measured) if runs and all(m is not None for m in measured) else None
    marker = dir_marker(root / SWEEP_DIR)
    cost["seconds"] = json.loads(marker.read_text()).get("seconds") if marker.is_file() else None
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
        secs = [c.get("seconds") for c in costs]
        total["seconds"] = sum(secs) if all(x is not None for x in secs) else None
        out[name] = total
    return out
