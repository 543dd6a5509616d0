"""`doremi preprocess` spread by datatrove's executors, the optional extra `[scale]` (issue 42
item 2; docs/design.md section 3a-iii).

datatrove (the field's engine for tokenizing at this scale: local, SLURM and Ray executors) runs
our shares (data.preprocess.scale_steps, data.preprocess.preprocess.preprocess_share); the merge
is ours, so the stores are byte-identical to one process (tests/test_data_scale.py). datatrove is
imported only here, after a check that names the extra, so that the default path never needs it.

Its logs and per-rank completion records go to `<store>/.datatrove-<key>`, keyed by the inputs'
fingerprint, the executor and the number of tasks: a record of another build (other inputs, or
ranks that mapped to other shares) is never taken for this one's. A re-run skips the ranks
datatrove recorded as complete, and inside an unfinished rank our own finished-task markers skip
its finished tasks.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from data.config import DataConfig
from data.errors import DataError
from data.preprocess.preprocess import fingerprint, preprocess
from data.preprocess.tasks import task_key
from data.sources.sources import plan_domains
from data.store.store import Manifest

SCALE_HINT = "pip install -e .[scale] (or: pip install datatrove)"
LOGS_PREFIX = ".datatrove-"


class ScaleUnavailableError(DataError):
    """A datatrove executor asked for where datatrove is not installed."""


def require_datatrove(what: str) -> None:
    try:
        import datatrove  # noqa: F401
    except ImportError:
        raise ScaleUnavailableError(f"{what} needs datatrove, the optional extra [scale]: {SCALE_HINT}") from None


def logs_dir(cfg: DataConfig, executor: str, tasks: int) -> Path:
    key = task_key([fingerprint(cfg, plan_domains(cfg)), executor, tasks])
    return Path(cfg.store_dir) / f"{LOGS_PREFIX}{key}"


def remove_logs(store: Path, keep: Path | None = None) -> None:
    """datatrove's directories of other builds (other inputs or task counts), or all of them."""
    for d in store.glob(f"{LOGS_PREFIX}*"):
        if d != keep:
            shutil.rmtree(d, ignore_errors=True)


def _check(cfg: DataConfig, tasks: int, what: str) -> Path:
    require_datatrove(what)
    if tasks < 1:
        raise DataError(f"--tasks {tasks}: expected at least 1 task")
    cfg.validate()
    return Path(cfg.store_dir)


def preprocess_datatrove_local(cfg: DataConfig, tasks: int, progress: bool = True) -> Manifest:
    """`doremi preprocess CONFIG --executor datatrove-local --tasks N`: datatrove's
    LocalPipelineExecutor runs the N shares in `cfg.num_proc` worker processes (each share
    tokenizing in its own process), then the merge runs here; its logs are removed once the
    stores are committed."""
    store = _check(cfg, tasks, "--executor datatrove-local")
    logs = logs_dir(cfg, "local", tasks)
    remove_logs(store, keep=logs)
    from datatrove.executor.local import LocalPipelineExecutor

    from data.preprocess.scale_steps import PreprocessShare

    step = PreprocessShare(dataclasses.replace(cfg, num_proc=1))
    LocalPipelineExecutor([step], tasks=tasks, workers=min(tasks, cfg.num_proc), logging_dir=str(logs)).run()
    manifest = preprocess(cfg, progress=progress)
    remove_logs(store)
    return manifest


@dataclasses.dataclass
class SlurmSpec:
    """The SLURM resources of each share (one job-array task) and of the merge job."""

    partition: str
    time: str
    cpus_per_task: int = 16
    mem_per_cpu_gb: int = 2
    qos: str = ""
    job_name: str = "doremi-preprocess"
    venv_path: str | None = None


def slurm_executors(cfg: DataConfig, tasks: int, spec: SlurmSpec) -> tuple[Any, Any]:
    """(shares, merge): datatrove SlurmPipelineExecutors, the shares a job array of `tasks`
    tasks, each tokenizing with `spec.cpus_per_task` processes, and the merge one job that
    depends on it (afterok). `merge.run()` submits both (experiments/launch/slurm/
    preprocess_datatrove.py); their logs and sbatch scripts stay in the store's
    `.datatrove-<key>` directory."""
    _check(cfg, tasks, "the datatrove SLURM recipe")
    logs = logs_dir(cfg, "slurm", tasks).resolve()
    remove_logs(logs.parent, keep=logs)
    from datatrove.executor.slurm import SlurmPipelineExecutor

    from data.preprocess.scale_steps import PreprocessMerge, PreprocessShare

    node_cfg = dataclasses.replace(cfg, num_proc=spec.cpus_per_task)
    common = {
        "time": spec.time,
        "partition": spec.partition,
        "cpus_per_task": spec.cpus_per_task,
        "mem_per_cpu_gb": spec.mem_per_cpu_gb,
        "qos": spec.qos,
        "venv_path": spec.venv_path,
    }
    shares = SlurmPipelineExecutor(
        [PreprocessShare(node_cfg)],
        tasks=tasks,
        job_name=f"{spec.job_name}-shares",
        logging_dir=str(logs / "shares"),
        **common,
    )
    merge = SlurmPipelineExecutor(
        [PreprocessMerge(node_cfg)],
        tasks=1,
        job_name=f"{spec.job_name}-merge",
        logging_dir=str(logs / "merge"),
        depends=shares,
        **common,
    )
    return shares, merge


EXECUTORS = ("local", "datatrove-local")


def run_preprocess(cfg: DataConfig, executor: str = "local", tasks: int | None = None, force: bool = False) -> Manifest:
    """The build by the executor `doremi preprocess --executor` names: `local` (ours, the default:
    `data.num_proc` processes) or `datatrove-local` (`--tasks` shares, default `data.num_proc`)."""
    if executor == "local":
        if tasks is not None:
            raise DataError("--tasks: only with --executor datatrove-local (the local executor runs data.num_proc)")
        return preprocess(cfg, force=force)
    if executor != "datatrove-local":
        raise DataError(f"--executor {executor!r}: expected one of {', '.join(EXECUTORS)}")
    if force:
        raise DataError("--force: only with the local executor (a forced rebuild runs here: drop --executor)")
    return preprocess_datatrove_local(cfg, cfg.num_proc if tasks is None else tasks)
