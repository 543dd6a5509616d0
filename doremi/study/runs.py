"""A study's run directories, read and paired by seed (docs/design.md section 4e).

Every calibration or study run is an ordinary `doremi train` (or train-reference, train-proxy)
run directory named `<arm>-seed<k>` (`uniform-seed1`, `doremi-seed1`, `reference-seed1`),
anywhere under a root. A run's result is its last evaluation row in metrics.jsonl: the
per-domain test loss (`test_loss`, the verdict's half of the validation documents) where the
row has it, else `val_loss` (under `data.validation_split: dev_test` a main run's `val_loss` is
the test half, data/store/validation_split.py); its throughput is the median `tokens_per_s` of its training rows
after the first (which includes compilation). A run that stopped before its configured
`train.steps` is unfinished: a study never pools it silently.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from doremi.errors import DoReMiError
from doremi.reports.ledger import train_seconds
from trainer.records.metrics import read_jsonl
from trainer.records.pairing import PAIRING_FILE, check_paired, read_pairing

RUN_NAME = re.compile(r"^(?P<arm>[A-Za-z0-9_.]+)-seed(?P<seed>\d+)$")
#: The loss keys of an evaluation row, the verdict's first.
LOSS_KEYS = ("test_loss", "val_loss")


class StudyError(DoReMiError):
    """A study's input cannot give a result (a run unfinished, a partner missing, no runs): one
    line naming the runs, and what to do."""


@dataclass(frozen=True)
class RunResult:
    """One run's final per-domain loss (at `final_step`, from `loss_key`) and what the ledger
    and the gate read of it."""

    name: str
    arm: str
    seed: int
    path: Path
    domains: tuple[str, ...]
    final: tuple[float, ...]
    final_step: int
    loss_key: str
    last_step: int
    planned: int | None
    seeds: tuple[int, int] | None
    tokens_per_s: float | None
    train_seconds: float | None
    curve: tuple[tuple[int, float], ...] = field(default=())
    #: The documents `final` is over: `test` (data.validation_split dev_test: a main run
    #: evaluates the test half) or `validation` (the whole split).
    split: str = "validation"
    config: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def endpoint(self) -> float:
        """The mean loss over domains at the final evaluation."""
        return sum(self.final) / len(self.final)

    @property
    def unfinished(self) -> bool:
        return self.planned is None or self.final_step < self.planned

    def describe_unfinished(self) -> str:
        if self.planned is None:
            return f"{self.name}: no train.steps in its config.yaml; cannot tell whether it finished"
        return f"{self.name}: unfinished (final evaluation at step {self.final_step} of {self.planned})"


def throughput(rows: Iterable[Mapping[str, Any]]) -> float | None:
    """Median tokens/s of the training rows after the first (the first includes compilation);
    the only row's when there is one; None without any."""
    rates = [float(r["tokens_per_s"]) for r in rows if isinstance(r.get("tokens_per_s"), (int, float))]
    if not rates:
        return None
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


