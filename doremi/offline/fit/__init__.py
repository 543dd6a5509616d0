"""The generic machinery of the offline fits, shared by every method that fits a sweep of small
runs (RegMix, data mixing laws; their own fits are in their folders, doremi/methods/regmix/ and
doremi/methods/mixing_law/):

- `checks`: the fits' input checks (mixtures, losses, caps) and `FitError`.
- `design`: the mixtures a sweep trains (Dirichlet around a prior, grids, one-hot), the epoch caps.
- `evaluate`: held-out rank correlation and error of a fit, by K-fold cross-validation.

It imports nothing of the framework but doremi.errors, so it is a room below the methods'
(tests/test_owners.py ROOMS), which import it; what a proposal records is doremi/offline/provenance.py.
Every function is pure (numpy float64); the optional packages (`lightgbm`, `scipy`) are imported
only where they are used (`pip install doremi-mix[sweep]`).
"""

from doremi.offline.fit.checks import FitError

__all__ = ["FitError"]
