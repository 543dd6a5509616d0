"""Where a run's metrics go besides metrics.jsonl: Weights & Biases and TensorBoard, each an
optional extra imported only when asked for (`pip install -e .[wandb]`, `.[tensorboard]`).

A run directory is the unit of resumption (a SLURM requeue, a Ctrl-C, a deadline): the wandb run
id is kept in it (`wandb_id`), so a resumed run continues the same wandb run instead of starting a
new one, and TensorBoard appends to the same `tensorboard/` folder, where a resumed step
overwrites nothing it shows (TensorBoard keeps the latest point per step).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from trainer.config.tools import ConfigError

WANDB_ID_FILE = "wandb_id"
TENSORBOARD_DIR = "tensorboard"


class MissingExtra(ConfigError):
    """An optional logger was asked for and its package is not installed."""


class MetricSink(Protocol):
    def log(self, numbers: dict[str, float], step: int | None) -> None: ...

    def close(self) -> None: ...


def run_id(run_dir: Path) -> str:
    """The run directory's wandb id, made once (8 lowercase hex digits, as wandb's own) and
    read back on every resume."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_dir.mkdir(parents=True, exist_ok=True)
    made = secrets.token_hex(4)
    tmp = path.with_name(f".{WANDB_ID_FILE}.tmp")
    tmp.write_text(made + "\n")
    os.replace(tmp, path)
    return made


def import_wandb(key: str = "logging.wandb") -> Any:
    """The wandb module, or one line naming the extra to install."""
    try:
        import wandb
    except ImportError as e:
        raise MissingExtra(f"{key}: wandb is not installed ({e}); pip install -e '.[wandb]'") from e
    return wandb


class WandbSink:
    """One wandb run per run directory, resumed by its kept id; quiet (wandb's console summary
    of every run is turned off: a pipeline of ten runs printed about 300 lines)."""

    def __init__(self, run_dir: Path, project: str, name: str, group: str | None, config: dict | None):
        wandb = import_wandb()
        self._run = wandb.init(
            project=project,
            name=name,
            group=group,
            config=config,
            dir=str(run_dir),
            id=run_id(run_dir),
            resume="allow",
            settings=wandb.Settings(quiet=True),
        )

    def log(self, numbers: dict[str, float], step: int | None) -> None:
        self._run.log(numbers, step=step)

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    """Scalars to `<run_dir>/tensorboard/` through torch's SummaryWriter."""

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise MissingExtra(
                f"logging.tensorboard: tensorboard is not installed ({e}); pip install -e '.[tensorboard]'"
            ) from e
        self._writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def log(self, numbers: dict[str, float], step: int | None) -> None:
        for key, value in numbers.items():
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


def open_sinks(
    run_dir: Path,
    wandb: bool = False,
    tensorboard: bool = False,
    project: str = "doremi",
    name: str = "",
    group: str | None = None,
    config: dict[str, Any] | None = None,
) -> list[MetricSink]:
    sinks: list[MetricSink] = []
    if wandb:
        sinks.append(WandbSink(run_dir, project, name, group, config))
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    return sinks
