"""datatrove's executors running our preprocessing shares (data/preprocess/scale.py, data/preprocess/scale_steps.py;
issue 42 item 2, the extra `[scale]`): the stores equal those of one process, with datatrove's
local executor (3 tasks in 2 workers; one build killed with SIGKILL and resumed) and its SLURM
executor (the sbatch scripts it writes, run by a fake `sbatch`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from data.errors import DataError
from data.preprocess import tasks
from data.preprocess.preprocess import preprocess
from data.store.store import MANIFEST_FILE
from tests.test_data_tasks import config, corpus, store_bytes

ROOT = Path(__file__).resolve().parents[1]


def _datatrove():
    return pytest.importorskip("datatrove")


def _yaml(tmp_path: Path, domains, store: Path, num_proc: int) -> Path:
    lines = ["data:", f"  store_dir: {store}", "  tokenizer: {kind: bpe, vocab_size: 320}"]
    lines += [f"  num_proc: {num_proc}", "  validation_fraction: 0.15", "  domains:"]
    for d in domains:
        extra = f", max_documents: {d.max_documents}" if d.max_documents else ""
        lines.append(f"    - {{name: {d.name}, paths: ['{d.paths[0]}'], sample_by: {d.sample_by}{extra}}}")
    path = tmp_path / f"{store.name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_local_executor_with_three_tasks_gives_the_bytes_of_one_process(tmp_path, capsys):
    """`doremi preprocess --executor datatrove-local --tasks 3` with num_proc 2: datatrove's pool
    of 2 workers (forkserver, the step pickled) runs the 3 shares of the 7 tasks, the merge runs
    here, and datatrove's logs are gone once the stores are committed."""
    _datatrove()
    from doremi.commands.cli import main

    domains = corpus(tmp_path)
    fresh = config(tmp_path, domains, "fresh")
    preprocess(fresh, progress=False)
    cfg = _yaml(tmp_path, domains, tmp_path / "dt", num_proc=2)
    assert main(["preprocess", str(cfg), "--executor", "datatrove-local", "--tasks", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"stores in {tmp_path / 'dt'}: 3 domains"
    assert store_bytes(str(tmp_path / "dt")) == store_bytes(fresh.store_dir)
    assert not [p.name for p in (tmp_path / "dt").iterdir() if p.name.startswith(".")]


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from data.preprocess import tasks
    from data.preprocess.scale import run_preprocess
    from doremi.config import ExperimentConfig
    from trainer.config.schema import load_config

    run, done = tasks.run_task, []

    def run_task(*args):
        if len(done) == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        done.append(run(*args))

    tasks.run_task = run_task
    run_preprocess(load_config(sys.argv[1], [], cls=ExperimentConfig).data, "datatrove-local", 3)
    """
)


def test_a_killed_build_resumes_from_datatroves_records_and_our_markers(tmp_path, monkeypatch, capsys):
    """Shares of 7 tasks over 3 ranks: rank 0 holds 3 tasks, rank 1 two, rank 2 two. Killed at
    the 5th task: rank 0 recorded complete by datatrove, one task of rank 1 by our marker. The
    re-run skips rank 0 (datatrove) and that task (our marker): 3 tasks run, same bytes."""
    _datatrove()
    from doremi.commands.cli import main

    domains = corpus(tmp_path)
    fresh = config(tmp_path, domains, "fresh")
    preprocess(fresh, progress=False)
    cfg = _yaml(tmp_path, domains, tmp_path / "dt", num_proc=1)
    with open(tmp_path / "killed.log", "w") as log:  # datatrove's manager process outlives the kill: no pipe
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLER, str(cfg)], cwd=ROOT, stdout=log, stderr=log, start_new_session=True
        )
        returncode = proc.wait(timeout=300)
    os.killpg(proc.pid, signal.SIGKILL)  # that orphaned manager, in the killed build's own session
    assert returncode == -9, (tmp_path / "killed.log").read_text()
    (logs,) = (tmp_path / "dt").glob(".datatrove-*")
    assert sorted(p.name for p in (logs / "completions").iterdir()) == ["00000"]
    assert len(list((tmp_path / "dt").glob(".tasks-*/*/*.done.json"))) == 4
    assert not (tmp_path / "dt" / MANIFEST_FILE).exists()

    ran = []
    run = tasks.run_task
    monkeypatch.setattr(tasks, "run_task", lambda task, *a: ran.append((task.domain, task.index)) or run(task, *a))
    assert main(["preprocess", str(cfg), "--executor", "datatrove-local", "--tasks", "3"]) == 0
    assert len(ran) == 3 and ("web", 0) not in ran
    assert store_bytes(str(tmp_path / "dt")) == store_bytes(fresh.store_dir)


def test_without_datatrove_the_executor_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from doremi.commands.cli import main

    monkeypatch.setitem(sys.modules, "datatrove", None)  # import datatrove raises ImportError
    cfg = _yaml(tmp_path, corpus(tmp_path), tmp_path / "dt", num_proc=1)
    assert main(["preprocess", str(cfg), "--executor", "datatrove-local", "--tasks", "2"]) == 2
    assert capsys.readouterr().err == (
        "doremi preprocess: error: --executor datatrove-local needs datatrove, the optional extra [scale]: "
        "pip install -e .[scale] (or: pip install datatrove)\n"
    )
    assert not (tmp_path / "dt").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "2"], "--tasks: only with --executor datatrove-local (the local executor runs data.num_proc)"),
        (["--executor", "datatrove-local", "--force"], "--force: only with the local executor"),
        (["--executor", "datatrove-local", "--tasks", "0"], "--tasks 0: expected at least 1 task"),
    ],
)
def test_executor_options_that_do_not_fit_are_refused(tmp_path, args, message):
    from data.config import DataConfig
    from data.preprocess.scale import run_preprocess

    _datatrove()
    cfg = DataConfig(store_dir=str(tmp_path / "s"))
    executor = args[args.index("--executor") + 1] if "--executor" in args else "local"
    tasks_ = int(args[args.index("--tasks") + 1]) if "--tasks" in args else None
    with pytest.raises(DataError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        run_preprocess(cfg, executor, tasks_, force="--force" in args)
    assert not (tmp_path / "s").exists()


FAKE_SBATCH = """#!/bin/bash
# Runs each array index of the submitted script now, in order; prints a job id as sbatch does.
n=$(( $(cat "$FAKE/count" 2>/dev/null || echo 0) + 1 )); echo $n > "$FAKE/count"
script="${@: -1}"
cp "$script" "$FAKE/job$n.sh"
echo "job$n: ${*:1:$#-1}" >> "$FAKE/calls.log"
range=$(sed -n 's/^#SBATCH --array=\\([0-9]*\\)-\\([0-9]*\\).*/\\1 \\2/p' "$script")
read -r first last <<< "${range:-0 0}"
for ((i = first; i <= last; i++)); do
  SLURM_ARRAY_TASK_ID=$i SLURM_JOB_ID=$n SLURM_NODELIST=node1 bash "$script" >> "$FAKE/job$n.out" 2>&1 \\
    || { echo "fake sbatch: job $n task $i failed" >&2; exit 1; }
done
echo "Submitted batch job $n"
"""
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == -* ]]; do [[ "$1" == -n ]] && shift; shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
echo node1
"""


def test_the_slurm_recipe_submits_shares_then_a_merge(tmp_path):
    """experiments/launch/slurm/preprocess_datatrove.py: a job array of 3 shares (each with
    --cpus-per-task processes) and datatrove's stats job, then the merge job after the array
    (afterok) and its stats job; the fake sbatch runs every script as submitted. Same bytes as
    one process."""
    _datatrove()
    domains = corpus(tmp_path)
    fresh = config(tmp_path, domains, "fresh")
    preprocess(fresh, progress=False)
    cfg = _yaml(tmp_path, domains, tmp_path / "dt", num_proc=1)
    fake = tmp_path / "fake"
    fake.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}", "FAKE": str(fake)}
    recipe = ROOT / "experiments" / "launch" / "slurm" / "preprocess_datatrove.py"
    cmd = [sys.executable, str(recipe), str(cfg), "--tasks", "3", "--partition", "cpu", "--time", "1:00:00"]
    res = subprocess.run(cmd + ["--cpus-per-task", "2"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr + "".join(p.read_text() for p in fake.glob("*.out"))
    calls = (fake / "calls.log").read_text().splitlines()
    merge_call = "job3: --export=ALL,RUN_OFFSET=0 --dependency=afterok:1"
    assert calls == ["job1: --export=ALL,RUN_OFFSET=0", "job2: ", merge_call, "job4: "]
    shares = (fake / "job1.sh").read_text()
    assert "#SBATCH --array=0-2\n" in shares and "#SBATCH --cpus-per-task=2\n" in shares
    assert "#SBATCH --partition=cpu\n" in shares and "#SBATCH --qos" not in shares
    assert "srun  -l -n 1 launch_pickled_pipeline " in shares and "/shares/executor.pik" in shares
    assert "merge_stats " in (fake / "job2.sh").read_text()
    assert "/merge/executor.pik" in (fake / "job3.sh").read_text()
    assert res.stdout.splitlines()[-1].startswith("submitted: 3 shares (job 1), then the merge (job 3); logs in ")
    built = {k: v for k, v in store_bytes(str(tmp_path / "dt")).items() if not k.startswith(".datatrove-")}
    assert built == store_bytes(fresh.store_dir)
    (logs,) = (tmp_path / "dt").glob(".datatrove-*")  # kept: the jobs' logs
    assert sorted(p.name for p in (logs / "shares" / "completions").iterdir()) == ["00000", "00001", "00002"]
