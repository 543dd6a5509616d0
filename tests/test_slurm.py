"""The SLURM recipe: the torchrun command it launches (GPUs per node from the allocation), and
requeue on the time-limit signal: the job is requeued, the training processes get SIGTERM (they
checkpoint and stop) and the script waits for them. Run with fake `srun` and `scontrol`."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "launch" / "slurm" / "doremi.sbatch"

FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$LOG"
trap 'echo TERM >> "$LOG"; exit 143' TERM
while true; do sleep 0.05; done
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ "$1 $2" == "show hostnames" ]]; then echo node-a; echo node-b; exit 0; fi
echo "scontrol $*" >> "$LOG"
"""


def _env(tmp_path: Path, submit_dir: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LOG": str(tmp_path / "calls.log"),
        "SLURM_SUBMIT_DIR": str(submit_dir),
        "SLURM_JOB_ID": "123",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_GPUS_ON_NODE": "4",
    }


def test_time_limit_signal_requeues_and_stops_the_run_with_a_checkpoint(tmp_path):
    env = _env(tmp_path, ROOT)
    log = tmp_path / "calls.log"
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "experiments/configs/quickstart.yaml", "--set", "a=b"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 10
    while not (log.exists() and "srun" in log.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=10)
    calls = log.read_text().splitlines()
    assert proc.returncode == 143, out
    assert calls[0] == (
        "srun --kill-on-bad-exit=1 .venv/bin/python -m torch.distributed.run --nnodes=2 --nproc_per_node=4 "
        "--rdzv_id=123 --rdzv_backend=c10d --rdzv_endpoint=node-a:29500 "
        "-m doremi pipeline experiments/configs/quickstart.yaml --set a=b"
    )
    assert calls[1:] == ["scontrol requeue 123", "TERM"]
    assert "requeueing job 123" in out


def test_submitted_from_elsewhere_is_one_line_and_exit_2(tmp_path):
    res = subprocess.run(
        ["bash", str(SCRIPT), "experiments/configs/quickstart.yaml"],
        env=_env(tmp_path, tmp_path),
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert res.returncode == 2
    assert res.stderr == f"doremi.sbatch: error: submit from the repository root (the job runs in {tmp_path})\n"
    assert not (tmp_path / "calls.log").exists()
