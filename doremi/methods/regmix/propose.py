"""RegMix on a sweep (`doremi fit --method regmix`; the spec's `fit`): the regressor
(`fit.regressor`) from each run's mixture to the target loss, its held-out check, and the mean of
the `fit.top_k` best of `fit.simulations` mixtures drawn around the sweep's prior (`fit.py`)."""

from __future__ import annotations

from typing import Any

from doremi.methods.regmix.fit import RegMixOptions, fit_regressor, propose_regmix, regmix_fit_predict
from doremi.offline.fit.evaluate import held_out, target_of
from doremi.offline.fit.table import FitResult, SweepTable, checked


def fit_sweep(cfg: Any, t: SweepTable) -> FitResult:
    """The proposal of experiment config `cfg`'s `fit` options on the sweep `t` (its `prior` is
    the sweep's, checked by the caller: the spec's `fit_reads_prior`)."""
    f = cfg.fit
    held, skipped = None, t.skipped
    y = target_of(t.per_domain, t.target)
    model = fit_regressor(t.weights, y, f.regressor)
    if skipped is None:
        held, skipped = checked(
            lambda: held_out(regmix_fit_predict(f.regressor), t.weights, y, folds=t.folds, seed=f.seed)
        )
    options = RegMixOptions(n_simulations=f.simulations, top_k=f.top_k, seed=f.seed)
    proposal = propose_regmix(model, t.prior, caps=t.caps, options=options)
    return FitResult(
        proposal.weights,
        proposal.predicted,
        held,
        skipped,
        provenance={"regressor": f.regressor, "prior": t.prior, "top_k": f.top_k, "n_simulations": f.simulations},
    )
