"""Data mixing laws (Ye et al., ICLR 2025, "Data Mixing Laws: Optimizing Data Mixtures by
Predicting Language Modeling Performance"): fit and minimiser.

Per validation domain i (Eq. 2 there, for k training domains with proportions r on the simplex):

    L_i(r) = c_i + k_i exp(sum_j t_ij r_j)

and the target (Eq. 3) is a weighted sum of the domain laws, L(r) = sum_i s_i L_i(r), with s_i the
target's proportions (default here: uniform, the mean over validation domains).

Gauge: on the simplex sum_j r_j = 1, so (k_i, t_i) and (k_i e^b, t_i - b) give the same law. The
fitted law is reported in the canonical gauge sum_j t_ij = 0, where k_i = L_i(uniform) - c_i is
the reducible loss at the uniform mixture (`canonical`). Internally each domain is fitted as
L_i(r) = c_i + exp(a_i . r), a_ij = t_ij + log k_i, which has no redundant parameter.

Fit: `scipy.optimize.least_squares` (trust region, analytic Jacobian) on the residuals, from
several deterministic starts: for each guess c0 of c below min(L), a0 is the linear least squares
solution of log(L - c0) = a . r; the start whose fit has the lowest cost wins. The authors'
code (github yegcjs/mixinglaws, `law.py`) minimises a Huber loss (delta 0.05 in
`mix_5_domains.ipynb`) with L-BFGS from a grid of random starts; `loss="huber"` with
`f_scale=0.05` is that objective, plain least squares the default. `fit.mixing_law.variant:
authors` (doremi/offline/propose.py) fits with the authors' objective, and to the losses their nested
pipeline extrapolates to the main run (`nested.py`), not to the proxies' own.

Proposer: L(r) is a positive combination of exponentials of linear functions of r, hence convex,
so its minimum over the capped simplex {r >= 0, sum r = 1, r_i <= u_i} (caps u_i from epoch
limits, `doremi.offline.fit.design.epoch_caps`) is found by SLSQP; several starts guard against a bad stop, and the
result is projected back onto the feasible set. The authors search a grid of the simplex
(`pipeline/find_opt.py`); the convex solve is exact where the grid is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from doremi.offline.fit.checks import FitError, as_caps, as_losses, as_mixtures

#: Guesses of c below the smallest observed loss, in units of the losses' spread (max - min).
C_OFFSETS = (0.01, 0.1, 0.3, 1.0, 3.0)
#: Exponents are clipped here in the residuals, so that a wild trial step cannot overflow.
MAX_EXPONENT = 600.0


@dataclass(frozen=True)
class MixingLawOptions:
    """Fit settings: `loss` and `f_scale` as `scipy.optimize.least_squares` ("linear": least
    squares; "huber", f_scale=0.05: the authors' objective); `c_offsets`: the starts (see
    `C_OFFSETS`); `max_nfev`: evaluations per start."""

    loss: Literal["linear", "huber", "soft_l1", "cauchy"] = "linear"
    f_scale: float = 0.05
    c_offsets: tuple[float, ...] = C_OFFSETS
    max_nfev: int = 5000


@dataclass(frozen=True)
class MixingLaw:
    """Fitted laws of m validation domains over k training domains, canonical gauge: `c` [m],
    `k` [m], `t` [m, k] (rows summing to 0); `rmse` [m]: each domain's fit residual."""

    c: np.ndarray
    k: np.ndarray
    t: np.ndarray
    rmse: np.ndarray

    def domain_losses(self, weights: Any) -> np.ndarray:
        """Predicted L_i(r) for mixtures [n, k] (or one mixture [k]) -> [n, m] (or [m])."""
        return domain_losses(self, weights)

    def target(self, weights: Any, target_weights: Any = None) -> np.ndarray:
        """Predicted L(r) = sum_i s_i L_i(r) (default s: uniform over the m domains)."""
        return target_loss(self, weights, target_weights)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready parameters."""
        return {"c": self.c.tolist(), "k": self.k.tolist(), "t": self.t.tolist(), "rmse": self.rmse.tolist()}


@dataclass(frozen=True)
class MixingLawProposal:
    """The minimiser of the predicted target over the capped simplex and its predicted loss."""

    weights: np.ndarray
    predicted: float


def canonical(c: Any, k: Any, t: Any) -> MixingLaw:
    """The law c_i + k_i exp(t_i . r) in the gauge sum_j t_ij = 0 (the same function on the simplex)."""
    c, k, t = (np.atleast_1d(np.asarray(x, dtype=np.float64)) for x in (c, k, t))
    t = np.atleast_2d(t)
    if np.any(k <= 0) or c.shape != k.shape or t.shape[0] != c.shape[0]:
        raise FitError(f"mixing law: expected c [m], k [m] > 0, t [m, k], got {c.shape}, {k.shape}, {t.shape}")
    shift = t.mean(axis=1)
    return MixingLaw(c=c, k=k * np.exp(shift), t=t - shift[:, None], rmse=np.zeros_like(c))


def domain_losses(law: MixingLaw, weights: Any) -> np.ndarray:
    """L_i(r) = c_i + k_i exp(sum_j t_ij r_j) (Ye et al. 2025, Eq. 2) for r [n, k] or [k]."""
    r = np.asarray(weights, dtype=np.float64)
    if r.shape[-1:] != law.t.shape[1:]:
        raise FitError(f"weights: expected {law.t.shape[1]} values per mixture, got shape {r.shape}")
    return law.c + law.k * np.exp(r @ law.t.T)


def _target_weights(target_weights: Any, m: int) -> np.ndarray:
    if target_weights is None:
        return np.full(m, 1.0 / m)
    s = np.asarray(target_weights, dtype=np.float64)
    if s.shape != (m,) or not np.all(np.isfinite(s)) or np.any(s < 0) or s.sum() <= 0:
        raise FitError(f"target_weights: expected {m} finite non-negative values, not all 0, got {s.tolist()}")
    return s


def target_loss(law: MixingLaw, weights: Any, target_weights: Any = None) -> np.ndarray:
    """L(r) = sum_i s_i L_i(r) (Ye et al. 2025, Eq. 3); default s_i = 1/m."""
    return domain_losses(law, weights) @ _target_weights(target_weights, law.c.size)


def _fit_one(r: np.ndarray, y: np.ndarray, options: MixingLawOptions) -> tuple[float, np.ndarray, float]:
    from scipy.optimize import least_squares

    spread = float(y.max() - y.min())
    scale = max(spread, 1e-3 * abs(float(y.mean())), 1e-12)

    def residuals(p: np.ndarray) -> np.ndarray:
        return p[0] + np.exp(np.minimum(r @ p[1:], MAX_EXPONENT)) - y

    def jacobian(p: np.ndarray) -> np.ndarray:
        e = np.exp(np.minimum(r @ p[1:], MAX_EXPONENT))
        return np.concatenate([np.ones((r.shape[0], 1)), e[:, None] * r], axis=1)

    best: tuple[float, np.ndarray] | None = None
    for off in options.c_offsets:
        c0 = float(y.min()) - off * scale
        a0 = np.linalg.lstsq(r, np.log(y - c0), rcond=None)[0]
        sol = least_squares(
            residuals,
            np.concatenate([[c0], a0]),
            jac=jacobian,
            method="trf",
            loss=options.loss,
            f_scale=options.f_scale,
            x_scale="jac",
            ftol=1e-15,
            xtol=1e-15,
            gtol=1e-15,
            max_nfev=options.max_nfev,
        )
        if np.all(np.isfinite(sol.x)) and (best is None or sol.cost < best[0]):
            best = (float(sol.cost), sol.x)
    if best is None:
        raise FitError("mixing law: the fit did not converge from any start")
    p = best[1]
    rmse = float(np.sqrt(np.mean(residuals(p) ** 2)))
    return float(p[0]), p[1:], rmse


def fit_mixing_law(weights: Any, losses: Any, options: MixingLawOptions | None = None) -> MixingLaw:
    """Fit L_i(r) = c_i + k_i exp(t_i . r) to runs' mixtures `weights` [n, k] and losses [n, m]
    (or [n]: one law for a single target, m = 1); n must be at least k + 2 (k + 1 parameters per
    domain). Returned in the canonical gauge (see the module's docstring)."""
    options = options or MixingLawOptions()
    r = as_mixtures(weights)
    y = as_losses(losses, r.shape[0])
    y2 = y[:, None] if y.ndim == 1 else y
    n, k = r.shape
    if n < k + 2:
        raise FitError(f"mixing law: {n} runs are too few for {k} domains; expected at least {k + 2}")
    if not options.c_offsets or any(not (math.isfinite(o) and o > 0) for o in options.c_offsets):
        raise FitError(f"c_offsets: expected positive numbers, got {options.c_offsets}")
    fits = [_fit_one(r, y2[:, i], options) for i in range(y2.shape[1])]
    law = canonical([f[0] for f in fits], [1.0] * len(fits), np.stack([f[1] for f in fits]))
    return MixingLaw(c=law.c, k=law.k, t=law.t, rmse=np.array([f[2] for f in fits]))


def project_capped_simplex(v: Any, caps: Any = None) -> np.ndarray:
    """The Euclidean projection of v onto {r : 0 <= r_i <= u_i, sum r = 1}: r = clip(v - tau, 0, u)
    with tau found by bisection (the sum is monotone in tau)."""
    v = np.asarray(v, dtype=np.float64)
    u = as_caps(caps, v.size)
    lo, hi = float(v.min() - 1.0), float(v.max())
    for _ in range(200):
        tau = 0.5 * (lo + hi)
        if np.clip(v - tau, 0.0, u).sum() > 1.0:
            lo = tau
        else:
            hi = tau
    r = np.clip(v - 0.5 * (lo + hi), 0.0, u)
    return r / r.sum()


def propose_mixing_law(
    law: MixingLaw,
    *,
    target_weights: Any = None,
    caps: Sequence[float] | np.ndarray | None = None,
    starts: Any = None,
) -> MixingLawProposal:
    """argmin over {r >= 0, sum r = 1, r <= caps} of L(r) = sum_i s_i L_i(r) (SLSQP with the
    analytic gradient sum_i s_i k_i exp(t_i . r) t_i, from the capped uniform mixture, each capped
    smoothed one-hot mixture and any given `starts` [p, k]; the best result, projected onto the
    feasible set)."""
    from scipy.optimize import minimize

    kk = law.t.shape[1]
    u = as_caps(caps, kk)
    s = _target_weights(target_weights, law.c.size)
    sk = s * law.k

    def value(r: np.ndarray) -> float:
        return float(s @ law.c + sk @ np.exp(law.t @ r))

    def grad(r: np.ndarray) -> np.ndarray:
        return (sk * np.exp(law.t @ r)) @ law.t

    seeds = [np.full(kk, 1.0 / kk)] + [np.where(np.arange(kk) == i, 0.9, 0.1 / (kk - 1)) for i in range(kk)]
    if starts is not None:
        seeds += list(as_mixtures(np.atleast_2d(starts), "starts"))
    best: tuple[float, np.ndarray] | None = None
    for x0 in seeds:
        sol = minimize(
            value,
            project_capped_simplex(x0, u),
            jac=grad,
            method="SLSQP",
            bounds=[(0.0, float(b)) for b in u],
            constraints=[{"type": "eq", "fun": lambda r: r.sum() - 1.0, "jac": lambda r: np.ones_like(r)}],
            options={"ftol": 1e-14, "maxiter": 1000},
        )
        r = project_capped_simplex(sol.x, u)
        f = value(r)
        if best is None or f < best[0] - 1e-15:
            best = (f, r)
    assert best is not None
    return MixingLawProposal(weights=best[1], predicted=best[0])


def mixing_law_fit_predict(options: MixingLawOptions | None = None) -> Any:
    """A `doremi.offline.fit.evaluate.FitPredict` for its `held_out`: fit on the train runs, predict the test
    runs' losses in the train losses' shape ([n] or [n, m])."""

    def fit_predict(r_train: np.ndarray, y_train: np.ndarray, r_test: np.ndarray) -> np.ndarray:
        pred = fit_mixing_law(r_train, y_train, options).domain_losses(r_test)
        return pred[:, 0] if y_train.ndim == 1 else pred

    return fit_predict