def read_run(path: str | Path, name: str | None = None) -> RunResult:
    """Read one run directory (metrics.jsonl, config.yaml)."""
    import yaml

    run = Path(path)
    name = name or run.name
    m = RUN_NAME.match(name)
    if m is None:
        raise StudyError(f"{run}: run directory name {name!r} is not <arm>-seed<k>")
    if not (run / "metrics.jsonl").is_file():
        raise StudyError(f"{run}: no metrics.jsonl (expected a run directory)")
    rows = read_jsonl(run / "metrics.jsonl")
    cfg_path = run / "config.yaml"
    cfg = (yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.is_file() else {}
    evals = [r for r in rows if any(isinstance(r.get(k), dict) for k in LOSS_KEYS)]
    if not evals:
        raise StudyError(f"{run}: no evaluation rows in metrics.jsonl (test_loss or val_loss)")
    last = evals[-1]
    key = next(k for k in LOSS_KEYS if isinstance(last.get(k), dict))
    losses = last[key]
    missing = [d for d, v in losses.items() if v is None]
    if missing:
        raise StudyError(f"{run}: step {last['step']}: no {key} for {', '.join(missing)}")
    diverged = [d for d, v in losses.items() if not math.isfinite(float(v))]
    if diverged:
        raise StudyError(
            f"{run}: step {last['step']}: {key} is not finite for {', '.join(diverged)}; a diverged run has no "
            f"result to pair: rerun it or leave it out of the sources"
        )
    train, data = cfg.get("train", {}), cfg.get("data", {})
    steps = train.get("steps")
    seeds = (train.get("seed"), data.get("seed"))
    per_step = int(train.get("global_batch_size", 0)) * int(data.get("seq_len", 0))
    curve = tuple(
        (int(r["step"]), sum(r[key].values()) / len(r[key]))
        for r in evals
        if isinstance(r.get(key), dict) and None not in r[key].values()
    )
    return RunResult(
        name=name,
        arm=m["arm"],
        seed=int(m["seed"]),
        path=run,
        domains=tuple(losses),
        final=tuple(float(v) for v in losses.values()),
        final_step=int(last["step"]),
        loss_key=key,
        last_step=max(int(r["step"]) for r in rows if "step" in r),
        planned=int(steps) if isinstance(steps, int) else None,
        seeds=(int(seeds[0]), int(seeds[1])) if None not in seeds else None,
        tokens_per_s=throughput(r for r in rows if "loss" in r),
        train_seconds=train_seconds(rows, per_step) if per_step else None,
        curve=curve,
        split="test" if key == "test_loss" or data.get("validation_split") == "dev_test" else "validation",
        config=cfg,
    )


def find_run_dirs(root: str | Path) -> dict[tuple[str, int], Path]:
    """(arm or stage, seed) -> directory, for every `<name>-seed<k>` directory with a
    metrics.jsonl under root (at any depth: an unpacked archive may add a folder); two
    directories of one name refuse."""
    root = Path(root)
    if not root.is_dir():
        raise StudyError(f"{root}: not a directory")
    out: dict[tuple[str, int], Path] = {}
    for metrics in sorted(root.rglob("metrics.jsonl")):
        m = RUN_NAME.match(metrics.parent.name)
        if m is None:
            continue
        key = (m["arm"], int(m["seed"]))
        if key in out:
            raise StudyError(f"{root}: two run directories for {metrics.parent.name}: {out[key]} and {metrics.parent}")
        out[key] = metrics.parent
    if not out:
        raise StudyError(f"{root}: no run directories named <arm>-seed<k> with a metrics.jsonl")
    return out


def find_runs(root: str | Path, arms: Iterable[str]) -> dict[tuple[str, int], RunResult]:
    """(arm, seed) -> run, for the runs of `arms` under root (`find_run_dirs`)."""
    wanted = set(arms)
    return {key: read_run(path) for key, path in find_run_dirs(root).items() if key[0] in wanted}


@dataclass(frozen=True)
class Pairs:
    """An arm against the baseline, paired by seed; `notes` name the seeds left out and why."""

    arm: str
    baseline: str
    seeds: tuple[int, ...]
    runs: tuple[RunResult, ...]
    bases: tuple[RunResult, ...]
    notes: tuple[str, ...] = ()

    @property
    def diffs(self) -> list[float]:
        return [a.endpoint - b.endpoint for a, b in zip(self.runs, self.bases)]


def measured_pairing_problems(a: Path, b: Path) -> list[str]:
    """What the runs' own `pairing.json` records (trainer/records/pairing.py) say keeps them from being a
    pair: another initialisation or other per-domain streams. Runs written before the record
    existed have none and are judged by their seeds alone."""
    if not ((a / PAIRING_FILE).is_file() and (b / PAIRING_FILE).is_file()):
        return []
    return check_paired(read_pairing(a), read_pairing(b))


def pair_runs(runs: Mapping[tuple[str, int], RunResult], arm: str, baseline: str, strict: bool = True) -> Pairs:
    """The seeds with a finished run of both `arm` and `baseline`. With `strict` an unfinished
    run or a seed whose partner is missing refuses (StudyError naming them); otherwise they
    are left out with a note. Partners must share train.seed and data.seed and their domains
    (always checked: a pair that is not a pair is an error)."""
    seeds = sorted({s for (a, s) in runs if a in (arm, baseline)})
    problems, kept, a_runs, b_runs = [], [], [], []
    for s in seeds:
        a, b = runs.get((arm, s)), runs.get((baseline, s))
        if a is None or b is None:
            have, lack = (a or b), f"{arm if a is None else baseline}-seed{s}"
            problems.append(f"{have.name}: its partner {lack} is missing")  # type: ignore[union-attr]
            continue
        bad = [r.describe_unfinished() for r in (a, b) if r.unfinished]
        if bad:
            problems += bad
            continue
        if a.seeds is not None and b.seeds is not None and a.seeds != b.seeds:
            raise StudyError(f"{a.name} and {b.name} are not a pair: (train.seed, data.seed) {a.seeds} vs {b.seeds}")
        if a.domains != b.domains:
            raise StudyError(
                f"{a.name} and {b.name}: domains differ ({', '.join(a.domains)} vs {', '.join(b.domains)})"
            )
        unpaired = measured_pairing_problems(a.path, b.path)
        if unpaired:
            raise StudyError(f"{a.name} and {b.name} are not a pair: {'; '.join(unpaired)}")
        kept.append(s)
        a_runs.append(a)
        b_runs.append(b)
    if strict and problems:
        raise StudyError("; ".join(problems))
    if not kept:
        raise StudyError(
            f"{arm} against {baseline}: no finished pair" + (f" ({'; '.join(problems)})" if problems else "")
        )
    return Pairs(arm, baseline, tuple(kept), tuple(a_runs), tuple(b_runs), tuple(problems))


INCOMPLETE = "incomplete"


def seeds_for(pairs: int) -> tuple[int, ...]:
    """The seeds a pre-registered study judges on: 1 to the calibration gate's pairs."""
    return tuple(range(1, pairs + 1))


def lacking(runs: Mapping[tuple[str, int], RunResult], names: Sequence[str], seeds: Sequence[int]) -> list[str]:
    """For each seed, the runs of `names` missing or unfinished."""
    out = []
    for s in seeds:
        for name in names:
            r = runs.get((name, s))
            out += [f"{name}-seed{s} missing"] if r is None else [r.describe_unfinished()] if r.unfinished else []
    return out


@dataclass(frozen=True)
class Withheld:
    """An arm without the pre-registered pairs: what it has and what it lacks. It gets no
    verdict: judged on fewer pairs than the gate decided, a study would report the power it
    said it would not rely on (`doremi study summarize` and `compare-methods` alike)."""

    arm: str
    pairs: int
    need: int
    lacks: tuple[str, ...]

    def row(self, columns: int) -> list[str]:
        return [self.arm, f"{self.pairs} of {self.need}", *[""] * 3, INCOMPLETE, *[""] * (columns - 6)]

    def line(self) -> str:
        return f"{self.arm}: {INCOMPLETE}, {self.pairs} of {self.need} pairs ({'; '.join(self.lacks)}); no verdict"


def withheld(
    runs: Mapping[tuple[str, int], RunResult], arm: str, baseline: str, seeds: Sequence[int]
) -> Withheld | None:
    """`arm` withheld against `baseline` when a run of either is missing or unfinished at one of
    `seeds`; None when every pair is there."""
    lacks = lacking(runs, (arm, baseline), seeds)
    if not lacks:
        return None
    have = sum(1 for s in seeds if all((n, s) in runs and not runs[(n, s)].unfinished for n in (arm, baseline)))
    return Withheld(arm, have, len(seeds), tuple(lacks))
