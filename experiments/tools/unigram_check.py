"""Does a tiny model learn more than token frequencies? Train the quickstart's reference-size
model on the quickstart stores (uniform weights) and compare each domain's validation loss with
the unigram entropy of that domain's validation tokens (the loss of the best context-free model).

    python experiments/tools/unigram_check.py [--steps 160] [--run-dir runs/unigram_check]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from data.preprocess.preprocess import preprocess
from data.store.stats import unigram_entropy
from data.store.store import open_stores
from doremi.config import ExperimentConfig
from doremi.pipeline import stages
from trainer.config.schema import load_config


def unigram_entropies(store_dir: str) -> dict[str, float]:
    stores = open_stores(store_dir)
    return {d: unigram_entropy(stores, d) for d in stores.domains}


def check(config: str, overrides: list[str]) -> tuple[dict[str, float], dict[str, float], float]:
    cfg = load_config(config, overrides, cls=ExperimentConfig)
    preprocess(cfg.data, progress=False)
    t0 = time.perf_counter()
    last = stages.train(cfg)
    seconds = time.perf_counter() - t0
    return last["val_loss"], unigram_entropies(cfg.data.store_dir), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/configs/quickstart.yaml")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--run-dir", default="runs/unigram_check")
    args = p.parse_args()
    val, uni, seconds = check(
        args.config,
        [
            f"train.steps={args.steps}",
            f"train.run_dir={args.run_dir}",
            f"train.eval_every={args.steps}",
            "checkpoint.resume=false",
        ],
    )
    print(f"{args.steps} steps in {seconds:.0f} s")
    print(f"{'domain':<8} {'val loss':>9} {'unigram H':>10} {'below by':>9}")
    for d in val:
        print(f"{d:<8} {val[d]:>9.3f} {uni[d]:>10.3f} {uni[d] - val[d]:>9.3f}")
    print(f"{'average':<8} {np.mean(list(val.values())):>9.3f} {np.mean(list(uni.values())):>10.3f}")


if __name__ == "__main__":
    main()
