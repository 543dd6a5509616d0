"""`doremi sweep CONFIG`: a small model trained on each of many designed mixtures, and the
per-domain validation loss along each run, for the offline methods that fit how loss depends on
the mixture (RegMix, Liu et al. 2025; Data Mixing Laws, Ye et al. 2025; `doremi/offline/fit/`).

The design (`sweep` section, `doremi/offline/fit/design.py`) is fixed by the config and the stores, so a
sweep is a list of ordinary runs that differ only in `data.domain_weights`. They are trained
stacked, many in one process with their parameters along a leading model dimension
(`trainer/stacked/`, tp = pp = dp = 1), or one by one with the ordinary trainer; both give the
same losses to rounding. Files under `sweep.run_dir`:

    sweep.json     the keys the results depend on (and their fingerprint), the design, the
                   compute spent (model FLOPs and tokens of every run and its evaluations), the
                   runs' model size and tokens per step (`proxy`)
    mixtures.csv   run, design, one column per domain: the mixture of each run
    losses.csv     run, step, one column per domain, mean, worst: validation loss at every
                   evaluation of every finished run (sweep.eval_points evenly spaced steps, the
                   last at its final step): the curves the step law of data mixing laws
                   extrapolates (`loss_curves`, doremi/methods/mixing_law/nested.py)
    final.csv      run, design, the mixture, the last evaluation's losses, mean, worst: the table
                   the fits read (one row per finished run)
    runs/<run>/    each run's ordinary run directory, when run one by one

Tables are rewritten atomically after every finished run (or chunk of stacked runs), so a sweep
killed mid-way resumes from the runs it finished (a run one by one resumes from its own
checkpoint) and ends with the same tables as an uninterrupted one. A sweep directory made under
other keys is refused with the keys named, and one whose saved design is not the one its keys
give now (the code that draws or caps it changed) with the first mixture that differs
(`checkpoint.start_over: true` moves either aside).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from data import artifact
from data.atomic import atomic_write_text
from data.progress import Countdown
from data.sampling.mixtures import SEQUENCE_SLACK
from data.sampling.pools import pool_sizes
from data.sampling.weights import resolve_weights
from data.store.store import Manifest, read_manifest
from doremi.config import ExperimentConfig
from doremi.errors import DoReMiError
from doremi.offline.fit.design import (
    Design,
    concat_designs,
    dirichlet_design,
    epoch_caps,
    grid_design,
    one_hot_design,
    smoothed_one_hot_design,
)
from doremi.outputs.fingerprint import fingerprint, stage_keys
from trainer.records import run_dir as rundir
from trainer.records.metrics import read_jsonl

SWEEP_FILE = "sweep.json"
MIXTURES_FILE = "mixtures.csv"
LOSSES_FILE = "losses.csv"
FINAL_FILE = "final.csv"

#: Keys that do not change a sweep's numbers: where it writes, how it batches the runs, what
#: fits it afterwards, the other methods' sections, and how a run checkpoints and resumes (a
#: sweep resumed with `checkpoint.every` changed, or once with `checkpoint.start_over`, is the
#: same sweep; the stores are in the keys by their fingerprint, not their path).
NOT_RESULT_KEYS = (
    "sweep.run_dir",
    "sweep.stacked",
    "sweep.chunk_size",
    "fit",
    "mixing",
    *ExperimentConfig.MOVED,
    "data.domain_weights",
    "data.store_dir",
    "data.num_proc",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.resume",
    "checkpoint.resume_changed",
    "checkpoint.start_over",
)


def sequence_caps(
    pools: Sequence[int], run_sequences: int, max_epochs: float, domains: Sequence[str], key: str
) -> np.ndarray:
    """Per-domain weight caps under which a run of `run_sequences` sequences reads no domain more
    than `max_epochs` epochs, counted as the run realises them: sequences over its sampler's
    pools (data/sampling/pools.py `pool_sizes`), with the exact sampler's slack of one
    sequence: u_i = min(1, max(max_epochs * pool_i - 1, 0) / run_sequences), the cap a main run
    applies under `data.max_epochs` (data/sampling/mixtures.py `sequence_capped`). A cap counted
    in tokens let a small domain read 2.16 epochs under `sweep.max_epochs: 2` (the pools hold
    fewer tokens than the domains). A domain whose pool cannot give one sequence within the cap
    is refused, naming `key`."""
    short = [i for i, n in enumerate(pools) if max_epochs * n <= SEQUENCE_SLACK]
    if short:
        i = short[0]
        raise DoReMiError(
            f"{key} {max_epochs:g}: domain {domains[i]!r}'s sampler pool holds {pools[i]} sequences, too few to "
            "read any within the cap"
        )
    return epoch_caps(pools, run_sequences, max_epochs, slack=SEQUENCE_SLACK)


def run_sequences(cfg: ExperimentConfig) -> int:
    """Sequences a run of `cfg` draws: train.steps x train.global_batch_size."""
    return cfg.train.steps * cfg.train.global_batch_size


def design(cfg: ExperimentConfig, manifest: Manifest) -> Design:
    """The sweep's mixtures: its designs in the configured order, each within `sequence_caps`
    of a sweep run when `sweep.max_epochs` is set."""
    s, k = cfg.sweep, len(manifest.domains)
    check_design_keys(cfg, k)
    caps = None
    if s.max_epochs is not None:
        pools = pool_sizes(cfg.data)
        caps = sequence_caps(pools, run_sequences(cfg), s.max_epochs, manifest.domain_names, "sweep.max_epochs")
    parts = []
    for name in s.designs:
        if name == "dirichlet":
            prior = resolve_weights(s.prior, manifest, "sweep.prior", cfg.budget_tokens)
            parts.append(
                dirichlet_design(
                    prior,
                    s.runs,
                    seed=s.seed,
                    concentration=(s.concentration[0], s.concentration[1]),
                    temperature=s.temperature,
                    min_weight=s.min_weight,
                    caps=caps,
                )
            )
        elif name == "grid":
            parts.append(grid_design(k, s.grid_steps, caps=caps, min_weight=s.min_weight))
        elif name == "one_hot":
            parts.append(one_hot_design(k, caps=caps))
        else:
            parts.append(smoothed_one_hot_design(k, s.one_hot_eps, caps=caps))
    out = concat_designs(*parts)
    if len(out) == 0:
        raise DoReMiError("sweep.designs: the designs give no mixture within the caps (sweep.max_epochs)")
    return out


def check_design_keys(cfg: ExperimentConfig, k: int) -> None:
    """The design keys whose range depends on the number of domains, or that the config's own
    check leaves open, refused with their key (the design functions name only their argument)."""
    s = cfg.sweep
    if not (math.isfinite(s.temperature) and s.temperature > 0):
        raise DoReMiError(f"sweep.temperature: expected a finite value > 0, got {s.temperature}")
    if "dirichlet" in s.designs and s.min_weight > 1.0 / k:
        raise DoReMiError(
            f"sweep.min_weight: expected at most 1/k = {1.0 / k:.6g} for the dirichlet design over {k} domains "
            f"(its rule renormalises after zeroing the weights below it), got {s.min_weight}"
        )


def sweep_keys(cfg: ExperimentConfig) -> dict[str, Any]:
    """The config keys a sweep's tables depend on (with the stores' fingerprint)."""
    return stage_keys(cfg, NOT_RESULT_KEYS)


def eval_every(cfg: ExperimentConfig) -> int:
    """The sweep runs' evaluation cadence, every ceil(steps / sweep.eval_points)-th step (and the
    last), whatever `train.eval_every` (the ordinary runs' cadence) says: each run logs the points
    of the step law data mixing laws fit (Ye et al. 2025 Sec. 4; doremi/methods/mixing_law/nested.py), not its final
    loss alone."""
    return max(1, math.ceil(cfg.train.steps / cfg.sweep.eval_points))


def run_config(cfg: ExperimentConfig, weights: np.ndarray, run_dir: Path) -> ExperimentConfig:
    """The ordinary run of one mixture of the sweep."""
    return replace(
        cfg,
        data=replace(cfg.data, domain_weights=[float(x) for x in weights]),
        train=replace(cfg.train, run_dir=str(run_dir), eval_every=eval_every(cfg)),
    )


def _csv(header: list[str], rows: list[list[Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def _fmt(x: float) -> str:
    return repr(float(x))


def read_table(path: Path) -> list[dict[str, str]]:
    """A sweep table as rows of strings by column ([] when it does not exist yet)."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def design_change(saved: Any, now: list[dict[str, Any]], domains: Sequence[str]) -> str | None:
    """What differs between the design a sweep directory saved (sweep.json's `design`) and the
    one computed now, as a few words naming the first mixture that differs; None when they are
    the same, or when nothing was saved to compare."""
    if saved is None:
        return None
    now = json.loads(json.dumps(now))  # as sweep.json holds it
    if not isinstance(saved, list) or not all(isinstance(row, dict) for row in saved):
        return "its sweep.json's 'design' is not a list of mixtures"
    differ = [i for i, (a, b) in enumerate(zip(saved, now)) if a != b]
    if not differ and len(saved) == len(now):
        return None
    what = f"its saved design differs from the one these keys give now ({len(saved)} mixtures saved, {len(now)} now"
    if not differ:
        return what + ")"
    i = differ[0]
    a, b = saved[i], now[i]
    if a.get("weights") != b.get("weights") and len(a.get("weights") or []) == len(b["weights"]) == len(domains):
        j = next(j for j, (x, y) in enumerate(zip(a["weights"], b["weights"])) if x != y)
        first = f"{domains[j]} {a['weights'][j]!r} saved, {b['weights'][j]!r} now"
    else:
        first = f"{a.get('design')} {a.get('params')} saved, {b['design']} {b['params']} now"
    return f"{what}; {len(differ)} differ, the first run {i}: {first})"


class Sweep:
    """One sweep directory: its design, its finished runs, and the tables written from them."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.root = Path(cfg.sweep.run_dir)
        self.manifest = read_manifest(cfg.data.store_dir)
        self.domains = self.manifest.domain_names
        self.design = design(cfg, self.manifest)
        self.keys = sweep_keys(cfg)
        self.fp = fingerprint(self.keys)
        self.evals: dict[int, list[tuple[int, list[float]]]] = {}

    # -- the directory -----------------------------------------------------------------------
    def open(self) -> None:
        """Start the directory, or check that the one there was made under the same keys and
        holds the same design: the keys fix the design only as long as the code that draws it
        (and caps it) is unchanged, and a sweep resumed under another design would mix two."""
        path = self.root / SWEEP_FILE
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("fingerprint") != self.fp:
                why = f"a sweep made under other keys is there: {rundir.changed_keys(saved.get('keys', {}), self.keys)}"
            else:
                why = design_change(saved.get("design"), self.design.rows(), self.domains)
            if why is not None:
                if self.cfg.checkpoint.start_over:
                    moved = rundir.move_aside(self.root)
                    print(f"{self.root}: checkpoint.start_over: the previous sweep was moved to {moved}", flush=True)
                else:
                    raise DoReMiError(f"{self.root}: {why} (checkpoint.start_over: true moves it aside)")
        self.root.mkdir(parents=True, exist_ok=True)
        self._read_losses()
        self._write()

    def _read_losses(self) -> None:
        for row in read_table(self.root / LOSSES_FILE):
            run = int(row["run"])
            self.evals.setdefault(run, []).append((int(row["step"]), [float(row[d]) for d in self.domains]))

    @property
    def todo(self) -> list[int]:
        return [i for i in range(len(self.design)) if i not in self.evals]

    def record(self, finished: dict[int, list[tuple[int, list[float]]]]) -> None:
        """Finished runs' evaluations, written into the tables at once: a stacked chunk's runs
        together, so that a kill never leaves part of a chunk recorded (its rest would then be
        trained in another chunk, whose batched arithmetic rounds differently)."""
        for run, evals in finished.items():
            if not evals or evals[-1][0] != self.cfg.train.steps:
                raise DoReMiError(f"sweep run {run}: no evaluation at its last step {self.cfg.train.steps}")
        self.evals.update(finished)
        self._write()

    def _write(self) -> None:
        d, w = self.domains, self.design.weights
        atomic_write_text(
            self.root / MIXTURES_FILE,
            _csv(["run", "design", *d], [[i, n, *map(_fmt, w[i])] for i, n in enumerate(self.design.names)]),
        )
        runs = sorted(self.evals)
        atomic_write_text(
            self.root / LOSSES_FILE,
            _csv(
                ["run", "step", *d, "mean", "worst"],
                [
                    [i, step, *map(_fmt, losses), _fmt(np.mean(losses)), _fmt(np.max(losses))]
                    for i in runs
                    for step, losses in self.evals[i]
                ],
            ),
        )
        atomic_write_text(
            self.root / FINAL_FILE,
            _csv(
                ["run", "design", *(f"w:{x}" for x in d), *d, "mean", "worst"],
                [
                    [
                        i,
                        self.design.names[i],
                        *map(_fmt, w[i]),
                        *map(_fmt, self.evals[i][-1][1]),
                        _fmt(np.mean(self.evals[i][-1][1])),
                        _fmt(np.max(self.evals[i][-1][1])),
                    ]
                    for i in runs
                ],
            ),
        )
        # sweep.json last, with the sweep's artifact header: the tables' hashes (docs/design.md 6b)
        header = artifact.Header(
            "sweep",
            status="running" if self.todo else "finished",
            fingerprint=self.fp,
            step=len(self.evals),
            steps=len(self.design),
            sources=rundir.sources(self.cfg)[:1],
            files=artifact.hash_files(self.root, [MIXTURES_FILE, LOSSES_FILE, FINAL_FILE]),
        )
        doc = {
            "fingerprint": self.fp,
            "keys": self.keys,
            "domains": d,
            "design": self.design.rows(),
            "finished": sorted(self.evals),
            "compute": self.compute(),
            "proxy": self.proxy(),
        }
        artifact.write(self.root / SWEEP_FILE, header, doc)

    def proxy(self) -> dict[str, int]:
        """The runs' model size (non-embedding parameters) and tokens per step: where the step and
        size laws of data mixing laws start from (doremi/methods/mixing_law/nested.py)."""
        from trainer.model.flops import non_embedding_params

        return {
            "params": non_embedding_params(self.cfg.model),
            "tokens_per_step": self.cfg.train.global_batch_size * self.cfg.data.seq_len,
        }

    def compute(self) -> dict[str, float]:
        """Model FLOPs and tokens of the finished runs: training (flops_per_token per trained
        token, forward and backward) and their evaluations (a forward: a third of it)."""
        from trainer.model.flops import flops_per_token

        t = self.cfg.train
        fpt = flops_per_token(self.cfg.model, self.cfg.data.seq_len)
        train_tokens = t.steps * t.global_batch_size * self.cfg.data.seq_len * len(self.evals)
        evals = sum(len(e) for e in self.evals.values())
        eval_tokens = evals * len(self.domains) * t.eval_sequences * self.cfg.data.seq_len
        return {
            "runs": len(self.evals),
            "train_tokens": train_tokens,
            "train_flops": float(fpt * train_tokens),
            "eval_tokens": eval_tokens,
            "eval_flops": fpt / 3 * eval_tokens,
            "flops": float(fpt * train_tokens) + fpt / 3 * eval_tokens,
        }

    def named(self, runs: list[int]) -> str:
        """`run 3 (dirichlet)`, or `runs 0-15 (dirichlet, grid)` for a stacked chunk."""
        kinds = ", ".join(dict.fromkeys(self.design.names[i] for i in runs))
        which = f"run {runs[0]}" if len(runs) == 1 else f"runs {runs[0]}-{runs[-1]}"
        return f"{which} ({kinds})"

    # -- training -------------------------------------------------------------------------------
    def run_one(self, i: int) -> None:
        """Run `i` with the ordinary trainer in `runs/<i>/` (a killed one resumes there)."""
        from trainer.run.loop import Trainer

        run_dir = self.root / "runs" / f"{i:04d}"
        cfg = run_config(self.cfg, self.design.weights[i], run_dir)
        Trainer(
            cfg, desc=f"sweep {i + 1}/{len(self.design)}", result_ignore=NOT_RESULT_KEYS, evaluation="sweep_run"
        ).fit()
        rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in r]
        self.record({i: [(r["step"], [r["val_loss"][d] for d in self.domains]) for r in rows]})

    def run_stacked(self, runs: list[int]) -> None:
        """`runs` trained at once (`trainer/stacked/`); a killed chunk is trained again."""
        from trainer.stacked.train import train_stacked

        label = f"sweep {self.named(runs)}"
        result = train_stacked(self.cfg, self.design.weights[runs], eval_every=eval_every(self.cfg), label=label)
        self.record(
            {i: [(step, [float(x) for x in losses[j]]) for step, losses in result.evals] for j, i in enumerate(runs)}
        )

    def run(self) -> Path:
        """The runs not yet finished, a progress line on stderr after each run or stacked chunk
        (data/progress.py): its place in the sweep, mixture, time spent and left."""
        self.open()
        todo = self.todo
        s = self.cfg.sweep
        n = len(self.design)
        countdown = Countdown("sweep", n, first=n - len(todo))
        size = s.chunk_size if s.stacked else 1
        for start in range(0, len(todo), size):
            chunk = todo[start : start + size]
            if s.stacked:
                self.run_stacked(chunk)
            else:
                self.run_one(chunk[0])
            countdown.done(n - len(todo) + start + len(chunk), self.named(chunk))
        return self.root


def run_sweep(cfg: ExperimentConfig) -> Path:
    """Train every run of the sweep not yet finished; returns the sweep directory. The
    directory's lock is held for the sweep's life (`trainer.records.run_dir.locked`)."""
    if cfg.sweep.stacked and (cfg.parallelism.tp, cfg.parallelism.pp, cfg.parallelism.dp) != (1, 1, 1):
        raise DoReMiError(
            "sweep.stacked: stacked runs train at tp = pp = dp = 1 (many small models in one process); "
            f"got tp={cfg.parallelism.tp}, pp={cfg.parallelism.pp}, dp={cfg.parallelism.dp} "
            "(or set sweep.stacked: false)"
        )
    sweep = Sweep(cfg)  # the design and its checks, before anything is written
    root = Path(cfg.sweep.run_dir)
    if not (root / SWEEP_FILE).is_file():  # one from before headers is the sweep's own directory
        ours = {SWEEP_FILE, MIXTURES_FILE, LOSSES_FILE, FINAL_FILE, "runs"}
        artifact.check_output_dir(root, "sweep", "sweep.run_dir", ours.__contains__)
    with rundir.locked(cfg.sweep.run_dir):
        return sweep.run()


def final_table(root: str | Path) -> tuple[list[str], np.ndarray, dict[str, np.ndarray]]:
    """(domains, mixtures [n, k], {"mean", "worst", <domain>: final losses [n]}) of a sweep's
    finished runs, read from `final.csv`. A table that is not a sweep's (unreadable, a column
    missing, a value not a number) or that holds a non-finite loss is one error naming the file
    and the run: a fit must not see a diverged run's loss, nor silently skip it."""
    root = Path(root)
    meta = root / SWEEP_FILE
    if not meta.is_file():
        raise DoReMiError(f"{meta}: not a sweep directory (no {SWEEP_FILE})")
    try:
        domains = json.loads(meta.read_text())["domains"]
    except (ValueError, KeyError, TypeError) as e:
        raise DoReMiError(f"{meta}: expected a sweep's JSON with its 'domains' ({type(e).__name__}: {e})") from None
    path = root / FINAL_FILE
    rows = read_table(path)
    if not rows:
        raise DoReMiError(f"{path}: no finished run yet")
    columns = ["run", *(f"w:{d}" for d in domains), *domains, "mean", "worst"]
    missing = [c for c in columns if c not in rows[0]]
    if missing:
        raise DoReMiError(f"{path}: expected the columns of the sweep's domains {domains}; missing {missing}")
    try:
        table = {c: np.array([float(r[c]) for r in rows]) for c in columns}
    except (TypeError, ValueError) as e:
        raise DoReMiError(f"{path}: expected numbers in every column ({e})") from None
    for key in [*domains, "mean", "worst"]:
        bad = np.flatnonzero(~np.isfinite(table[key]))
        if bad.size:
            run = rows[int(bad[0])]["run"]
            raise DoReMiError(
                f"{path}: run {run}'s final {key} loss is {table[key][bad[0]]} (the run diverged); "
                "a fit needs every run's loss: lower train.lr and sweep again"
            )
    weights = np.stack([table[f"w:{d}"] for d in domains], axis=1)
    return domains, weights, {key: table[key] for key in [*domains, "mean", "worst"]}


