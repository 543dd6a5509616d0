"""Offline mixture search: designs for a sweep of small runs, fits from their mixtures to their
losses, and the proposers that turn a fit into domain weights.

- `design`: the mixtures a sweep trains (Dirichlet around a prior, grids, one-hot).
- `regmix`: RegMix (Liu et al., ICLR 2025), a regressor from weights to a target loss, and the
  top-k average of simulated mixtures.
- `mixing_law`: data mixing laws (Ye et al., ICLR 2025), L_i(r) = c_i + k_i exp(sum_j t_ij r_j),
  and its minimiser over the simplex under epoch caps.
- `power_law`, `nested`: the authors' pipeline before that law, each run's losses extrapolated by
  a step law (in tokens) and a size law (in parameters) to the main run.
- `evaluate`: held-out rank correlation and error of a fit, by K-fold cross-validation.
- `provenance`: what a proposal's weights JSON records.

Every function is pure (numpy float64); the optional packages (`lightgbm`, `scipy`) are imported
only where they are used (`pip install doremi-mix[sweep]`).
"""

from doremi.offline.fit.checks import FitError

__all__ = ["FitError"]
