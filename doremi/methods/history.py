"""The proxy's per-step domain-weight log (`domain_weights.jsonl`) and its average.

One JSON object per step: `step`, `domains`, `weights` (the method's domain weights: DoReMi's
alpha_t), `tokens` (per-domain token counts of the global batch) and the method's own per-domain
signals (DoReMi: `excess` lambda_t, `proxy_loss`, `ref_loss`; a method that draws at random:
`sampling`, the probabilities the step was drawn with, and `sequences`, what it drew). Lines are flushed as written, so a crash loses at most the line being written;
a torn last line (no newline) is ignored on read and dropped on resume.

The tuned weights are the mean of alpha_t over t = 1..T (Xie et al. 2023, Algorithm 1, output
step); `data.sampling.weights_file` writes them with their provenance.
Only one process (global rank 0) should own a `WeightHistory`.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.atomic import atomic_write_text
from data.errors import DataError, UserError
from data.sampling.weights_file import per_domain_list, read_weights_file, write_weights_file

HISTORY_FILE = "domain_weights.jsonl"
#: Per-domain fields every record holds, and those checked and converted when present.
REQUIRED_FIELDS = ("weights", "tokens")
PER_DOMAIN_FIELDS = ("weights", "excess", "proxy_loss", "ref_loss", "tokens", "loss", "sampling", "sequences")
INTEGER_FIELDS = ("tokens", "sequences")


class HistoryError(UserError, ValueError):
    """A malformed or inconsistent weight history or weights file (one line: file, what, got)."""


def _as_list(name: str, values: Any, k: int) -> list:
    values = per_domain_list(values, k, name, HistoryError)
    if name in INTEGER_FIELDS:
        return [int(v) for v in values]
    return [float(v) for v in values]


def _history_path(run_dir: str | os.PathLike) -> Path:
    p = Path(run_dir)
    return p if p.suffix == ".jsonl" else p / HISTORY_FILE


def _parse(path: Path, text: str) -> list[dict]:
    """Parse complete lines; the final line without a newline is a torn write and is skipped."""
    lines = text.split("\n")
    complete = lines[:-1]
    records = []
    for n, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise HistoryError(f"{path}:{n}: expected a JSON object per line, got {line[:60]!r} ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise HistoryError(f"{path}:{n}: expected an object with an integer 'step', got {line[:60]!r}")
        records.append(rec)
    return records


def read_history(run_dir: str | os.PathLike) -> list[dict]:
    """All complete records of `run_dir/domain_weights.jsonl` (or of a given .jsonl path)."""
    path = _history_path(run_dir)
    if not path.is_file():
        raise HistoryError(f"{path}: weight history not found (expected a proxy run directory)")
    return _parse(path, path.read_text())


class WeightHistory:
    """Appends one line per step to `run_dir/domain_weights.jsonl`.

    `resume_step` is the last step the run has already done (0 for a fresh run): existing lines
    with step > resume_step, and a torn last line, are dropped by an atomic rewrite, so that a
    resumed run's history equals the uninterrupted run's. All records must name the same
    domains: `domains` when given, else those of the first record kept or appended.
    """

    def __init__(self, run_dir: str | os.PathLike, resume_step: int = 0, domains: Sequence[str] | None = None):
        self.path = _history_path(run_dir)
        self.domains = list(domains) if domains is not None else None
        if self.domains is not None and not self.domains:
            raise HistoryError(f"{self.path}: expected at least one domain name, got none")
        self.last_step = self._truncate(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def _check_domains(self, step: int, domains: Any) -> None:
        if self.domains is None:
            if not isinstance(domains, list) or not domains:
                raise HistoryError(f"{self.path}: step {step}: expected a non-empty list 'domains', got {domains!r}")
            self.domains = [str(d) for d in domains]
        elif domains != self.domains:
            raise HistoryError(f"{self.path}: step {step} has domains {domains}, expected {self.domains}")

    def _truncate(self, resume_step: int) -> int:
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return 0
        text = self.path.read_text()
        kept = [r for r in _parse(self.path, text) if r["step"] <= resume_step]
        for r in kept:
            self._check_domains(r["step"], r.get("domains"))
        new_text = "".join(json.dumps(r) + "\n" for r in kept)
        if new_text != text:
            atomic_write_text(self.path, new_text)
        return kept[-1]["step"] if kept else 0

    def append(self, record: Mapping[str, Any]) -> dict:
        """Write one step's record and flush it.

        Required keys: `step` (after the last one logged), `weights` and `tokens` (one value per
        domain: tensors, arrays or lists) and `domains` (optional when given to the
        constructor). The other `PER_DOMAIN_FIELDS` are checked and converted when present;
        other keys are written as they are.
        """
        try:
            step = operator.index(record.get("step"))
        except TypeError:
            step = None
        if step is None or step <= self.last_step:
            raise HistoryError(
                f"{self.path}: step {record.get('step')!r} is not an integer "
                f"after the last logged step {self.last_step}"
            )
        self._check_domains(step, list(record.get("domains", self.domains or [])))
        k = len(self.domains)
        rec: dict[str, Any] = {**record, "step": step, "domains": self.domains}
        for name in PER_DOMAIN_FIELDS:
            if name not in record:
                if name in REQUIRED_FIELDS:
                    raise HistoryError(f"{self.path}: step {step}: missing per-domain field {name!r}")
                continue
            rec[name] = _as_list(name, record[name], k)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        self.last_step = step
        return rec

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> WeightHistory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def average_weights(history: Sequence[Mapping[str, Any]], from_step: int = 1) -> np.ndarray:
    """Mean of alpha_t over the records with step >= from_step (float64, renormalised to sum 1).

    The renormalisation only removes rounding: each alpha_t is a distribution.
    """
    rows = [r.get("weights") for r in history if r["step"] >= from_step]
    if any(not isinstance(w, list) for w in rows):
        raise HistoryError("average_weights: expected a list 'weights' in every record")
    if not rows:
        last = history[-1]["step"] if history else None
        raise HistoryError(f"average_weights: no step >= {from_step} in the history (last step {last})")
    lengths = {len(w) for w in rows}
    if len(lengths) != 1:
        raise HistoryError(f"average_weights: expected one number of domains, got {sorted(lengths)}")
    mean = np.asarray(rows, dtype=np.float64).mean(axis=0)
    if not np.all(np.isfinite(mean)):
        raise HistoryError(f"average_weights: expected finite weights, got {mean.tolist()}")
    return mean / mean.sum()


def write_weights_json(
    path: str | os.PathLike, domains: Sequence[str], weights: Any, provenance: Mapping[str, Any]
) -> Path:
    """`data.sampling.weights_file.write_weights_file` under the name, and with the error class
    (HistoryError), that the package's API has always given it."""
    try:
        return write_weights_file(path, domains, weights, provenance)
    except DataError as e:
        raise HistoryError(str(e)) from None


def read_weights_json(path: str | os.PathLike) -> dict[str, Any]:
    """`data.sampling.weights_file.read_weights_file` under the package API's name and error class."""
    try:
        return read_weights_file(path)
    except DataError as e:
        raise HistoryError(str(e)) from None
