"""Mixture designs for a sweep of small runs: which domain weights each run trains on.

Every design is a `Design`: an array [n, k] of distributions and, per row, the design's name and
parameters. All are deterministic (random ones from a seed) and pure.

- `dirichlet_design`: RegMix's sampler (Liu et al., ICLR 2025, Sec. 2.2 and the authors'
  `mixture_config/synthesize_mixture.py`; also Olmix's swarm): r ~ Dir(c * p) around a prior p
  (the domains' token distribution), the concentration c log-uniform in [lo, hi] per mixture, so
  that the sweep holds both near-one-hot (small c) and near-prior (large c) mixtures.
- `grid_design`: every mixture whose weights are multiples of 1/n (the exhaustive grids of
  data mixing laws, Ye et al., ICLR 2025, Sec. 4).
- `one_hot_design`, `smoothed_one_hot_design`: one domain alone, or 1 - eps on one domain and
  eps / (k - 1) on each of the others.

Caps: `epoch_caps` turns a number of epochs into per-domain upper bounds, weight_i <= (max_epochs *
n_i - slack) / budget (RegMix's `MAXIMUM_USAGE`, there applied to the prior: min(15 p_i, 1)); a
sweep counts n_i and the budget in sequences over its sampler's pools, with one of slack
(doremi/offline/sweep.py `sequence_caps`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from doremi.offline.fit.checks import SUM_TOLERANCE, FitError, as_caps, as_distribution

#: RegMix's concentration ("strength") range, `MIN_STRENGH`/`MAX_STRENGH` in synthesize_mixture.py.
REGMIX_CONCENTRATION = (0.1, 5.0)


@dataclass(frozen=True)
class Design:
    """Mixtures [n, k] (rows are distributions) and, per row, its design's name and parameters."""

    weights: np.ndarray
    names: tuple[str, ...]
    params: tuple[dict[str, Any], ...]

    def __len__(self) -> int:
        return int(self.weights.shape[0])

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per mixture: `weights`, `design`, `params`."""
        return [
            {"weights": w.tolist(), "design": name, "params": dict(p)}
            for w, name, p in zip(self.weights, self.names, self.params)
        ]


def concat_designs(*designs: Design) -> Design:
    """The rows of several designs over the same domains, in order."""
    if not designs:
        raise FitError("concat_designs: expected at least one design")
    k = {d.weights.shape[1] for d in designs}
    if len(k) != 1:
        raise FitError(f"concat_designs: expected designs over the same number of domains, got {sorted(k)}")
    return Design(
        np.concatenate([d.weights for d in designs], axis=0),
        tuple(n for d in designs for n in d.names),
        tuple(p for d in designs for p in d.params),
    )


def epoch_caps(
    tokens: Sequence[float] | np.ndarray, budget_tokens: float, max_epochs: float, slack: float = 0.0
) -> np.ndarray:
    """Per-domain weight caps u_i = min(1, max(max_epochs * tokens_i - slack, 0) / budget_tokens):
    a run of `budget_tokens` reads domain i at most `max_epochs` times (RegMix's `MAXIMUM_USAGE`
    bound) even when its realised count runs `slack` past the nominal one. The counts may be in
    any unit the budget is in: a sweep counts sequences over its sampler's pools with one of
    slack, as a run realises epochs (doremi/offline/sweep.py `sequence_caps`)."""
    n = np.asarray(tokens, dtype=np.float64)
    if n.ndim != 1 or n.size < 2 or not np.all(np.isfinite(n)) or np.any(n <= 0):
        raise FitError(f"tokens: expected a positive count per domain (k >= 2), got {np.asarray(tokens).tolist()}")
    if not (math.isfinite(budget_tokens) and budget_tokens > 0):
        raise FitError(f"budget_tokens: expected a positive number, got {budget_tokens}")
    if not (math.isfinite(max_epochs) and max_epochs > 0):
        raise FitError(f"max_epochs: expected a positive number, got {max_epochs}")
    if not (math.isfinite(slack) and slack >= 0):
        raise FitError(f"slack: expected a number >= 0, got {slack}")
    return np.minimum(1.0, np.maximum(max_epochs * n - slack, 0.0) / budget_tokens)


def _within_caps(w: np.ndarray, caps: np.ndarray) -> np.ndarray:
    return np.all(w <= caps + SUM_TOLERANCE, axis=1)


def dirichlet_design(
    prior: Sequence[float] | np.ndarray,
    n: int,
    *,
    seed: int,
    concentration: tuple[float, float] = REGMIX_CONCENTRATION,
    temperature: float = 1.0,
    min_weight: float = 0.0,
    caps: Sequence[float] | np.ndarray | None = None,
    max_draws: int | None = None,
) -> Design:
    """`n` mixtures r ~ Dir(c * p^temperature / Z) with log c ~ U[log lo, log hi] per mixture.

    RegMix (Liu et al. 2025, Sec. 2.2; `synthesize_mixture.py`: strengths 0.1 to 5, prior = token
    distribution, optionally tempered by 0.5) picks c among 15 log-spaced values; here c is
    continuous log-uniform. Rules, applied in this order to each draw:

    1. minimum weight: entries below `min_weight` are set to 0 and the row renormalised (RegMix's
       rule, without its rounding to multiples of the minimum); so every weight of a kept row is
       0 or >= `min_weight` (renormalising only raises the others);
    2. caps: a row with any weight above its cap is rejected and redrawn (rejection sampling, as
       RegMix, but after rule 1 so that the rows kept respect both).

    Dir(alpha) is drawn as normalised Gamma(alpha_i, 1) variables (a draw whose gammas all underflow
    to 0, possible for tiny alpha, is dropped), in batches from `numpy.random.default_rng(seed)`; more than `max_draws` draws
    (default 1000 n) without `n` kept rows is an error (caps too tight for the prior).
    """
    p, (lo, hi), u = _dirichlet_inputs(prior, n, concentration, temperature, min_weight, caps)
    base = p**temperature
    base = base / base.sum()
    limit = 1000 * n if max_draws is None else int(max_draws)
    rng = np.random.default_rng(seed)
    kept_w: list[np.ndarray] = []
    kept_c: list[np.ndarray] = []
    kept = drawn = 0
    while kept < n:
        if drawn >= limit:
            raise FitError(
                f"dirichlet_design: {kept} of {n} mixtures within the caps after {drawn} draws; loosen the caps "
                "or raise the concentration"
            )
        batch = min(max(2 * (n - kept), 256), limit - drawn)
        w, c = _dirichlet_draws(rng, base, lo, hi, batch, min_weight)
        drawn += batch
        ok = _within_caps(w, u)
        kept_w.append(w[ok])
        kept_c.append(c[ok])
        kept += int(ok.sum())
    weights = np.concatenate(kept_w)[:n]
    conc = np.concatenate(kept_c)[:n]
    return Design(weights, ("dirichlet",) * n, tuple({"concentration": float(x)} for x in conc))


def _dirichlet_inputs(
    prior: Sequence[float] | np.ndarray,
    n: int,
    concentration: tuple[float, float],
    temperature: float,
    min_weight: float,
    caps: Sequence[float] | np.ndarray | None,
) -> tuple[np.ndarray, tuple[float, float], np.ndarray]:
    """`dirichlet_design`'s arguments checked: (prior as a distribution, (lo, hi), caps [k])."""
    p = np.asarray(prior, dtype=np.float64)
    k = p.size
    p = as_distribution(p, k, "prior")
    if k < 2:
        raise FitError(f"prior: expected k >= 2 domains, got {k}")
    if not isinstance(n, int | np.integer) or n < 1:
        raise FitError(f"n: expected a positive number of mixtures, got {n}")
    lo, hi = (float(x) for x in concentration)
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
        raise FitError(f"concentration: expected 0 < lo <= hi, got {concentration}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise FitError(f"temperature: expected a positive number, got {temperature}")
    if not (0.0 <= min_weight <= 1.0 / k):
        raise FitError(f"min_weight: expected a number in [0, 1/k = {1.0 / k:.6g}], got {min_weight}")
    return p, (lo, hi), as_caps(caps, k)


def _dirichlet_draws(
    rng: np.random.Generator, base: np.ndarray, lo: float, hi: float, batch: int, min_weight: float
) -> tuple[np.ndarray, np.ndarray]:
    """`batch` draws of (mixture, concentration) before the caps: rules 1 and the underflow drop
    of `dirichlet_design`, the random numbers taken from `rng` in the same order as one loop."""
    c = np.exp(rng.uniform(math.log(lo), math.log(hi), size=batch))
    g = rng.standard_gamma(c[:, None] * base[None, :])
    ok = g.sum(axis=1) > 0
    w, c = g[ok] / g[ok].sum(axis=1, keepdims=True), c[ok]
    if min_weight > 0:
        w = np.where(w < min_weight, 0.0, w)
        w = w / w.sum(axis=1, keepdims=True)
    return w, c


def grid_design(k: int, n: int, *, caps: Sequence[float] | np.ndarray | None = None, min_weight: float = 0.0) -> Design:
    """Every mixture with weights in {0, 1/n, ..., 1}: C(n + k - 1, k - 1) rows in lexicographic
    order of their weights, less those above a cap or with a nonzero weight below `min_weight`."""
    if not isinstance(k, int | np.integer) or k < 2:
        raise FitError(f"k: expected at least 2 domains, got {k}")
    if not isinstance(n, int | np.integer) or n < 1:
        raise FitError(f"n: expected a positive number of steps, got {n}")
    count = math.comb(n + k - 1, k - 1)
    if count > 5_000_000:
        raise FitError(f"grid_design: {count} mixtures for k={k}, n={n}; expected at most 5000000")
    u = as_caps(caps, k)
    cuts = np.array(list(itertools.combinations(range(n + k - 1), k - 1)), dtype=np.int64).reshape(-1, k - 1)
    bounds = np.concatenate([np.full((cuts.shape[0], 1), -1), cuts, np.full((cuts.shape[0], 1), n + k - 1)], axis=1)
    counts = np.diff(bounds, axis=1) - 1
    w = counts.astype(np.float64) / n
    ok = _within_caps(w, u) & ~np.any((w > 0) & (w < min_weight - 1e-12), axis=1)
    w = w[ok]
    return Design(w, ("grid",) * len(w), tuple({"n": int(n)} for _ in range(len(w))))


def one_hot_design(k: int, *, caps: Sequence[float] | np.ndarray | None = None) -> Design:
    """Each domain alone (the identity), less the domains whose cap is below 1."""
    return smoothed_one_hot_design(k, 0.0, caps=caps)


def smoothed_one_hot_design(k: int, eps: float, *, caps: Sequence[float] | np.ndarray | None = None) -> Design:
    """Row i: 1 - eps on domain i and eps / (k - 1) on each other domain; rows above a cap are left out."""
    if not isinstance(k, int | np.integer) or k < 2:
        raise FitError(f"k: expected at least 2 domains, got {k}")
    if not (0.0 <= eps < 1.0):
        raise FitError(f"eps: expected a number in [0, 1), got {eps}")
    u = as_caps(caps, k)
    w = np.full((k, k), eps / (k - 1))
    np.fill_diagonal(w, 1.0 - eps)
    keep = np.flatnonzero(_within_caps(w, u))
    name = "one_hot" if eps == 0 else "smoothed_one_hot"
    params = tuple({"domain": int(i)} if eps == 0 else {"domain": int(i), "eps": float(eps)} for i in keep)
    return Design(w[keep], (name,) * len(keep), params)
