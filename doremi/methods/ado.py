"""ADO: Adaptive Data Optimization (Jiang, Zhou, Feng, Malladi and Kolter 2024, "Adaptive Data
Optimization: Dynamic Sample Selection with Scaling Laws", arXiv 2410.11820, section 3).

Each domain k gets a power law of its training loss against the amount n of data seen (Eq. 1),
    L_k(n) = eps_k + beta_k n^(-alpha_k),
refit every `refit_every` steps once `warmup` steps are done, from a bounded history of
(n, mean training loss) points of that domain. Its derivative (Eq. 2)
    dL_k/dn = -(alpha_k / n) (L_k(n) - eps_k) = -alpha_k beta_k n^(-alpha_k - 1)
forecasts how fast the domain's loss still falls: its learning potential. After step t the
policy for step t + 1 is
    h_k(t)   = gamma1 pi_k(t) + (1 - gamma1) h_k(t-1),      h(0) = mu     (credit assignment)
    lambda_k = h_k(t)^s
    rho_k(t) = mu_k lambda_k (-dL_k/dn)(n_k(t)) / sum_j mu_j lambda_j (-dL_j/dn)(n_j(t))
    pibar(t) = (1/t) sum_{tau <= t} pi(tau)                                 (time average)
    pi(t+1)  = floor_delta(gamma2 rho(t) + (1 - gamma2) pibar(t))
with mu the natural mixture (each domain's share of the training tokens, `ctx.train_tokens`),
and floor_delta the projection onto {pi_k >= delta for every domain with mu_k > 0} that keeps the
ratios of the unfloored entries. Until a domain has been fitted the policy is mu.

Choices where the paper is silent (ours):
- The history: after the warmup, per domain, one point per `record_every` steps: the
  token-weighted mean of n over the steps the domain was drawn in, and its mean training loss
  over them (sum of loss sums / sum of tokens). A block mean has no lag (an EMA of the loss would
  trail n); the authors smooth with a Savitzky-Golay filter and keep every 10th step. When a
  domain holds more than `max_points`, adjacent pairs are merged (token-weighted), so old data
  grows coarse while the state stays small; the fit weights each point by its tokens.
- n counts sequences of the domain seen so far, including the step's own (never 0).
- The fit: least squares of log L (the authors' target) from the best point of a grid over
  alpha in (0, alpha_max] (eps, beta by linear least squares for each alpha), polished by
  Levenberg-Marquardt in float64 with alpha in [0, alpha_max] and eps >= 0. Deterministic.
  Losses that do not fall give beta = 0: no learning potential. A fit that fails keeps the
  previous parameters.
- A domain with mu_k > 0 that has no fit yet (too few points) is given the largest fitted
  learning potential (optimism, so that it gets drawn and fitted); rho falls back to mu when
  every potential is 0.
- Draws are exact (`Needs()` default): ADO uses no importance weights, and exact counts make the
  realised mixture follow the policy within one sequence, so that n_k and the credit terms carry
  no sampling noise.

The authors' code (github yidingjiang/ado, `src/data_selectors/ado.py`) differs; each difference
is an option:
- `count: total`: their `use_same_step_size`: every domain's n is the total number of sequences
  seen (cross-domain transfer), not the domain's own.
- `credit: counts`: h is the moving average of the realised count distribution of each batch,
  not of the policy.
- `average: preference`: pibar averages the (floored) preferences rho, with mu standing for the
  steps before the first fit (their `p_avg`: its update at their 0-based step itr = t - 1 gives
  rho(t) the weight 1/(itr + 1) = 1/t), and pi(t+1) = gamma2 rho(t) + (1 - gamma2) pibar(t-1).
- `floor_on: preference`: the floor is applied to rho as max(rho, delta) / sum (their
  `clip_min_probability`), not to the policy.
- `huber_delta`: a Huber loss on the log residuals (theirs: 1e-3), by iteratively reweighted
  least squares. They also fit with L-BFGS from a grid of 512 starting points with soft bounds
  (alpha <= 0.8, log beta <= 6.5, log eps >= 0.5) and floor alpha at 0.05 in the derivative;
  we keep alpha <= `alpha_max` and eps >= 0 only.
Not offered (stated here because they change the weights): their history holds every step's
loss (a domain absent from the batch repeats its previous loss), smoothed by a Savitzky-Golay
filter (window 101, order 3) and taken every 10th step; they refit at their 0-based steps
itr >= start_step with itr a multiple of update_interval (our steps 1001, 2001, ... with their
defaults), so their first fit sees a single point after `ignore_steps`, while ours waits for
`min_points` points (warmup + refit_every); and they draw each batch's domains at random from
the policy (a multinomial), not exact counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from doremi.methods.log import MethodLog
from trainer.configtools import ConfigError
from trainer.hooks import MethodBase, MethodContext, StepSignals

#: Bounds of log beta in the fit (beta n^-alpha stays finite in float64).
LOG_BETA_BOUND = 100.0


@dataclass
class ADOConfig:
    """ADO (Jiang et al. 2024): per-domain power laws of the training loss, refit during the run,
    steer the mixture towards the domains whose loss still falls fastest."""

    # Steps on the natural mixture before anything is fitted; their losses are left out of the
    # fits (the authors' `ignore_steps` and `start_step`: 1000).
    warmup: int = 1000
    # The power laws are refit after every step t > warmup with (t - warmup) a multiple of this
    # (the authors' `update_interval`: 1000). The first fit is at warmup + refit_every.
    refit_every: int = 1000
    # Steps per history point (a block mean); must divide refit_every (the authors keep every
    # 10th step).
    record_every: int = 10
    # Most history points per domain: beyond it adjacent pairs are merged.
    max_points: int = 256
    # Fewest history points a domain needs to be fitted (3 parameters).
    min_points: int = 5
    # gamma1: weight of the newest policy in the moving average h of the credit assignment.
    credit_smoothing: float = 0.1
    # s: the credit assignment is lambda_k = h_k^s.
    credit_exponent: float = 0.5
    # gamma2: weight of the preference rho(t) in the policy; the rest is the time average pibar.
    policy_mix: float = 0.1
    # delta_min: smallest probability of a domain with training data (at most 1 / their number).
    floor: float = 0.01
    # Largest exponent alpha of a fit.
    alpha_max: float = 0.8
    # Huber threshold on the log residuals of the fit (the authors' code: 1e-3); null: least squares.
    huber_delta: float | None = None
    # n of a domain: `domain`: its own sequences seen (the paper); `total`: all sequences seen
    # (the authors' `use_same_step_size`).
    count: Literal["domain", "total"] = "domain"
    # h averages `policy`: the policies used (the paper), or `counts`: each batch's realised
    # count distribution (the authors' code).
    credit: Literal["policy", "counts"] = "policy"
    # The time average pibar is of the `policy` used so far (the paper), or of the `preference`
    # rho (the authors' `p_avg`).
    average: Literal["policy", "preference"] = "policy"
    # The floor applies to the `policy` (exactly, the paper's minimum probability) or to the
    # `preference` rho by clip-and-renormalise (the authors' code).
    floor_on: Literal["policy", "preference"] = "policy"

    def validate(self, path: str = "mixing.ado") -> None:
        for name in ("warmup", "refit_every", "record_every", "max_points", "min_points"):
            value = getattr(self, name)
            low = 0 if name == "warmup" else 3 if name == "min_points" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{path}.{name}: expected an integer >= {low}, got {value!r}")
        if self.refit_every % self.record_every:
            raise ConfigError(
                f"{path}.refit_every: expected a multiple of record_every ({self.record_every}), got {self.refit_every}"
            )
        if self.max_points < max(self.min_points, 2):
            raise ConfigError(
                f"{path}.max_points: expected >= min_points ({self.min_points}) and >= 2, got {self.max_points}"
            )
        for name, lo_open in (("credit_smoothing", True), ("policy_mix", False)):
            value = getattr(self, name)
            if not ((0 < value <= 1) if lo_open else (0 <= value <= 1)):
                interval = "(0, 1]" if lo_open else "[0, 1]"
                raise ConfigError(f"{path}.{name}: expected a value in {interval}, got {value}")
        if not 0 <= self.credit_exponent < math.inf:
            raise ConfigError(f"{path}.credit_exponent: expected a finite value >= 0, got {self.credit_exponent}")
        if not 0 <= self.floor < 1:
            raise ConfigError(f"{path}.floor: expected a value in [0, 1), got {self.floor}")
        if not 0 < self.alpha_max < math.inf:
            raise ConfigError(f"{path}.alpha_max: expected a finite value > 0, got {self.alpha_max}")
        if self.huber_delta is not None and not 0 < self.huber_delta < math.inf:
            raise ConfigError(f"{path}.huber_delta: expected a finite value > 0 or null, got {self.huber_delta}")
        for name, allowed in (
            ("count", ("domain", "total")),
            ("credit", ("policy", "counts")),
            ("average", ("policy", "preference")),
            ("floor_on", ("policy", "preference")),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"{path}.{name}: expected one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}"
                )


# --- the power law (Eqs. 1 and 2) -------------------------------------------------------------


def power_law(n: np.ndarray | float, beta: float, alpha: float, eps: float) -> np.ndarray:
    """L(n) = eps + beta n^(-alpha) (Eq. 1), float64."""
    return eps + beta * np.asarray(n, dtype=np.float64) ** (-alpha)


def learning_speed(n: np.ndarray | float, beta: float, alpha: float, eps: float) -> np.ndarray:
    """-dL/dn = (alpha / n) (L(n) - eps) = alpha beta n^(-alpha - 1) (Eq. 2), float64."""
    n = np.asarray(n, dtype=np.float64)
    return alpha * beta * n ** (-alpha - 1.0)


def _fit_cost(r: np.ndarray, w: np.ndarray, huber: float | None) -> float:
    a = np.abs(r)
    if huber is None:
        return float(np.sum(w * 0.5 * a * a))
    return float(np.sum(w * np.where(a <= huber, 0.5 * a * a, huber * (a - 0.5 * huber))))


def _log_model(theta: np.ndarray, logn: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """log(eps + beta n^-alpha), beta n^-alpha, eps + beta n^-alpha for theta = (log beta, alpha, eps)."""
    x = np.exp(theta[0] - theta[1] * logn)
    d = theta[2] + x
    return np.log(d), x, d


def _clamp(theta: np.ndarray, alpha_max: float) -> np.ndarray:
    return np.array(
        [
            min(max(theta[0], -LOG_BETA_BOUND), LOG_BETA_BOUND),
            min(max(theta[1], 0.0), alpha_max),
            max(theta[2], 0.0),
        ]
    )


def fit_power_law(
    n: Sequence[float] | np.ndarray,
    loss: Sequence[float] | np.ndarray,
    weights: Sequence[float] | np.ndarray | None = None,
    alpha_max: float = 0.8,
    huber_delta: float | None = None,
    grid: int = 41,
    max_iter: int = 200,
) -> tuple[float, float, float] | None:
    """(beta, alpha, eps) of L(n) = eps + beta n^(-alpha) (Eq. 1) fitted to the points by
    (weighted) least squares of log L, or a Huber loss on the log residuals (`huber_delta`),
    with alpha in [0, alpha_max] and eps >= 0. A pure, deterministic function.

    Start: for each alpha = alpha_max j / (grid - 1), j = 1..grid-1, eps and beta by linear least
    squares of L on n^-alpha (eps clipped at 0); the start is the alpha of least log cost.
    Then Levenberg-Marquardt on (log beta, alpha, eps), steps projected onto the bounds, until no
    step lowers the cost. Losses that do not fall with n give (0, 0, mean loss). None: fewer than
    3 points, or a non-positive or non-finite value.
    """
    n = np.asarray(n, dtype=np.float64)
    y_lin = np.asarray(loss, dtype=np.float64)
    w = np.ones_like(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if n.shape != y_lin.shape or w.shape != n.shape or n.ndim != 1 or len(n) < 3:
        return None
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(y_lin)) and np.all(np.isfinite(w))):
        return None
    if np.any(n <= 0) or np.any(y_lin <= 0) or np.any(w <= 0):
        return None
    w = w / w.sum()
    logn, y = np.log(n), np.log(y_lin)

    best: tuple[float, np.ndarray] | None = None
    for j in range(1, grid):
        alpha = alpha_max * j / (grid - 1)
        x = np.exp(-alpha * logn)
        sw, sx, sy = w.sum(), np.sum(w * x), np.sum(w * y_lin)
        sxx, sxy = np.sum(w * x * x), np.sum(w * x * y_lin)
        det = sw * sxx - sx * sx
        if det <= 0:
            continue
        beta = (sw * sxy - sx * sy) / det
        eps = (sy - beta * sx) / sw
        if eps < 0:
            eps, beta = 0.0, sxy / sxx
        if not beta > 0:
            continue
        theta = _clamp(np.array([math.log(beta), alpha, eps]), alpha_max)
        cost = _fit_cost(_log_model(theta, logn)[0] - y, w, huber_delta)
        if math.isfinite(cost) and (best is None or cost < best[0]):
            best = (cost, theta)
    if best is None:
        return 0.0, 0.0, float(np.sum(w * y_lin))

    cost, theta = best
    lam = 1e-3
    for _ in range(max_iter):
        f, x, d = _log_model(theta, logn)
        r = f - y
        rw = w if huber_delta is None else w * np.minimum(1.0, huber_delta / np.maximum(np.abs(r), 1e-300))
        jac = np.stack([x / d, -x * logn / d, 1.0 / d], axis=1)
        a = jac.T @ (rw[:, None] * jac)
        g = jac.T @ (rw * r)
        diag = np.maximum(np.diag(a), 1e-12 * max(float(np.max(np.diag(a))), 1e-300))
        accepted = None
        while lam <= 1e12:
            try:
                step = np.linalg.solve(a + lam * np.diag(diag), -g)
            except np.linalg.LinAlgError:
                lam *= 10.0
                continue
            cand = _clamp(theta + step, alpha_max)
            c = _fit_cost(_log_model(cand, logn)[0] - y, w, huber_delta)
            if math.isfinite(c) and c < cost:
                accepted = (c, cand)
                lam = max(lam / 10.0, 1e-15)
                break
            lam *= 10.0
        if accepted is None:
            break
        moved = float(np.max(np.abs(accepted[1] - theta)))
        cost, theta = accepted
        if moved <= 1e-15 * (1.0 + float(np.max(np.abs(theta)))):
            break
    beta, alpha, eps = math.exp(theta[0]), float(theta[1]), float(theta[2])
    if not all(math.isfinite(v) for v in (beta, alpha, eps)):
        return None
    return beta, alpha, eps


# --- the policy (section 3.2) ------------------------------------------------------------------


def credit_update(h: np.ndarray, x: np.ndarray, gamma1: float) -> np.ndarray:
    """h(t) = gamma1 x(t) + (1 - gamma1) h(t-1): the moving average behind the credit assignment
    lambda_k = h_k^s, x the policy of step t (or its realised count distribution)."""
    return gamma1 * np.asarray(x, dtype=np.float64) + (1.0 - gamma1) * np.asarray(h, dtype=np.float64)


def preference(mu: np.ndarray, h: np.ndarray, s: float, speed: np.ndarray) -> np.ndarray:
    """rho_k = mu_k h_k^s (-dL_k/dn) / sum_j mu_j h_j^s (-dL_j/dn): prior times credit times
    learning potential, normalised; mu when every term is 0."""
    mu = np.asarray(mu, dtype=np.float64)
    num = mu * np.asarray(h, dtype=np.float64) ** s * np.asarray(speed, dtype=np.float64)
    total = float(num.sum())
    if not total > 0 or not math.isfinite(total):
        return mu / mu.sum()
    return num / total


def mix_policy(rho: np.ndarray, average: np.ndarray, gamma2: float) -> np.ndarray:
    """pi = gamma2 rho + (1 - gamma2) pibar: the preference smoothed by the time average."""
    return gamma2 * np.asarray(rho, dtype=np.float64) + (1.0 - gamma2) * np.asarray(average, dtype=np.float64)


def running_mean(mean: np.ndarray, count: int, x: np.ndarray) -> np.ndarray:
    """The mean of count + 1 vectors from the mean of the first `count` and the next one."""
    mean = np.asarray(mean, dtype=np.float64)
    return mean + (np.asarray(x, dtype=np.float64) - mean) / (count + 1)


def floor_exact(p: np.ndarray, delta: float, mask: np.ndarray) -> np.ndarray:
    """The distribution q with q_k = max(delta, c p_k) on `mask`, 0 elsewhere, c set so that
    sum q = 1: every masked domain gets at least delta and the others keep their ratios.
    Needs delta * mask.sum() <= 1; p is a distribution supported on mask."""
    p = np.asarray(p, dtype=np.float64)
    mask = np.asarray(mask, dtype=bool)
    floored = np.zeros_like(mask)
    while True:
        free = mask & ~floored
        mass = float(p[free].sum())
        rest = 1.0 - delta * int(floored.sum())
        if mass > 0:
            c = rest / mass
            q = np.where(free, c * p, 0.0)
        else:
            q = np.where(free, rest / max(int(free.sum()), 1), 0.0)
        new = floored | (free & (q < delta))
        if np.array_equal(new, floored):
            return np.where(floored, delta, q)
        floored = new


def floor_clip(p: np.ndarray, delta: float, mask: np.ndarray) -> np.ndarray:
    """max(p_k, delta) on `mask` (0 elsewhere), renormalised: the authors' `clip_min_probability`
    (an entry may end slightly below delta)."""
    p = np.asarray(p, dtype=np.float64)
    q = np.where(np.asarray(mask, dtype=bool), np.maximum(p, delta), 0.0)
    return q / q.sum()


def merge_points(n: list[float], loss: list[float], w: list[float]) -> tuple[list[float], list[float], list[float]]:
    """Adjacent pairs of history points merged into their token-weighted means (an odd last point
    kept): half the points, the same tokens."""
    out_n, out_l, out_w = [], [], []
    for i in range(0, len(n), 2):
        if i + 1 == len(n):
            out_n.append(n[i])
            out_l.append(loss[i])
            out_w.append(w[i])
            continue
        tw = w[i] + w[i + 1]
        out_n.append((n[i] * w[i] + n[i + 1] * w[i + 1]) / tw)
        out_l.append((loss[i] * w[i] + loss[i + 1] * w[i + 1]) / tw)
        out_w.append(tw)
    return out_n, out_l, out_w


# --- the method ----------------------------------------------------------------------------------


class ADO(MethodBase):
    """Owns the cumulative counts, the bounded loss history, the fitted laws, h, pibar and the policy."""

    def __init__(self, cfg: ADOConfig, ctx: MethodContext):
        self.cfg = cfg
        self.domains = list(ctx.domains)
        self.k = ctx.k
        tokens = np.asarray(ctx.train_tokens, dtype=np.float64)
        if tokens.shape != (self.k,) or np.any(tokens < 0) or not tokens.sum() > 0:
            raise ValueError(f"train_tokens: expected {self.k} counts >= 0 with a positive sum, got {ctx.train_tokens}")
        self.mu = tokens / tokens.sum()
        self.mask = self.mu > 0
        if cfg.floor * int(self.mask.sum()) > 1:
            raise ConfigError(
                f"mixing.ado.floor: expected at most 1/{int(self.mask.sum())} (domains with data), got {cfg.floor}"
            )
        self.log = MethodLog(ctx)
        self.is_main = ctx.is_main
        k = self.k
        self.seen = [0] * k
        self.total = 0
        self.block_steps = 0
        self.block_loss = [0.0] * k
        self.block_tokens = [0.0] * k
        self.block_n = [0.0] * k
        self.points: list[dict[str, list[float]]] = [{"n": [], "loss": [], "w": []} for _ in range(k)]
        self.params: list[list[float] | None] = [None] * k
        self.h = self.mu.copy()
        self.average = self.mu.copy()
        self.average_count = 0
        self.policy = self.mu.copy()
        self.rho: np.ndarray | None = None

    def sampling_weights(self, step: int) -> np.ndarray:
        return self.policy.copy()

    def _n(self) -> np.ndarray:
        if self.cfg.count == "total":
            return np.full(self.k, float(self.total))
        return np.asarray(self.seen, dtype=np.float64)

    def _record(self, sequences: list[int], tokens: list[float], loss_sum: list[float]) -> None:
        n = self._n()
        for i in range(self.k):
            if tokens[i] > 0:
                self.block_loss[i] += loss_sum[i]
                self.block_tokens[i] += tokens[i]
                self.block_n[i] += float(n[i]) * tokens[i]
        self.block_steps += 1
        if self.block_steps < self.cfg.record_every:
            return
        for i in range(self.k):
            tw = self.block_tokens[i]
            if tw > 0:
                pts = self.points[i]
                pts["n"].append(self.block_n[i] / tw)
                pts["loss"].append(self.block_loss[i] / tw)
                pts["w"].append(tw)
                if len(pts["n"]) > self.cfg.max_points:
                    pts["n"], pts["loss"], pts["w"] = merge_points(pts["n"], pts["loss"], pts["w"])
        self.block_steps = 0
        self.block_loss = [0.0] * self.k
        self.block_tokens = [0.0] * self.k
        self.block_n = [0.0] * self.k

    def _refit(self) -> None:
        for i in range(self.k):
            pts = self.points[i]
            if len(pts["n"]) < self.cfg.min_points:
                continue
            fit = fit_power_law(pts["n"], pts["loss"], pts["w"], self.cfg.alpha_max, self.cfg.huber_delta)
            if fit is not None:
                self.params[i] = list(fit)

    def _speeds(self) -> np.ndarray | None:
        """-dL_k/dn at each domain's current n; unfitted domains get the largest fitted one."""
        fitted = [i for i in range(self.k) if self.params[i] is not None]
        if not fitted:
            return None
        n = self._n()
        speed = np.zeros(self.k)
        for i in fitted:
            beta, alpha, eps = self.params[i]
            speed[i] = float(learning_speed(max(n[i], 1.0), beta, alpha, eps))
        top = float(speed[fitted].max())
        for i in range(self.k):
            if self.params[i] is None and self.mask[i]:
                speed[i] = top
        return speed

    def after_step(self, step: int, signals: StepSignals) -> dict[str, Any]:
        cfg = self.cfg
        assert signals.loss_sum is not None
        sequences = [int(s) for s in np.asarray(signals.sequences).tolist()]
        tokens = signals.tokens.tolist()
        loss_sum = signals.loss_sum.tolist()
        used = self.policy
        for i, s in enumerate(sequences):
            self.seen[i] += s
        self.total += sum(sequences)
        if step > cfg.warmup:
            self._record(sequences, tokens, loss_sum)

        if cfg.credit == "counts" and sum(sequences) > 0:
            self.h = credit_update(
                self.h, np.asarray(sequences, dtype=np.float64) / sum(sequences), cfg.credit_smoothing
            )
        else:
            self.h = credit_update(self.h, used, cfg.credit_smoothing)
        if cfg.average == "policy":
            self.average = running_mean(self.average, self.average_count, used)
            self.average_count += 1

        refit = step > cfg.warmup and (step - cfg.warmup) % cfg.refit_every == 0
        if refit:
            self._refit()

        speed = self._speeds()
        if speed is None:
            self.rho = None
            policy = self.mu.copy()
            if cfg.average == "preference":
                self.average = running_mean(self.average, self.average_count, self.mu)
                self.average_count += 1
        else:
            rho = preference(self.mu, self.h, cfg.credit_exponent, speed)
            if cfg.floor_on == "preference":
                rho = floor_clip(rho, cfg.floor, self.mask)
            self.rho = rho
            policy = mix_policy(rho, self.average, cfg.policy_mix)
            if cfg.average == "preference":
                self.average = running_mean(self.average, self.average_count, rho)
                self.average_count += 1
            if cfg.floor_on == "policy":
                policy = floor_exact(policy / policy.sum(), cfg.floor, self.mask)
            policy = policy / policy.sum()
        self.policy = policy

        weights = self.policy.tolist()
        row: dict[str, Any] = {"domain_weights": dict(zip(self.domains, weights))}
        if refit and any(p is not None for p in self.params):
            row["ado_alpha"] = {d: p[1] for d, p in zip(self.domains, self.params) if p is not None}
        if self.is_main:
            loss = [ls / t if t > 0 else 0.0 for ls, t in zip(loss_sum, tokens)]
            record: dict[str, Any] = {
                "weights": weights,
                "tokens": tokens,
                "sequences": sequences,
                "sampling": used.tolist(),
                "loss": loss,
                "credit": self.h.tolist(),
            }
            if self.rho is not None:
                record["preference"] = self.rho.tolist()
            if refit:
                record["fit"] = [None if p is None else {"beta": p[0], "alpha": p[1], "eps": p[2]} for p in self.params]
            self.log.append(step, record)
        return row

    def state_dict(self) -> dict[str, Any]:
        return {
            "seen": list(self.seen),
            "total": self.total,
            "block_steps": self.block_steps,
            "block_loss": list(self.block_loss),
            "block_tokens": list(self.block_tokens),
            "block_n": list(self.block_n),
            "points": [{key: list(v) for key, v in p.items()} for p in self.points],
            "params": [None if p is None else list(p) for p in self.params],
            "h": self.h.tolist(),
            "average": self.average.tolist(),
            "average_count": self.average_count,
            "policy": self.policy.tolist(),
            "rho": None if self.rho is None else self.rho.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.seen = [int(v) for v in state["seen"]]
        self.total = int(state["total"])
        self.block_steps = int(state["block_steps"])
        self.block_loss = [float(v) for v in state["block_loss"]]
        self.block_tokens = [float(v) for v in state["block_tokens"]]
        self.block_n = [float(v) for v in state["block_n"]]
        self.points = [{key: [float(x) for x in p[key]] for key in ("n", "loss", "w")} for p in state["points"]]
        self.params = [None if p is None else [float(x) for x in p] for p in state["params"]]
        self.h = np.asarray(state["h"], dtype=np.float64)
        self.average = np.asarray(state["average"], dtype=np.float64)
        self.average_count = int(state["average_count"])
        self.policy = np.asarray(state["policy"], dtype=np.float64)
        self.rho = None if state["rho"] is None else np.asarray(state["rho"], dtype=np.float64)

    def close(self) -> None:
        self.log.close()
