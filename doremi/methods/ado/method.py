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

The equations above are the paper's; two variants (`variant`) say how they are run.

`variant: authors` (the default) is the released code, github yidingjiang/ado at commit
bc3d8d0e4d6a13f40f03b2e8fb83369d773a2611, `src/data_selectors/ado.py` (lines L<n> below), driven
by `src/dataloader/adaptive_loader.py` and `src/train.py` at its 0-based step itr = t - 1.
Where it differs from the paper's form:
- n is the total number of sequences seen, for every domain (`use_same_step_size=True`, the
  default the loader keeps, L129-131), not the domain's own (`count: total`).
- h averages each batch's realised count distribution, h = 0.9 h + 0.1 counts / sum (L135-137),
  not the policy (`credit: counts`); lambda = h^0.5 (L105; bc3d8d0 replaced (h (1 - h))^0.5).
- pibar averages the clipped preference (`p_avg`, L113-114: weight 1/(itr + 1) = 1/t, with mu
  standing for the steps before the first fit), and pi(t+1) = 0.9 pibar(t-1) + 0.1 rho(t): the
  mean before this step's rho is folded in (`average: preference`).
- the floor clips rho: max(rho, 0.01) / sum (`clip_min_probability`, L111, L245-250; an entry
  can end slightly under 0.01), and the policy is not floored again (`floor_on: preference`).
- the slope is max(alpha, 0.05) (L(n) - eps) / n, L(n) at the unfloored alpha (L94-101).
- the history is each step's mean loss per domain, stored as float32 (`task_loss_TxK`); a domain
  absent from the batch repeats its previous value, or takes the batch mean on the first step
  (L144-153). At a refit it is smoothed by Savitzky-Golay (window 101, order 3) and every 10th
  step from `warmup` (their `ignore_steps`) is kept with its cumulative n (L218-224): here
  `record_every` is that stride.
- the fit (L253-306): sum over points of Huber(delta 1e-3) of log L - log(e^a n^-alpha + e^e),
  plus soft bounds of slope 1: max(alpha - 0.8, 0) - min(alpha, 0.001) + max(a - 6.5, 0) +
  max(0.5 - e, 0); jaxopt L-BFGS (tol 1e-5, 200 iterations) from each of 512 starts (a in
  -2..5, e in -2..1.5 by 0.5, alpha in 0..0.7 by 0.1), the start of least final value kept; a
  fit with any NaN or inf is dropped whole (`check_valid`). The eps bound binds: a Huber term
  moves by at most 1e-3 per unit of e, the penalty by 1, so with fewer than 1000 kept points the
  fit has eps >= e^0.5 = 1.6487 exactly.
- refits happen after steps with itr >= `warmup` and itr % `refit_every` == 0 (L178; their
  configs: ignore_steps 1000, start_step 500 or 1000, update_interval 1000, so steps 1001, 2001,
  ...): every 1000 steps. The first fit sees a single kept point.
- draws are random: each sequence's domain from the policy (adaptive_loader.py L96), so
  `Needs(draws="random")`.
Ours where theirs cannot be run as is: the fit is a batched L-BFGS in float64 on the run's
device (`fit_soft_bounds`; theirs jaxopt in float32 on TPUs), same objective, starts, history,
stopping rule and cap, with an Armijo backtracking line search (theirs zoom); the objective is
flat along some directions, so the two can stop at different points of near-equal value, and
so can two layouts whose float32 loss rows differ in one rounding. A history shorter than 101
steps is smoothed with the largest odd window it holds (theirs would raise). Only rows from
`warmup` - 100 on are kept, since earlier ones cannot reach a kept point through the window. A
domain without training data keeps probability 0 (theirs would floor it). A domain's loss is its
token-weighted mean (theirs the mean over sequences: the same when every sequence has seq_len
loss tokens). Their `y_axis: val_loss` (fits to validation losses) is not offered.

