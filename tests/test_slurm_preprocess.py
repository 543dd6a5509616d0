"""The SLURM preprocessing recipe (experiments/launch/slurm/preprocess.sbatch, issue 42): one
share of the per-file tasks per node, then the merge, under a fake `srun` that runs the node
commands one after another; the stores equal those of one `preprocess` call."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from data.config import DataConfig, DomainSource
from data.preprocess.preprocess import preprocess

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "launch" / "slurm" / "preprocess.sbatch"

FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$LOG"
shift
for ((i = 0; i < NODES; i++)); do SLURM_PROCID=$i SLURM_NTASKS=$NODES "$@" || exit $?; done
"""


def _corpus(tmp_path: Path) -> list[DomainSource]:
    d = tmp_path / "in"
    d.mkdir()
    for i in range(3):
        (d / f"web{i}.jsonl").write_text(
            "".join(json.dumps({"text": f"web {i} doc {j} ünï"}) + "\n" for j in range(20))
        )
    (d / "notes.txt").write_text("".join(f"note {j}\n" for j in range(30)))
    return [
        DomainSource(name="web", paths=[str(d / "web*.jsonl")]),
        DomainSource(name="notes", paths=[str(d / "notes.txt")], sample_by="line"),
    ]


def test_shares_on_two_nodes_then_the_merge(tmp_path):
    domains = _corpus(tmp_path)
    config = tmp_path / "c.yaml"
    lines = ["data:", f"  store_dir: {tmp_path / 'stores'}", "  tokenizer: {kind: byte}", "  domains:"]
    lines += [f"    - {{name: {d.name}, paths: ['{d.paths[0]}'], sample_by: {d.sample_by}}}" for d in domains]
    config.write_text("\n".join(lines) + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LOG": str(tmp_path / "calls.log"),
        "NODES": "2",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_ID": "7",
        "SLURM_NNODES": "2",
        "SLURM_CPUS_ON_NODE": "1",
    }
    res = subprocess.run(["bash", str(SCRIPT), str(config)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert out[0] == f"preprocess.sbatch: job 7 (restart 0): {config} on 2 node(s) x 1 CPU(s)"
    assert out[1].startswith("share 0 of 2: 2 of 2 tasks run here (0 already finished)")
    assert out[2].startswith("share 1 of 2: 2 of 2 tasks run here (0 already finished)")
    assert out[-1] == f"stores in {tmp_path / 'stores'}: 2 domains"
    assert (tmp_path / "calls.log").read_text().startswith("srun --kill-on-bad-exit=1 bash -c ")

    alone = DataConfig(domains=domains, store_dir=str(tmp_path / "alone"), num_proc=1)
    preprocess(alone, progress=False)
    for name in ("web/train.bin", "web/validation.idx", "notes/train.bin", "notes/train.idx"):
        assert (tmp_path / "stores" / name).read_bytes() == (tmp_path / "alone" / name).read_bytes()