def loss_curves(root: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(steps [p], per-domain validation losses [n, p, m]) of the finished runs in `final.csv`'s
    order (`final_table`'s), read from `losses.csv`: the curves the step law fits. Every run must
    have been evaluated at the same steps, with finite losses; else one error naming the file."""
    root = Path(root)
    runs = [r["run"] for r in read_table(root / FINAL_FILE)]
    domains = json.loads((root / SWEEP_FILE).read_text())["domains"]
    path = root / LOSSES_FILE
    curves: dict[int, list[tuple[int, list[float]]]] = {}
    try:
        for row in read_table(path):
            curves.setdefault(int(row["run"]), []).append((int(row["step"]), [float(row[d]) for d in domains]))
    except (KeyError, TypeError, ValueError) as e:
        raise DoReMiError(f"{path}: expected run, step and the domains {domains} as numbers ({e})") from None
    wanted = [int(r) for r in runs]
    missing = [r for r in wanted if r not in curves]
    if missing:
        raise DoReMiError(f"{path}: no evaluations of run(s) {missing}")
    steps = [s for s, _ in sorted(curves[wanted[0]])]
    for r in wanted:
        if [s for s, _ in sorted(curves[r])] != steps:
            raise DoReMiError(f"{path}: run {r} was evaluated at other steps than run {wanted[0]} ({steps})")
    losses = np.array([[v for _, v in sorted(curves[r])] for r in wanted], dtype=np.float64)
    if not np.all(np.isfinite(losses)):
        raise DoReMiError(f"{path}: a non-finite loss along a run (it diverged); the step law needs every point")
    return np.array(steps, dtype=np.int64), losses
