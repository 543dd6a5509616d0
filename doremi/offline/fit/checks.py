"""Input checks shared by the fits: one-line errors naming what was expected and what was given."""

from __future__ import annotations

from typing import Any

import numpy as np

from doremi.errors import DoReMiError

#: How far a row of weights may sum from 1.
SUM_TOLERANCE = 1e-6


class FitError(DoReMiError):
    """Bad input to a mixture fit, design or proposer (a ValueError with a one-line message)."""


def as_mixtures(weights: Any, what: str = "weights") -> np.ndarray:
    """`weights` as a float64 array [n, k] of distributions (finite, non-negative, rows summing to 1)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 2:
        raise FitError(f"{what}: expected an array [n runs, k >= 2 domains], got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise FitError(f"{what}: expected finite non-negative weights, got {np.sum(~np.isfinite(w) | (w < 0))} bad")
    bad = np.abs(w.sum(axis=1) - 1.0) > SUM_TOLERANCE
    if np.any(bad):
        row = int(np.argmax(bad))
        raise FitError(f"{what}: expected rows summing to 1, row {row} sums to {w[row].sum():.6g}")
    return w


def as_distribution(values: Any, k: int, what: str) -> np.ndarray:
    """`values` as a float64 distribution over `k` domains (positive entries, normalised to sum 1)."""
    v = np.asarray(values, dtype=np.float64)
    if v.shape != (k,):
        raise FitError(f"{what}: expected {k} values (one per domain), got shape {v.shape}")
    if not np.all(np.isfinite(v)) or np.any(v <= 0):
        raise FitError(f"{what}: expected finite positive values, got {v.tolist()}")
    return v / v.sum()


def as_losses(losses: Any, n: int, what: str = "losses") -> np.ndarray:
    """`losses` as a finite float64 array [n] or [n, m] (one row per run)."""
    y = np.asarray(losses, dtype=np.float64)
    if y.ndim not in (1, 2) or y.shape[0] != n or (y.ndim == 2 and y.shape[1] < 1):
        raise FitError(f"{what}: expected an array [{n}] or [{n}, m] (one row per run), got shape {y.shape}")
    if not np.all(np.isfinite(y)):
        raise FitError(f"{what}: expected finite values, got {int(np.sum(~np.isfinite(y)))} NaN or infinite")
    return y


def as_caps(caps: Any, k: int) -> np.ndarray:
    """Per-domain upper bounds on a weight in (0, 1], able to hold a distribution (sum >= 1); None: no caps."""
    if caps is None:
        return np.ones(k)
    u = np.asarray(caps, dtype=np.float64)
    if u.shape != (k,):
        raise FitError(f"caps: expected {k} values (one per domain), got shape {u.shape}")
    if not np.all(np.isfinite(u)) or np.any(u <= 0):
        raise FitError(f"caps: expected finite positive values, got {u.tolist()}")
    u = np.minimum(u, 1.0)
    if u.sum() < 1.0 - SUM_TOLERANCE:
        raise FitError(f"caps: no mixture fits under them (they sum to {u.sum():.6g} < 1); raise the epoch cap")
    return u
