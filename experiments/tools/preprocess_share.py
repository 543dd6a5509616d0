"""Run one share of a `doremi preprocess` build: tasks I, I + N, I + 2N, ... of the config's
per-file tasks (data/preprocess/tasks.py), recorded in the store directory's work directory, so that N
nodes that see one store directory tokenize a corpus together (issue 42 point 2):

    .venv/bin/python experiments/tools/preprocess_share.py CONFIG.yaml --task I --of N [--set k=v ...]
    .venv/bin/doremi preprocess CONFIG.yaml     # then, once: the tasks still missing, the merge, the manifest

experiments/launch/slurm/preprocess.sbatch runs it on every node of a job (task = SLURM_PROCID),
then the merge. Exit status 2 with one line on stderr for a bad input, as `doremi` gives.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="experiment YAML file (its data section is read)")
    ap.add_argument("--task", type=int, required=True, help="this share's index, 0 <= I < N")
    ap.add_argument("--of", type=int, required=True, help="number of shares N")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args(argv)

    from data.errors import UserError
    from data.preprocess.preprocess import preprocess_share
    from doremi.config import ExperimentConfig
    from trainer.config.schema import load_config

    start = time.perf_counter()
    try:
        cfg = load_config(args.config, args.set, cls=ExperimentConfig)
        ran, share = preprocess_share(cfg.data, args.task, args.of)
    except UserError as e:
        print(f"preprocess_share: error: {e}", file=sys.stderr)
        return 2
    print(
        f"share {args.task} of {args.of}: {ran} of {share} tasks run here ({share - ran} already finished) "
        f"in {time.perf_counter() - start:.1f} s; store {cfg.data.store_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
