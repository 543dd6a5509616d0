"""Held-out evaluation of a mixture fit: K-fold cross-validation over the sweep's runs.

Each run's target is predicted by a fit that did not see it (its fold left out); the report is the
Spearman rank correlation and the mean absolute error of those out-of-fold predictions against
the observed targets. Rank correlation is what matters for choosing a mixture, and it is RegMix's
fit metric (Liu et al., ICLR 2025, Sec. 3, Table 1: Spearman rho on unseen mixtures); the mean
absolute error is data mixing laws' (Ye et al., ICLR 2025, Fig. 5: absolute errors on held-out
mixtures).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from doremi.offline.fit.checks import FitError, as_losses, as_mixtures

#: fit_predict(train weights [n_tr, k], train losses [n_tr] or [n_tr, m], test weights [n_te, k])
#: -> predicted losses for the test weights, shaped as the train losses' rows.
FitPredict = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]

#: Default number of folds (5-fold cross-validation).
DEFAULT_FOLDS = 5


@dataclass(frozen=True)
class HeldOut:
    """Out-of-fold quality of a fit: `spearman` (rank correlation, nan when a side is constant),
    `mae` (mean absolute error), over `n` runs in `folds` folds drawn with `seed`."""

    spearman: float
    mae: float
    folds: int
    n: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (nan becomes None)."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def kfold_indices(n: int, folds: int = DEFAULT_FOLDS, seed: int = 0) -> list[np.ndarray]:
    """The test indices of each fold: a permutation of range(n) by `default_rng(seed)`, cut into
    `folds` nearly equal parts (sizes differ by at most 1), each part sorted."""
    if not isinstance(folds, int | np.integer) or folds < 2:
        raise FitError(f"folds: expected an integer >= 2, got {folds}")
    if n < 2 * folds:
        raise FitError(f"held-out evaluation: {n} runs are too few for {folds} folds; expected at least {2 * folds}")
    perm = np.random.default_rng(seed).permutation(n)
    return [np.sort(part) for part in np.array_split(perm, folds)]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when either side is constant."""
    from scipy.stats import rankdata

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise FitError(f"spearman: expected two vectors of one shape, got {a.shape} and {b.shape}")
    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float(ra @ ra) * float(rb @ rb))
    return float(ra @ rb) / den if den > 0 else math.nan


def target_of(losses: np.ndarray, target_weights: np.ndarray | None = None) -> np.ndarray:
    """The scalar target per run: the losses themselves [n], or sum_i w_i L_i for per-domain losses
    [n, m] (default w: uniform, the mean over validation domains)."""
    if losses.ndim == 1:
        return losses
    m = losses.shape[1]
    w = np.full(m, 1.0 / m) if target_weights is None else np.asarray(target_weights, dtype=np.float64)
    if w.shape != (m,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise FitError(
            f"target_weights: expected {m} finite non-negative values, not all 0, got {np.asarray(w).tolist()}"
        )
    return losses @ w


def held_out(
    fit_predict: FitPredict,
    weights: Any,
    losses: Any,
    *,
    folds: int = DEFAULT_FOLDS,
    seed: int = 0,
    target_weights: Any = None,
) -> HeldOut:
    """K-fold held-out Spearman and MAE of `fit_predict` on the target (see `target_of`), each run
    predicted by the fit on the other folds."""
    r = as_mixtures(weights)
    y = as_losses(losses, r.shape[0])
    pred = np.empty_like(y)
    for test in kfold_indices(r.shape[0], folds, seed):
        train = np.setdiff1d(np.arange(r.shape[0]), test)
        out = np.asarray(fit_predict(r[train], y[train], r[test]), dtype=np.float64)
        if out.shape != (len(test),) + y.shape[1:]:
            raise FitError(f"fit_predict: expected predictions of shape {(len(test),) + y.shape[1:]}, got {out.shape}")
        pred[test] = out
    tw = None if target_weights is None else np.asarray(target_weights, dtype=np.float64)
    true_t, pred_t = target_of(y, tw), target_of(pred, tw)
    return HeldOut(
        spearman=spearman(pred_t, true_t),
        mae=float(np.mean(np.abs(pred_t - true_t))),
        folds=int(folds),
        n=int(r.shape[0]),
        seed=int(seed),
    )
