"""muP transfer sweep (issue 23): does the best learning rate at one width stay best at another?

For each parametrization (standard, and spectral muP with `model.mup.base_width`), each width
and each learning rate, train the quickstart model (its data, depth, heads; d_model = width,
ffn_dim = 8/3 width rounded to 32) for `--steps` steps on the uniform mixture, and record the
final validation loss averaged over the domains. Under muP the best learning rate should be the
same at every width (Yang et al. 2022, "Tensor Programs V", Fig. 1); under the standard
parametrization it drifts down as the width grows. The table goes to `--out` with the command.

Usage (repository root; the quickstart stores are built first when missing):
    python experiments/tools/mup_transfer.py [--widths 256 1024] [--lrs 1e-3 3e-3 1e-2 3e-2] \\
        [--steps 100] [--base-width 256] [--work runs/mup_transfer] [--out experiments/results/mup_transfer.md]
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from doremi.config import ExperimentConfig  # noqa: E402
from trainer.config.schema import load_config  # noqa: E402
from trainer.records.metrics import read_jsonl  # noqa: E402


def ffn_dim(width: int) -> int:
    return max(32, round(8 * width / 3 / 32) * 32)


def final_val_loss(run: Path) -> float:
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
    losses = list(rows[-1]["val_loss"].values())
    return sum(losses) / len(losses)


def run_one(args, param: str, width: int, lr: float) -> float:
    from doremi.pipeline import stages

    run = args.work / f"{param}-w{width}-lr{lr:g}"
    sets = [
        f"model.d_model={width}",
        f"model.ffn_dim={ffn_dim(width)}",
        f"train.lr={lr}",
        f"train.min_lr={lr / 10}",
        f"train.steps={args.steps}",
        f"train.eval_every={args.steps}",
        f"train.run_dir={run}",
        f"checkpoint.every={args.steps}",
        "checkpoint.keep=1",
        "logging.progress=false",
        *args.set,
    ]
    if param == "mup":
        sets.append(f"model.mup.base_width={args.base_width}")
    cfg = load_config(args.config, sets, cls=ExperimentConfig)
    if not (run / "metrics.jsonl").exists() or not any("val_loss" in r for r in read_jsonl(run / "metrics.jsonl")):
        stages.train(cfg)
    return final_val_loss(run)


def ensure_stores(config: Path, sets: list[str]) -> None:
    from data.preprocess import preprocess

    cfg = load_config(config, sets, cls=ExperimentConfig)
    if not (Path(cfg.data.store_dir) / "manifest.json").exists():
        preprocess(cfg.data, progress=False)


def table(results: dict, widths: list[int], lrs: list[float]) -> list[str]:
    lines = []
    for param in results:
        lines += [f"**{param}**", "", "| lr | " + " | ".join(f"width {w}" for w in widths) + " |"]
        lines.append("|---|" + "---|" * len(widths))
        best = {w: min(lrs, key=lambda lr: results[param][(w, lr)]) for w in widths}
        for lr in lrs:
            cells = []
            for w in widths:
                v = results[param][(w, lr)]
                cells.append(("**%.4f**" if lr == best[w] else "%.4f") % v if math.isfinite(v) else "diverged")
            lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
        shift = [math.log2(best[w] / best[widths[0]]) for w in widths]
        lines += ["", f"best lr per width: {', '.join(f'{w}: {best[w]:g}' for w in widths)} "]
        lines += [f"(log2 shift from width {widths[0]}: {', '.join(f'{s:+.2f}' for s in shift)})", ""]
    return lines


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "experiments/configs/quickstart.yaml")
    p.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--base-width", type=int, default=256)
    p.add_argument("--params", nargs="+", default=["standard", "mup"], choices=["standard", "mup"])
    p.add_argument("--set", nargs="*", default=[], help="further config overrides, key=value")
    p.add_argument("--work", type=Path, default=ROOT / "runs/mup_transfer")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    ensure_stores(args.config, args.set)
    t0 = time.time()
    results: dict[str, dict] = {param: {} for param in args.params}
    for param in args.params:
        for w in args.widths:
            for lr in args.lrs:
                try:
                    results[param][(w, lr)] = run_one(args, param, w, lr)
                except (FloatingPointError, RuntimeError):
                    results[param][(w, lr)] = float("inf")
                print(f"{param} width {w} lr {lr:g}: {results[param][(w, lr)]:.4f}", flush=True)
    command = "python experiments/tools/mup_transfer.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# muP transfer sweep (quickstart data)",
        "",
        f"Command: `{command}` ({time.time() - t0:.0f} s). Final validation loss, mean over domains, "
        f"after {args.steps} steps; bold: the best learning rate of each width.",
        "",
        *table(results, args.widths, args.lrs),
    ]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