`variant: paper`: the paper's form, with our rules where it is silent:
- The history: after the warmup, per domain, one point per `record_every` steps: the
  token-weighted mean of n over the steps the domain was drawn in, and its mean training loss
  over them (sum of loss sums / sum of tokens). A block mean has no lag (an EMA of the loss would
  trail n). When a domain holds more than `max_points`, adjacent pairs are merged
  (token-weighted), so old data grows coarse while the state stays small; the fit weights each
  point by its tokens.
- n counts sequences of the domain seen so far, including the step's own (never 0).
- The fit: least squares of log L from the best point of a grid over alpha in (0, alpha_max]
  (eps, beta by linear least squares for each alpha), polished by Levenberg-Marquardt in
  float64 with alpha in [0, alpha_max] and eps >= 0 (`huber_delta`: a Huber loss by iteratively
  reweighted least squares). Deterministic. Losses that do not fall give beta = 0: no learning
  potential. A fit that fails keeps the previous parameters.
- A domain with mu_k > 0 that has no fit yet (too few points) is given the largest fitted
  learning potential (optimism, so that it gets drawn and fitted); rho falls back to mu when
  every potential is 0.
- Draws are exact (`Needs()` default): ADO uses no importance weights, and exact counts make the
  realised mixture follow the policy within one sequence, so that n_k and the credit terms carry
  no sampling noise.
In either variant `count`, `credit`, `average` and `floor_on` may be set to the other's choice.

Cost: per step a few operations on k numbers (and, under `authors`, one float32 row of the
history); per refit the smoothing (k x rows x 101 multiply-adds) and the fit, whose L-BFGS over
k x 512 starts runs on the run's device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from doremi.methods.ado.config import VARIANT_CHOICES, ADOConfig
from doremi.methods.log import MethodLog
from trainer.config.tools import ConfigError
from trainer.run.hooks import MethodBase, MethodContext, Needs, StepSignals

#: Bounds of log beta in the fit (beta n^-alpha stays finite in float64).
LOG_BETA_BOUND = 100.0


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


