"""Aioli: online estimation of a linear mixing law (Chen, Hu, Lourie, Cho and Re 2025, "Aioli: A
Unified Optimization Framework for Language Model Data Mixing", ICLR; Algorithms 1 and 2).

Linear Mixing Optimization models the per-domain validation losses L_t [k] under the mixture
p_t as L_{t+1} = L_t - A_t p_t. Aioli splits the run into rounds; each round r

1. LearnParams (Algorithm 2): `sweeps` passes over the k domains, each pass one probe interval
   of `delta` steps per domain j, drawn with the smoothed one-hot mixture
       q_j = (1 - eps) e_j + eps / (k - 1) (1 - e_j)                     (eps = `one_hot_eps`)
   With L^- and L^+ the validation losses at the interval's two ends (the end of one interval is
   the start of the next), the loss drops accumulate into
       D[:, j] += L^- - L^+,          D /= sweeps,
   and the mixing-law parameters solve D[i, j] = sum_m q_j[m] A[i, m], i.e. A^T = Q^{-1} D^T with
   Q's rows the q_j (Q = I when eps = 0).
2. Normalisation and smoothing: A <- (A - min(A, 0)) / sum(A - min(A, 0)) (all entries >= 0,
   summing to 1), then Abar_r = ema Abar_{r-1} + (1 - ema) A (Abar_1 = A).
3. The exponentiated-gradient step of Algorithm 1 (`variant: paper`):
       p_r[j] proportional to p_{r-1}[j] exp(eta sum_i Abar_r[i, j]),     p_0 uniform,
   or, as the authors' code runs it (`variant: authors`), from the uniform prior every round:
       p_r[j] proportional to exp(eta sum_i Abar_r[i, j]),
   and the rest of the round trains on p_r.

Round length is ceil(steps / rounds) (or `round_steps`); the last round may be shorter, and a
round too short to hold all its probes plus one step on p trains on p throughout. Validation losses are
asked for exactly at the probe intervals' ends and at each probing round's start (t = 0 for the
first), so the schedule depends only on the config, the run's steps and k; the probe order within
a sweep on the run's seed too (`shuffle`).

Variants. `variant: authors` (the default) is the released code (github HazyResearch/aioli at
commit a236112, `trainer/aioli_trainer.py`; LearnParams is its `learn_params_subroutine`) as
every released script runs it (`scripts/*/aioli/run.sh`: all set `--ema` and
`--aioli_normalize_A`); `variant: paper` is Algorithm 1 as written. They differ in step 3:
- authors: with `--ema` set their code restarts each round from the uniform prior,
  p_r proportional to exp(eta sum_i Abar_r[i, :]) (lines 231 and 334-340), instead of
  multiplying onto p_{r-1} (paper; their code does that only without `--ema`, lines 342-345).
- authors: `diagonal` applies only with one_hot_eps > 0 (their `--aioli_diagonal` with
  one_hot_factor != 1, line 181; with exact one-hot probes they keep the full D, line 166);
  paper: `diagonal` always keeps the diagonal.
Shared with their code: the smoothing puts (1 - one_hot_factor) / (k - 1) on the other domains
(one_hot_eps = 1 - one_hot_factor, lines 125-126), the drops are averaged over the sweeps
(line 164) and solved against the probe matrix (lines 166-179), the normalisation is their
`--aioli_normalize_A` (lines 324-331), `ema` weights the old average as theirs does (line 338),
each sweep's probe order is a fresh random permutation (line 123), and validation runs at each
round's start and after every probe interval (lines 310 and 154). Options: `diagonal` (their
`--aioli_diagonal`), `normalize: false` (their flag unset), `shuffle: false` (probes in domain
order). Not reproduced: their code runs LearnParams at the start of every round, the last
(possibly short) one included, where a round here too short for its probes trains on p.

Cost (issue 35, point 4). A probing round validates k sweeps + 1 times; each pass forwards
`eval_sequences` sequences of each domain (a third of a training token's FLOPs each). The
default `eval_sequences: null` takes the largest number, at least 1, that keeps the run's
validation FLOPs within `eval_budget` (10%) of its training FLOPs:

    n = max(1, floor(eval_budget x 3 x steps x global_batch_size / (passes x k)))

(the quickstart's 160 steps of 32 sequences, 6 domains, 4 rounds of one sweep: 28 passes of 9
sequences per domain, 9.8%). The authors' schedule is far above that: every pass evaluates the
whole validation split of each domain (`get_tokenized_val_dataset`, no subset), and their
7-domain run (`scripts/full/aioli/run.sh`: 2 sweeps, rounds of 200 steps of 8 x 2048 tokens)
makes 15 passes a round, so its validation exceeds 10% of its training as soon as the split
holds more than 65,536 tokens (32 sequences of 2048 over all 7 domains); on this trainer the
1B bench measured a pass every 2nd step at five times the training time (issue 35). Their
schedule is `eval_sequences: 0` (the whole split) with `sweeps`/`delta`/`round_steps` of the
script (the 7-domain one: `{eval_sequences: 0, sweeps: 2, delta: 10, round_steps: 200,
one_hot_eps: 0.25, eta: 1}`); the default schedule (20 rounds, 4 sweeps of 4 steps, their
2-domain script's `--lp_rounds 4 --lp_steps 4` over 20 rounds) is theirs, only the validation
subset is budgeted, and the update is the same either way. At the default on 7 domains and
10,000 steps of 64 sequences: 580 passes of 47 sequences per domain, 9.94% of the training FLOPs
by the ledger's formulas (tests/test_aioli_authors.py).
The ledger (doremi/reports/ledger.py) counts every pass's tokens (`method_evals`) as validation FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from doremi.methods.aioli.config import AioliConfig
from doremi.methods.log import MethodLog
from trainer.config.tools import ConfigError
from trainer.run.hooks import MethodBase, MethodContext, Needs, StepSignals


def probe_mixture(k: int, domain: int, eps: float) -> np.ndarray:
    """The smoothed one-hot mixture q_j = (1 - eps) e_j + eps/(k-1) (1 - e_j) of Algorithm 2
    (the authors' `one_hot_factor` = 1 - eps); [1] when k = 1."""
    if k == 1:
        return np.ones(1, dtype=np.float64)
    q = np.full(k, eps / (k - 1), dtype=np.float64)
    q[domain] = 1.0 - eps
    return q


def probe_matrix(k: int, eps: float) -> np.ndarray:
    """Q [k, k]: row j is the probe mixture of domain j."""
    return np.stack([probe_mixture(k, j, eps) for j in range(k)])


def estimate_mixing_law(drops: np.ndarray, eps: float, diagonal: bool = False) -> np.ndarray:
    """A_t from the mean loss drops D [k, k] (D[i, j]: drop of validation domain i over a probe of
    domain j): under L_{t+1} = L_t - A_t q_j (the LMO mixing law), D[i, j] = sum_m A[i, m] q_j[m],
    so A^T = Q^{-1} D^T (Algorithm 2). `diagonal`: the authors' variant A = diag(D[i, i] / q_i[i])."""
    d = np.asarray(drops, dtype=np.float64)
    k = d.shape[0]
    q = probe_matrix(k, eps)
    if diagonal:
        return np.diag(np.diag(d) / np.diag(q))
    return np.linalg.solve(q, d.T).T


def normalize_mixing_law(a: np.ndarray) -> np.ndarray:
    """A - min(A) when some entry is negative, then divided by its sum (the authors'
    `--aioli_normalize_A`); all zeros when nothing is left (no direction to move in)."""
    a = np.asarray(a, dtype=np.float64)
    lo = a.min()
    if lo < 0:
        a = a - lo
    total = a.sum()
    if not total > 0:
        return np.zeros_like(a)
    return a / total


def smooth_mixing_law(previous: np.ndarray | None, a: np.ndarray, ema: float) -> np.ndarray:
    """Abar_r = ema Abar_{r-1} + (1 - ema) A_r, Abar_1 = A_1 (the authors' `--ema`)."""
    a = np.asarray(a, dtype=np.float64)
    if previous is None:
        return a.copy()
    return ema * np.asarray(previous, dtype=np.float64) + (1.0 - ema) * a


def mixture_update(log_p: np.ndarray, a_bar: np.ndarray, eta: float) -> np.ndarray:
    """log p_r = log softmax(log p + eta sum_i Abar[i, :]) (Algorithm 1's exponentiated-gradient
    step on the LMO objective sum_i L_i: its gradient in p is -sum_i A[i, :])."""
    z = np.asarray(log_p, dtype=np.float64) + eta * np.asarray(a_bar, dtype=np.float64).sum(axis=0)
    m = z.max()
    return z - (m + math.log(np.exp(z - m).sum()))


@dataclass(frozen=True)
class ProbeSchedule:
    """Which steps of a run of `steps` steps probe which domain, and when validation is due.

    Round r holds steps r R + 1 .. min((r + 1) R, steps); a probing round starts with k sweeps
    intervals of `delta` steps (P = k sweeps delta steps) and needs r R + P < steps."""

    k: int
    steps: int
    round_len: int
    delta: int
    sweeps: int
    shuffle: bool
    seed: int

    @property
    def probe_steps(self) -> int:
        return self.k * self.sweeps * self.delta

    def probing(self, r: int) -> bool:
        return r * self.round_len + self.probe_steps < self.steps

    def order(self, r: int) -> list[int]:
        """Round r's probe domains, interval by interval."""
        if not self.shuffle:
            return list(range(self.k)) * self.sweeps
        rng = np.random.default_rng([self.seed, r])
        return [int(j) for _ in range(self.sweeps) for j in rng.permutation(self.k)]

    def probe_at(self, step: int) -> tuple[int, int] | None:
        """(round, interval) that step `step` (1-based) trains in, None when it trains on p."""
        r, offset = divmod(step - 1, self.round_len)
        if self.probing(r) and offset < self.probe_steps:
            return r, offset // self.delta
        return None

    def boundary(self, step: int) -> tuple[int, int] | None:
        """(round, intervals done) when validation is due after step `step` (0: before any)."""
        r, offset = divmod(step, self.round_len)
        if self.probing(r) and offset % self.delta == 0 and offset <= self.probe_steps:
            return r, offset // self.delta
        return None


def validation_passes(schedule: ProbeSchedule) -> int:
    """The run's validation passes: k sweeps + 1 in each probing round."""
    rounds = -(-schedule.steps // schedule.round_len)
    return sum(1 for r in range(rounds) if schedule.probing(r)) * (schedule.k * schedule.sweeps + 1)


def eval_sequences(cfg: AioliConfig, schedule: ProbeSchedule, global_batch_size: int) -> int:
    """Validation sequences per domain of each pass: `cfg.eval_sequences`, or the most that keep
    passes x k x n forwarded sequences (a third of a trained one's FLOPs each) within
    `eval_budget` of the steps x global_batch_size trained ones, at least 1."""
    if cfg.eval_sequences is not None:
        return cfg.eval_sequences
    passes = validation_passes(schedule)
    if passes == 0:
        return 1
    trained = Fraction(cfg.eval_budget) * 3 * schedule.steps * global_batch_size
    return max(1, math.floor(trained / (passes * schedule.k)))


def round_length(steps: int, rounds: int, round_steps: int | None) -> int:
    """R = round_steps when set, else ceil(steps / rounds)."""
    return round_steps if round_steps is not None else max(1, -(-steps // rounds))


class Aioli(MethodBase):
    """Owns log p, the smoothed A, and the current round's loss drops and last validation losses."""

    def __init__(self, cfg: AioliConfig, ctx: MethodContext, path: str = "mixing.aioli"):
        cfg.validate(path)
        k = ctx.k
        if k > 1 and not cfg.one_hot_eps < (k - 1) / k:
            raise ConfigError(
                f"{path}.one_hot_eps: expected a value below (k-1)/k = {(k - 1) / k:g} for {k} domains "
                f"(else the probes cannot be told apart), got {cfg.one_hot_eps}"
            )
        self.cfg = cfg
        self.domains = ctx.domains
        self.k = k
        rl = round_length(ctx.steps, cfg.rounds, cfg.round_steps)
        self.schedule = ProbeSchedule(k, ctx.steps, rl, cfg.delta, cfg.sweeps, cfg.shuffle, ctx.seed)
        self.eval_sequences = eval_sequences(cfg, self.schedule, ctx.global_batch_size)
        self.needs = Needs(validation=True, validation_sequences=self.eval_sequences, host_signals=True)
        if self.schedule.probe_steps >= rl:
            key = "round_steps" if cfg.round_steps is not None else "rounds"
            raise ConfigError(
                f"{path}.{key}: expected rounds longer than their probes (k*sweeps*delta = "
                f"{self.schedule.probe_steps} steps), got rounds of {rl} steps"
            )
        self.log_p0 = np.full(k, -math.log(k), dtype=np.float64)
        self.log_p = self.log_p0.copy()
        self.a_bar: np.ndarray | None = None
        self.a_last: np.ndarray | None = None
        self.drops = np.zeros((k, k), dtype=np.float64)
        self.last_val: np.ndarray | None = None
        self._orders: dict[int, list[int]] = {}
        self.log = MethodLog(ctx)

    @property
    def weights(self) -> np.ndarray:
        """p: the mixture trained on outside the probes."""
        return np.exp(self.log_p)

    def _order(self, r: int) -> list[int]:
        if r not in self._orders:
            self._orders = {r: self.schedule.order(r)}
        return self._orders[r]

    def probe_domain(self, step: int) -> int | None:
        at = self.schedule.probe_at(step)
        return None if at is None else self._order(at[0])[at[1]]

    def sampling_weights(self, step: int) -> np.ndarray:
        j = self.probe_domain(step)
        if j is None:
            return self.weights
        return probe_mixture(self.k, j, self.cfg.one_hot_eps)

    def validation_due(self, step: int) -> bool:
        return self.schedule.boundary(step) is not None

    def observe_validation(self, step: int, losses: torch.Tensor) -> None:
        at = self.schedule.boundary(step)
        if at is None:
            return
        r, done = at
        val = np.asarray(losses.tolist(), dtype=np.float64)
        if done == 0:
            self.drops = np.zeros((self.k, self.k), dtype=np.float64)
        elif self.last_val is not None:
            j = self._order(r)[done - 1]
            self.drops[:, j] += self.last_val - val
            if done == self.k * self.cfg.sweeps:
                self._update()
        self.last_val = val

    def _update(self) -> None:
        """End of LearnParams: A from the round's mean drops, then the mixture step."""
        cfg = self.cfg
        diagonal = cfg.diagonal and (cfg.variant == "paper" or cfg.one_hot_eps > 0)
        a = estimate_mixing_law(self.drops / cfg.sweeps, cfg.one_hot_eps, diagonal)
        self.a_last = a
        if cfg.normalize:
            a = normalize_mixing_law(a)
        self.a_bar = smooth_mixing_law(self.a_bar, a, cfg.ema)
        base = self.log_p if cfg.variant == "paper" else self.log_p0
        self.log_p = mixture_update(base, self.a_bar, cfg.eta)

    def after_step(self, step: int, signals: StepSignals) -> dict[str, Any]:
        host = signals.on_host()
        p = self.weights.tolist()
        j = self.probe_domain(step)
        self.log.append(
            step,
            {
                "weights": p,
                "sampling": np.asarray(signals.weights, dtype=np.float64).tolist(),
                "sequences": np.asarray(signals.sequences).tolist(),
                "tokens": host.tokens.tolist(),
                "loss": host.domain_loss.tolist(),
                "probe": None if j is None else self.domains[j],
            },
        )
        row: dict[str, Any] = {"domain_weights": dict(zip(self.domains, p)), "aioli_probe": int(j is not None)}
        if self.a_last is not None:
            row["aioli_A"] = self.a_last.ravel().tolist()
        return row

    def state_dict(self) -> dict[str, Any]:
        def as_list(x: np.ndarray | None) -> list | None:
            return None if x is None else x.tolist()

        return {
            "log_p": self.log_p.tolist(),
            "a_bar": as_list(self.a_bar),
            "a_last": as_list(self.a_last),
            "drops": self.drops.tolist(),
            "last_val": as_list(self.last_val),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return

        def as_array(x: list | None) -> np.ndarray | None:
            return None if x is None else np.asarray(x, dtype=np.float64)

        self.log_p = np.asarray(state["log_p"], dtype=np.float64)
        self.a_bar = as_array(state["a_bar"])
        self.a_last = as_array(state["a_last"])
        self.drops = np.asarray(state["drops"], dtype=np.float64)
        self.last_val = as_array(state["last_val"])

    def close(self) -> None:
        self.log.close()
