"""Run metrics: `metrics.jsonl` (one JSON object per logged step), progress on stderr (a bar on a
terminal, plain lines in a log file), and wandb or TensorBoard when asked. Only the global rank 0 writes; every
number it writes is already global."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from data.atomic import atomic_write_text
from trainer.records.metric_sinks import MetricSink, open_sinks


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line from a crash
    return rows


def truncate_jsonl(path: str | os.PathLike, last_step: int) -> None:
    """Keep the rows with step <= last_step (a resumed run rewrites the steps after it)."""
    p = Path(path)
    if p.exists():
        rows = [r for r in read_jsonl(p) if r.get("step", 0) <= last_step]
        atomic_write_text(p, "".join(json.dumps(r) + "\n" for r in rows))


class JsonlWriter:
    """Append-only JSON lines, flushed per line."""

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_jsonl(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._f = open(self.path, "a")

    def write(self, row: dict[str, Any]) -> None:
        try:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
        except OSError as e:  # a full disk: name the file (the CLI prints one line)
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def close(self) -> None:
        self._f.close()


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def flatten_numbers(row: dict[str, Any], prefix: str = "") -> dict[str, float | int]:
    """`{"realised": {"tokens": {"a": 3}}}` -> `{"realised/tokens/a": 3}`: the numbers of a row,
    by path, as wandb charts them."""
    flat: dict[str, float | int] = {}
    for k, v in row.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flatten_numbers(v, key + "/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            flat[key] = v
    return flat


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | os.PathLike,
        enabled: bool,
        total_steps: int,
        start_step: int,
        progress: bool = True,
        wandb: bool = False,
        wandb_project: str = "doremi",
        run_name: str | None = None,
        config: dict | None = None,
        resume: bool = False,
        desc: str = "train",
        group: str | None = None,
        tensorboard: bool = False,
    ):
        """`progress`: a tqdm bar when stderr is a terminal; plain lines otherwise, or when off
        (a bar in a log file is one ever-growing line, and no output at all hides a hung run).
        wandb: the run is named `run_name` (default `desc:run_dir`), grouped by `group`, given
        the resolved `config` and resumed by the id kept in the run directory; wandb and
        tensorboard are imported only when asked for (trainer/records/metric_sinks.py)."""
        self.enabled = enabled
        self._bar = None
        self._sinks: list[MetricSink] = []
        self._desc, self._total = desc, total_steps
        self._last_time = time.perf_counter()
        if not enabled:
            return
        self.writer = JsonlWriter(Path(run_dir) / "metrics.jsonl", start_step if resume else None)
        if progress and getattr(sys.stderr, "isatty", lambda: False)():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True, file=sys.stderr, mininterval=1.0
            )
        self._sinks = open_sinks(
            Path(run_dir), wandb, tensorboard, wandb_project, run_name or f"{desc}:{run_dir}", group, config
        )

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {k: _clean(v) for k, v in row.items()}
        self.writer.write(row)
        if self._sinks:
            numbers = flatten_numbers(row)
            for sink in self._sinks:
                sink.log(numbers, row.get("step"))

    def progress(self, step: int, **postfix: Any) -> None:
        if not self.enabled:
            return
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()}
        if self._bar is None:
            fields = " ".join(f"{k} {v}" for k, v in shown.items())
            print(f"{self._desc} step {step}/{self._total} {fields}", file=sys.stderr, flush=True)
            return
        self._bar.n = step
        self._bar.set_postfix(shown, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self.writer.close()
        for sink in self._sinks:
            sink.close()
