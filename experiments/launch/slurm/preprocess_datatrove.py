"""`doremi preprocess` on a SLURM cluster through datatrove's SlurmPipelineExecutor (the extra
`[scale]`, issue 42 item 2): a job array of N shares of the build's per-file tasks, then a merge
job that depends on it (afterok) and writes the stores and the manifest last. Run it from the
repository root on a login node (it calls sbatch):

    .venv/bin/python experiments/launch/slurm/preprocess_datatrove.py CONFIG.yaml --tasks 64 \\
        --partition cpu --time 12:00:00 [--cpus-per-task 16] [--mem-per-cpu-gb 2] [--qos Q] [--set k=v ...]

Each array task tokenizes its share with --cpus-per-task processes (data.num_proc is set to it).
The nodes must see the store directory (data.store_dir on a shared file system) and the inputs.
datatrove's scripts, logs and per-rank completion records are in the store directory's
`.datatrove-<key>/` (shares/ and merge/; slurm_logs/ in each). Resume: the same command again
submits only the ranks datatrove has not recorded complete (inside a rank, our finished-task
markers skip its finished tasks), or only the merge; the stores' bytes do not depend on it
(tests/test_data_scale.py, with a fake sbatch). preprocess.sbatch is the same build without
datatrove (one share per node of one allocation). Exit status 2 with one line for a bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="experiment YAML file (its data section is read)")
    ap.add_argument("--tasks", type=int, required=True, help="shares of the build: the job array's size")
    ap.add_argument("--partition", required=True)
    ap.add_argument("--time", required=True, help="time limit of each job, e.g. 12:00:00")
    ap.add_argument("--cpus-per-task", type=int, default=16, help="CPUs (tokenizing processes) per share")
    ap.add_argument("--mem-per-cpu-gb", type=int, default=2)
    ap.add_argument("--qos", default="", help="SLURM QOS (default: none given)")
    ap.add_argument("--job-name", default="doremi-preprocess")
    ap.add_argument("--venv", help="activate script sourced by each job (default: none; PATH as submitted)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args(argv)

    from data.errors import UserError
    from data.preprocess.scale import SlurmSpec, slurm_executors
    from doremi.config import ExperimentConfig
    from trainer.config.schema import load_config

    spec = SlurmSpec(
        partition=args.partition,
        time=args.time,
        cpus_per_task=args.cpus_per_task,
        mem_per_cpu_gb=args.mem_per_cpu_gb,
        qos=args.qos,
        job_name=args.job_name,
        venv_path=args.venv,
    )
    try:
        cfg = load_config(args.config, args.set, cls=ExperimentConfig)
        shares, merge = slurm_executors(cfg.data, args.tasks, spec)
    except UserError as e:
        print(f"preprocess_datatrove: error: {e}", file=sys.stderr)
        return 2
    merge.run()  # submits the shares first (its dependency), then itself
    print(
        f"submitted: {args.tasks} shares (job {shares.job_id}), then the merge (job {merge.job_id}); "
        f"logs in {Path(shares.logging_dir.path).parent}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
