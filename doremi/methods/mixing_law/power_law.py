"""Power laws of a loss in training tokens (the step law) or in model size (the size law), the
two extrapolations of data mixing laws' nested pipeline (Ye et al., ICLR 2025, Sec. 4; released
code github yegcjs/mixinglaws at commit 8ad3e1244b53294ded55a96ae325f4112ce3bc63):

    L(x) = exp(log_c) + exp(alpha (log x0 - log x)) = c + (x0 / x)^alpha

(`pipeline/utils.py` L99-101 `power_law_`), fitted to g curves at once with their own (log c,
log x0) and one shared exponent alpha (`power_law_share_alpha_`, L104-108). The step law ties alpha
across the validation domains of one mixture (`pipeline/run.sh` L5 `--tie_alpha valid`,
`steplaw.py` L118-152), the size law across every mixture and domain (`run.sh` L8 `--tie_alpha
all`, `sizelaw.py` L50-82). The objective is the authors' Huber loss on the residuals, summed
(`law.py` L39; delta 0.05 for steps, `steplaw.py` L128, and 0.08 for sizes, `sizelaw.py` L63;
`huber_loss`).

Differences from the released fit, each a choice of optimiser, not of law: the authors run
L-BFGS (`law.py` L34) from thousands of random starts (`steplaw.py` L20-24, `sizelaw.py` L17-21)
and keep the parameters with the lowest Huber loss on the last `valid_split` points
(`law.py` L28-33, L63-66). Here the fit is exact up to a one-dimensional search: at a fixed
alpha each curve is linear in (c, x0^alpha), solved by reweighted least squares, so only alpha is
searched (`fit_power_law`), deterministic and without starts. The points the authors hold out
for selection are here a held-out check instead (`held_out_tail`), reported with the fit, and the
law used is fitted on every point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from doremi.offline.fit.checks import FitError

#: Bounds of the shared exponent.
ALPHA_BOUNDS = (1e-3, 10.0)
#: Huber deltas of the released code: steps (`steplaw.py` L128), sizes (`sizelaw.py` L63).
STEP_DELTA = 0.05
SIZE_DELTA = 0.08


@dataclass(frozen=True)
class PowerLaw:
    """g fitted curves c_j + (x0_j / x)^alpha: `log_c` [g], `log_x0` [g], `alpha` (shared),
    `rmse` [g] (each curve's residual on the points it was fitted to)."""

    log_c: np.ndarray
    log_x0: np.ndarray
    alpha: float
    rmse: np.ndarray

    def predict(self, x: Any) -> np.ndarray:
        """L_j(x) for x [p] (every curve at the same points) or [p, g] -> [p, g]."""
        return power_law(x, self.log_c, self.log_x0, self.alpha)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready parameters."""
        return {
            "log_c": self.log_c.tolist(),
            "log_x0": self.log_x0.tolist(),
            "alpha": float(self.alpha),
            "rmse": self.rmse.tolist(),
        }


@dataclass(frozen=True)
class TailCheck:
    """A law fitted without each curve's last `held` points (`fitted_on` before them), and its
    error predicting them: `mae` and `max_abs` over every held-out point of every curve."""

    held: int
    fitted_on: int
    mae: float
    max_abs: float

    def to_dict(self) -> dict[str, Any]:
        return {"held": self.held, "fitted_on": self.fitted_on, "mae": self.mae, "max_abs": self.max_abs}


def power_law(x: Any, log_c: Any, log_x0: Any, alpha: float) -> np.ndarray:
    """exp(log_c) + exp(alpha (log x0 - log x)) (released `pipeline/utils.py` L104-108) for x
    [p] or [p, g] -> [p, g]."""
    x = np.asarray(x, dtype=np.float64)
    log_c, log_x0 = np.asarray(log_c, dtype=np.float64), np.asarray(log_x0, dtype=np.float64)
    lx = np.log(x)[:, None] if x.ndim == 1 else np.log(x)
    return np.exp(log_c) + np.exp(alpha * (log_x0 - lx))


def huber_loss(residuals: Any, delta: float) -> float:
    """sum_j 0.5 r_j^2 (|r_j| <= delta), delta (|r_j| - delta / 2) (beyond): the released fit's
    objective (`law.py` L39, `torch.nn.functional.huber_loss(..., reduction="sum")`), which is
    `least_squares(loss="huber", f_scale=delta)`'s cost."""
    r = np.abs(np.asarray(residuals, dtype=np.float64))
    return float(np.sum(np.where(r <= delta, 0.5 * r**2, delta * (r - 0.5 * delta))))


def _as_curves(x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 2 or y.shape[0] < 2 or y.shape[1] < 1:
        raise FitError(f"power law: expected losses [p points, g curves] with p >= 2, got shape {y.shape}")
    x = np.asarray(x, dtype=np.float64)
    x = np.broadcast_to(x[:, None], y.shape) if x.ndim == 1 and x.shape[0] == y.shape[0] else x
    if x.shape != y.shape:
        raise FitError(f"power law: expected x [{y.shape[0]}] or {list(y.shape)}, got shape {x.shape}")
    if not (np.all(np.isfinite(x)) and np.all(x > 0) and np.all(np.isfinite(y)) and np.all(y > 0)):
        raise FitError("power law: expected finite positive x and losses")
    return x, y


#: Newton iterations of the inner (c, b) fit at a fixed exponent, and halvings of a step.
INNER_ITERATIONS = 30
HALVINGS = 30
#: Log-spaced exponents where the profile is first evaluated, before Brent's refinement.
ALPHA_GRID = 30
#: Floor of c and of b = x0^alpha (the released form takes their logs).
FLOOR = 1e-12


def _column_huber(r: np.ndarray, delta: float) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r**2, delta * (a - 0.5 * delta)).sum(0)


def _inner(z: np.ndarray, y: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray, float]:
    """At a fixed exponent each curve is linear, y = c + b z with z = x^-alpha: its Huber fit,
    every curve at once (z, y [p, g]) -> c [g], b [g], cost. The objective is convex and
    piecewise quadratic in (c, b): Newton's method with step halving from the least-squares
    solution (the answer itself when every residual is within delta), c and b kept >= FLOOR; a
    residual beyond delta contributes IRLS's curvature delta / |r| (Huber's own is 0 there), so
    that the step exists when few points are within delta."""
    n = y.shape[0]
    zm, ym = z.mean(0), y.mean(0)
    var = ((z - zm) ** 2).sum(0)
    b = np.maximum(np.where(var > 0, ((z - zm) * (y - ym)).sum(0) / np.where(var > 0, var, 1.0), FLOOR), FLOOR)
    c = np.maximum(ym - b * zm, FLOOR)
    cost = _column_huber(c + b * z - y, delta)
    for _ in range(INNER_ITERATIONS):
        r = c + b * z - y
        inl = np.minimum(1.0, delta / np.maximum(np.abs(r), 1e-300))  # 1 within delta: Newton; else IRLS's curvature
        psi = np.where(np.abs(r) <= delta, r, delta * np.sign(r))
        g0, g1 = psi.sum(0), (psi * z).sum(0)
        h00 = inl.sum(0) + 1e-12 * n
        h01 = (inl * z).sum(0)
        h11 = (inl * z * z).sum(0) + 1e-12 * (z * z).sum(0)
        det = h00 * h11 - h01**2
        det = np.where(det > 0, det, 1.0)
        dc, db = -(h11 * g0 - h01 * g1) / det, -(h00 * g1 - h01 * g0) / det
        at_c, at_b = (c <= FLOOR) & (dc < 0), (b <= FLOOR) & (db < 0)  # a bound holds: Newton in the other
        dc, db = np.where(at_c, 0.0, np.where(at_b, -g0 / h00, dc)), np.where(at_b, 0.0, np.where(at_c, -g1 / h11, db))
        step = np.ones_like(c)
        for _ in range(HALVINGS):
            nc, nb = np.maximum(c + step * dc, FLOOR), np.maximum(b + step * db, FLOOR)
            new = _column_huber(nc + nb * z - y, delta)
            worse = new > cost
            if not worse.any():
                break
            step = np.where(worse, step / 2, step)
        keep = new <= cost
        gain = np.where(keep, cost - new, 0.0)
        c, b, cost = np.where(keep, nc, c), np.where(keep, nb, b), np.where(keep, new, cost)
        if np.all(gain <= 1e-15 * (cost + 1e-300)):
            break
    return c, b, float(cost.sum())


def fit_power_law(x: Any, y: Any, delta: float = STEP_DELTA) -> PowerLaw:
    """Fit g curves y[:, j] ~ c_j + (x0_j / x[:, j])^alpha with alpha shared, by the Huber loss
    of scale `delta` (the module's docstring); x [p] or [p, g], y [p, g]. At a fixed alpha every
    curve is linear in (c, x0^alpha), so the fit is a one-dimensional search of alpha over the
    inner fits' cost (variable projection): a log grid on `ALPHA_BOUNDS`, then Brent's method
    between the best point's neighbours."""
    from scipy.optimize import minimize_scalar

    x, y = _as_curves(x, y)
    scale = float(np.exp(np.log(x).mean()))
    lx = np.log(x / scale)

    def profile(log_alpha: float) -> float:
        return _inner(np.exp(-np.exp(log_alpha) * lx), y, delta)[2]

    grid = np.linspace(np.log(ALPHA_BOUNDS[0]), np.log(ALPHA_BOUNDS[1]), ALPHA_GRID)
    costs = [profile(a) for a in grid]
    i = int(np.argmin(costs))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, ALPHA_GRID - 1)]
    sol = minimize_scalar(profile, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12, "maxiter": 500})
    log_alpha = float(sol.x) if sol.fun <= costs[i] else float(grid[i])
    alpha = float(np.exp(log_alpha))
    c, b, _ = _inner(np.exp(-alpha * lx), y, delta)
    law = PowerLaw(log_c=np.log(c), log_x0=np.log(b) / alpha + np.log(scale), alpha=alpha, rmse=np.zeros(y.shape[1]))
    rmse = np.sqrt(np.mean((law.predict(x) - y) ** 2, axis=0))
    return PowerLaw(log_c=law.log_c, log_x0=law.log_x0, alpha=alpha, rmse=rmse)


def held_out_tail(x: Any, y: Any, held: int, delta: float = STEP_DELTA) -> TailCheck:
    """Fit without the last `held` points of every curve (the largest x: the step law's last
    evaluations, the size law's largest proxy) and measure the error predicting them: the
    extrapolation the law is used for, on points it did not see."""
    x, y = _as_curves(x, y)
    p = y.shape[0]
    if held < 1 or p - held < 2:
        raise FitError(f"power law check: {p} points per curve are too few to hold out {held} (2 must remain)")
    law = fit_power_law(x[:-held], y[:-held], delta)
    err = np.abs(law.predict(x[-held:]) - y[-held:])
    return TailCheck(held=held, fitted_on=p - held, mae=float(err.mean()), max_abs=float(err.max()))