def _fit_inputs(
    n: Sequence[float] | np.ndarray, loss: Sequence[float] | np.ndarray, weights: Sequence[float] | np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(n, loss, weights summing to 1) as float64 arrays; None for fewer than 3 points, shapes
    that differ, or a non-positive or non-finite value."""
    n = np.asarray(n, dtype=np.float64)
    y_lin = np.asarray(loss, dtype=np.float64)
    w = np.ones_like(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if n.shape != y_lin.shape or w.shape != n.shape or n.ndim != 1 or len(n) < 3:
        return None
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(y_lin)) and np.all(np.isfinite(w))):
        return None
    if np.any(n <= 0) or np.any(y_lin <= 0) or np.any(w <= 0):
        return None
    return n, y_lin, w / w.sum()


def _grid_start(
    logn: np.ndarray, y_lin: np.ndarray, w: np.ndarray, alpha_max: float, huber_delta: float | None, grid: int
) -> tuple[float, np.ndarray] | None:
    """(cost, theta) of the best start: for each alpha = alpha_max j / (grid - 1), eps and beta by
    weighted linear least squares of L on n^-alpha (eps clipped at 0), the alpha of least log
    cost; None when no alpha gives a falling law."""
    y = np.log(y_lin)
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
    return best


def _levenberg_marquardt(
    start: tuple[float, np.ndarray],
    logn: np.ndarray,
    y: np.ndarray,
    w: np.ndarray,
    alpha_max: float,
    huber_delta: float | None,
    max_iter: int,
) -> np.ndarray:
    """Theta refined from `start` by Levenberg-Marquardt on (log beta, alpha, eps), each step
    projected onto the bounds, until no step lowers the cost (or `max_iter` steps)."""
    cost, theta = start
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
    return theta


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
    inputs = _fit_inputs(n, loss, weights)
    if inputs is None:
        return None
    n, y_lin, w = inputs
    logn = np.log(n)
    start = _grid_start(logn, y_lin, w, alpha_max, huber_delta, grid)
    if start is None:
        return 0.0, 0.0, float(np.sum(w * y_lin))
    theta = _levenberg_marquardt(start, logn, np.log(y_lin), w, alpha_max, huber_delta, max_iter)
    beta, alpha, eps = math.exp(theta[0]), float(theta[1]), float(theta[2])
    if not all(math.isfinite(v) for v in (beta, alpha, eps)):
        return None
    return beta, alpha, eps


# --- the authors' history and fit (released code) --------------------------------------------

#: Savitzky-Golay window and polynomial order of the released history smoothing
#: (`compute_scaling_law_params`: `savgol_filter(self.task_loss_TxK.T, 101, 3, axis=-1)`).
SAVGOL_WINDOW, SAVGOL_ORDER = 101, 3
#: The released fit's Huber threshold on log residuals (`huber_loss`, delta=1e-3).
SOFT_HUBER = 1e-3
#: The released fit's soft bounds (`loss_fn`): alpha <= 0.8, log beta <= 6.5, log eps >= 0.5
#: (eps >= e^0.5 = 1.6487...), alpha >= 0 through -min(alpha, 0.001); each penalty has slope 1.
SOFT_ALPHA_MAX, SOFT_ALPHA_MIN, SOFT_LOG_BETA_MAX, SOFT_LOG_EPS_MIN = 0.8, 0.001, 6.5, 0.5
#: The released derivative floors the exponent (`curr_dist`: `np.maximum(params[:, 2], 0.05)`).
ALPHA_FLOOR = 0.05
#: The released optimiser: jaxopt `LBFGS(loss_fn, tol=1e-5, maxiter=200)` (its defaults: history 10,
#: at most 15 line-search steps).
LBFGS_TOL, LBFGS_MAXITER, LBFGS_HISTORY, LBFGS_MAXLS = 1e-5, 200, 10, 15
#: The line search's halvings 2^-lo .. 2^-(hi-1) tried together, group by group, for the rows
#: that still fail (fewer evaluations than one by one, less work than all at once).
LS_GROUPS = ((1, 3), (3, 7), (7, LBFGS_MAXLS))
#: Largest number of (start, point) pairs evaluated at once in the fit (memory bound).
FIT_CHUNK = 1 << 23


def start_grid() -> np.ndarray:
    """The released fit's 512 starting points (log beta, log eps, alpha) (`fit_scaling_law`:
    a in arange(-2, 6, 1), e in arange(-2, 2, 0.5), alpha in arange(0, 0.8, 0.1), float32,
    meshgrid 'ij' order)."""
    a = np.arange(-2, 6, 1, dtype=np.float32)
    e = np.arange(-2, 2, 0.5, dtype=np.float32)
    alpha = np.arange(0, 0.8, 0.1, dtype=np.float32)
    x, y, z = np.meshgrid(a, e, alpha, indexing="ij")
    return np.stack((x.ravel(), y.ravel(), z.ravel()), axis=1).astype(np.float64)


def smooth_history(loss_rows: np.ndarray) -> np.ndarray:
    """The released smoothing of the per-step loss history [T, k] along the steps:
    Savitzky-Golay, window 101, order 3 (scipy's `interp` edges). Ours where theirs would raise:
    a history shorter than 101 steps takes the largest odd window it holds, and one shorter than
    5 steps is left as it is."""
    from scipy.signal import savgol_filter

    rows = np.asarray(loss_rows, dtype=np.float64)
    window = min(SAVGOL_WINDOW, rows.shape[0] - (1 - rows.shape[0] % 2))
    if window <= SAVGOL_ORDER + 1:
        return rows.copy()
    return savgol_filter(rows, window, SAVGOL_ORDER, axis=0)


#: The four soft bounds as over = theta @ MAP + SHIFT, each penalised by max(over, 0):
#: alpha - 0.8, 0.001 - alpha, a - 6.5, 0.5 - e.
_PENALTY_MAP = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, -1.0], [1.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
_PENALTY_SHIFT = torch.tensor(
    [-SOFT_ALPHA_MAX, SOFT_ALPHA_MIN, -SOFT_LOG_BETA_MAX, SOFT_LOG_EPS_MIN], dtype=torch.float64
)


def _soft_value_grad(
    theta: torch.Tensor, logn: torch.Tensor, y: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The released `loss_fn` and its gradient for rows theta [m, 3] = (a, e, alpha) against
    their points logn, y = log L, w (1 real, 0 padding) [m, P]. Ties of max/min split the
    gradient in halves, as JAX's do."""
    a, e, alpha = theta[:, 0:1], theta[:, 1:2], theta[:, 2:3]
    u = a - alpha * logn
    top = torch.maximum(u, e)
    pu, pe = torch.exp(u - top), torch.exp(e - top)
    total = pu + pe
    r = y - (top + torch.log(total))
    big = r.abs() > SOFT_HUBER
    huber = torch.where(big, SOFT_HUBER * (r.abs() - 0.5 * SOFT_HUBER), 0.5 * r * r)
    dr = -torch.where(big, SOFT_HUBER * torch.sign(r), r) * w
    su, se = pu / total, pe / total
    value = (huber * w).sum(1)
    grad = torch.stack(((dr * su).sum(1), (dr * se).sum(1), -(dr * su * logn).sum(1)), dim=1)

    over = theta @ _PENALTY_MAP.to(theta.device) + _PENALTY_SHIFT.to(theta.device)
    slope = (over > 0).to(theta.dtype) + 0.5 * (over == 0).to(theta.dtype)
    value = value + torch.clamp(over, min=0.0).sum(1) - SOFT_ALPHA_MIN
    return value, grad + slope @ _PENALTY_MAP.T.to(theta.device)


def fit_soft_bounds(
    n: np.ndarray, loss: np.ndarray, valid: np.ndarray | None = None, device: torch.device | str = "cpu"
) -> np.ndarray:
    """The released fit: per row of n, loss [k, P] (valid [k, P] marks real points), minimise
    sum_j huber(log L_j - log(e^a n_j^-alpha + e^e)) plus the soft bounds (`loss_fn`) by L-BFGS
    from each of the 512 starts of `start_grid`, and keep the start of least final value
    (`fit_scaling_law`). Returns [k, 3] rows (beta, alpha, eps); NaN for a row with no valid point.

    Theirs is jaxopt's L-BFGS (zoom line search, float32, on TPU); ours is a batched L-BFGS in
    float64 with the same history (10), initial scaling s.y / y.y, stopping rule (gradient norm
    <= 1e-5) and iteration cap (200), and an Armijo backtracking line search from step 1. On the
    flat directions of this objective the two can stop at different points of near-equal value:
    the objective, the starts and the choice are theirs, the last digits of the parameters are not.
    Deterministic for a given device."""
    n = np.asarray(n, dtype=np.float64)
    loss = np.asarray(loss, dtype=np.float64)
    k, p = n.shape
    ok = np.ones((k, p), dtype=bool) if valid is None else np.asarray(valid, dtype=bool).copy()
    ok &= np.isfinite(n) & np.isfinite(loss) & (n > 0) & (loss > 0)
    out = np.full((k, 3), np.nan)
    rows = [i for i in range(k) if ok[i].any()]
    if not rows:
        return out
    dev = torch.device(device)
    f64 = torch.float64
    logn_k = torch.tensor(np.where(ok, np.log(np.where(ok, n, 1.0)), 0.0)[rows], dtype=f64, device=dev)
    y_k = torch.tensor(np.where(ok, np.log(np.where(ok, loss, 1.0)), 0.0)[rows], dtype=f64, device=dev)
    w_k = torch.tensor(ok[rows].astype(np.float64), dtype=f64, device=dev)
    grid = torch.tensor(start_grid(), dtype=f64, device=dev)
    g = grid.shape[0]
    owner = torch.arange(len(rows), device=dev).repeat_interleave(g)
    x = grid.repeat(len(rows), 1)
    chunk = max(1, FIT_CHUNK // max(p, 1))

    def evaluate(theta: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, grads = [], []
        for lo in range(0, idx.shape[0], chunk):
            part = idx[lo : lo + chunk]
            d = owner[part]
            v, gr = _soft_value_grad(theta[lo : lo + chunk], logn_k[d], y_k[d], w_k[d])
            values.append(v)
            grads.append(gr)
        return torch.cat(values), torch.cat(grads)

    every = torch.arange(x.shape[0], device=dev)
    f, grad = evaluate(x, every)
    m = LBFGS_HISTORY
    s_hist = torch.zeros(x.shape[0], m, 3, dtype=f64, device=dev)
    y_hist = torch.zeros_like(s_hist)
    rho = torch.zeros(x.shape[0], m, dtype=f64, device=dev)
    active = torch.isfinite(f) & (torch.linalg.vector_norm(grad, dim=1) > LBFGS_TOL)
    for _ in range(LBFGS_MAXITER):
        idx = torch.nonzero(active).squeeze(1)
        if idx.numel() == 0:
            break
        q = grad[idx].clone()
        sh, yh, rh = s_hist[idx], y_hist[idx], rho[idx]
        alphas = []
        for j in range(m - 1, -1, -1):
            aj = rh[:, j] * (sh[:, j] * q).sum(1)
            q -= aj[:, None] * yh[:, j]
            alphas.append(aj)
        yy = (yh[:, -1] * yh[:, -1]).sum(1)
        gamma = torch.where(rh[:, -1] > 0, 1.0 / (rh[:, -1] * torch.where(yy > 0, yy, 1.0)), 1.0)
        r = gamma[:, None] * q
        for j in range(m):
            bj = rh[:, j] * (yh[:, j] * r).sum(1)
            r += sh[:, j] * (alphas[m - 1 - j] - bj)[:, None]
        d = -r
        slope = (grad[idx] * d).sum(1)
        bad = ~(slope < 0)
        d[bad] = -grad[idx][bad]
        slope = torch.where(bad, -(grad[idx] * grad[idx]).sum(1), slope)
        # Backtracking: the first of the steps 1, 1/2, ..., 2^-(maxls-1) that passes Armijo's
        # test; step 1 for every row, then the halvings of `LS_GROUPS` for the rows still failing.
        f0, x0 = f[idx], x[idx]
        cand = x0 + d
        new_f, new_g = evaluate(cand, idx)
        done = torch.isfinite(new_f) & (new_f <= f0 + 1e-4 * slope)
        new_x = torch.where(done[:, None], cand, x0)
        new_f, new_g = torch.where(done, new_f, f0), torch.where(done[:, None], new_g, grad[idx])
        for lo, hi in LS_GROUPS:
            fail = torch.nonzero(~done).squeeze(1)
            if fail.numel() == 0:
                break
            steps = 0.5 ** torch.arange(lo, hi, dtype=f64, device=dev)
            trial = (x0[fail, None, :] + steps[None, :, None] * d[fail, None, :]).reshape(-1, 3)
            fv, gv = evaluate(trial, idx[fail].repeat_interleave(steps.shape[0]))
            fv, gv = fv.view(fail.shape[0], -1), gv.view(fail.shape[0], -1, 3)
            passed = torch.isfinite(fv) & (fv <= f0[fail, None] + 1e-4 * steps[None, :] * slope[fail, None])
            first = torch.argmax(passed.to(torch.int32), dim=1)
            hit = passed.any(dim=1)
            rows_hit, pick = fail[hit], first[hit]
            new_x[rows_hit] = trial.view(fail.shape[0], -1, 3)[hit, pick]
            new_f[rows_hit] = fv[hit, pick]
            new_g[rows_hit] = gv[hit, pick]
            done[rows_hit] = True
        s = new_x - x0
        yv = new_g - grad[idx]
        sy = (s * yv).sum(1)
        push = done & (sy > 1e-10)
        s_hist[idx] = torch.where(push[:, None, None], torch.cat((sh[:, 1:], s[:, None]), 1), sh)
        y_hist[idx] = torch.where(push[:, None, None], torch.cat((yh[:, 1:], yv[:, None]), 1), yh)
        rho[idx] = torch.where(
            push[:, None], torch.cat((rh[:, 1:], (1.0 / torch.where(push, sy, 1.0))[:, None]), 1), rh
        )
        x[idx], f[idx], grad[idx] = new_x, new_f, new_g
        active[idx] = done & (torch.linalg.vector_norm(new_g, dim=1) > LBFGS_TOL)
    f = torch.where(torch.isfinite(f), f, torch.full_like(f, math.inf)).view(len(rows), g)
    best = torch.argmin(f, dim=1)
    theta = x.view(len(rows), g, 3)[torch.arange(len(rows), device=dev), best].cpu().numpy()
    for j, i in enumerate(rows):
        out[i] = (math.exp(theta[j, 0]), theta[j, 2], math.exp(theta[j, 1]))
    return out


def released_speed(n: float, beta: float, alpha: float, eps: float) -> float:
    """The released learning potential (`curr_dist`): max(alpha, 0.05) (L(n) - eps) / n with
    L(n) = eps + beta n^-alpha at the unfloored alpha."""
    return max(alpha, ALPHA_FLOOR) * (power_law(n, beta, alpha, eps) - eps) / n


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
    """Owns the cumulative counts, the loss history (block means, or the authors' per-step rows),
    the fitted laws, h, pibar and the policy."""

    def __init__(self, cfg: ADOConfig, ctx: MethodContext):
        self.cfg = cfg
        self.authors = cfg.variant == "authors"
        self.choices = {name: cfg.choice(name) for name in VARIANT_CHOICES[cfg.variant]}
        self.needs = Needs(draws="random" if self.authors else "exact", host_signals=True)
        self.device = ctx.device
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
        # The authors' history: per-step loss rows from row0 on (the rows before it cannot reach a
        # kept point through the smoothing window), the last row, and the kept rows with their n.
        self.row0 = max(0, cfg.warmup - (SAVGOL_WINDOW - 1))
        self.rows = np.zeros((max(ctx.steps - self.row0, 16) if self.authors else 0, k), dtype=np.float32)
        self.row_count = 0
        self.last_loss: list[float] | None = None
        self.kept: list[int] = []
        self.kept_n: list[list[float]] = []

    def sampling_weights(self, step: int) -> np.ndarray:
        return self.policy.copy()

    def _n(self) -> np.ndarray:
        if self.choices["count"] == "total":
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

    def _record_row(self, row: int, sequences: list[int], tokens: list[float], loss_sum: list[float]) -> None:
        """The released history (`update`): each domain's mean loss of the step, as float32 (their
        `task_loss_TxK`); a domain absent from the batch repeats its previous loss, or takes the
        batch's mean loss on the first step; the kept rows are row >= warmup every record_every-th
        (their `[ignore_steps::10]`), with n as of that row (their cumulative counts)."""
        mean = sum(loss_sum) / sum(tokens) if sum(tokens) > 0 else 0.0
        loss = np.array(
            [
                loss_sum[i] / tokens[i]
                if sequences[i] > 0 and tokens[i] > 0
                else (self.last_loss[i] if self.last_loss is not None else mean)
                for i in range(self.k)
            ],
            dtype=np.float32,
        )
        self.last_loss = [float(v) for v in loss]
        if row >= self.row0:
            if self.row_count == self.rows.shape[0]:
                self.rows = np.concatenate((self.rows, np.zeros_like(self.rows)), axis=0)
            self.rows[self.row_count] = loss
            self.row_count += 1
        if row >= self.cfg.warmup and (row - self.cfg.warmup) % self.cfg.record_every == 0:
            self.kept.append(row)
            self.kept_n.append(self._n().tolist())

    def _refit_authors(self) -> None:
        """The released refit (`compute_scaling_law_params`): the smoothed history at the kept
        rows, every domain fitted at once; a fit with a NaN or inf anywhere is dropped whole
        (`check_valid`)."""
        if not self.kept:
            return
        smooth = smooth_history(self.rows[: self.row_count])
        at = np.asarray(self.kept) - self.row0
        loss = smooth[at].T
        n = np.asarray(self.kept_n, dtype=np.float64).T
        valid = np.repeat(self.mask[:, None], len(at), axis=1)
        fit = fit_soft_bounds(n, loss, valid, self.device)
        if not np.all(np.isfinite(fit[self.mask])):
            return
        for i in range(self.k):
            if self.mask[i]:
                self.params[i] = [float(v) for v in fit[i]]

    def _refit(self) -> None:
        if self.authors:
            self._refit_authors()
            return
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
            if self.authors:
                speed[i] = released_speed(max(n[i], 1.0), beta, alpha, eps)
            else:
                speed[i] = float(learning_speed(max(n[i], 1.0), beta, alpha, eps))
        top = float(speed[fitted].max())
        for i in range(self.k):
            if self.params[i] is None and self.mask[i]:
                speed[i] = top
        return speed

    def after_step(self, step: int, signals: StepSignals) -> dict[str, Any]:
        cfg = self.cfg
        host = signals.on_host()
        sequences = [int(s) for s in np.asarray(signals.sequences).tolist()]
        tokens = host.tokens.tolist()
        loss_sum = host.loss_sum.tolist()
        used = self.policy
        # The policy as drawn: less what the run's epoch caps moved (data/sampling/sampler.py); the
        # policy itself while no cap binds. The credit and the log read it; pibar averages the policy.
        drawn = np.asarray(signals.weights, dtype=np.float64)
        for i, s in enumerate(sequences):
            self.seen[i] += s
        self.total += sum(sequences)
        if self.authors:
            self._record_row(step - 1, sequences, tokens, loss_sum)
        elif step > cfg.warmup:
            self._record(sequences, tokens, loss_sum)

        if self.choices["credit"] == "counts" and sum(sequences) > 0:
            self.h = credit_update(
                self.h, np.asarray(sequences, dtype=np.float64) / sum(sequences), cfg.credit_smoothing
            )
        else:
            self.h = credit_update(self.h, drawn, cfg.credit_smoothing)
        if self.choices["average"] == "policy":
            self.average = running_mean(self.average, self.average_count, used)
            self.average_count += 1

        if self.authors:
            # their `update` at the 0-based step itr = step - 1: itr >= start_step, itr % update_interval == 0
            refit = step - 1 >= cfg.warmup and (step - 1) % cfg.refit_every == 0
        else:
            refit = step > cfg.warmup and (step - cfg.warmup) % cfg.refit_every == 0
        if refit:
            self._refit()

        speed = self._speeds()
        if speed is None:
            self.rho = None
            policy = self.mu.copy()
            if self.choices["average"] == "preference":
                self.average = running_mean(self.average, self.average_count, self.mu)
                self.average_count += 1
        else:
            rho = preference(self.mu, self.h, cfg.credit_exponent, speed)
            if self.choices["floor_on"] == "preference":
                rho = floor_clip(rho, cfg.floor, self.mask)
            self.rho = rho
            policy = mix_policy(rho, self.average, cfg.policy_mix)
            if self.choices["average"] == "preference":
                self.average = running_mean(self.average, self.average_count, rho)
                self.average_count += 1
            if self.choices["floor_on"] == "policy":
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
                "sampling": drawn.tolist(),
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
            **(
                {
                    "rows": torch.from_numpy(self.rows[: self.row_count].copy()),
                    "last_loss": self.last_loss,
                    "kept": list(self.kept),
                    "kept_n": [list(v) for v in self.kept_n],
                }
                if self.authors
                else {}
            ),
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
        if self.authors:
            rows = torch.as_tensor(state["rows"], dtype=torch.float32).numpy()
            self.row_count = rows.shape[0]
            self.rows = np.zeros((max(self.rows.shape[0], 2 * self.row_count), self.k), dtype=np.float32)
            self.rows[: self.row_count] = rows
            self.last_loss = None if state["last_loss"] is None else [float(v) for v in state["last_loss"]]
            self.kept = [int(v) for v in state["kept"]]
            self.kept_n = [[float(x) for x in v] for v in state["kept_n"]]

    def close(self) -> None:
        self.log.close()
