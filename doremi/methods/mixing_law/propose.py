"""Data mixing laws on a sweep (`doremi fit --method mixing_law`; the spec's `fit` and
`describe_fit`): per-domain laws L_i(r) = c_i + k_i exp(sum_j t_ij r_j) fitted to the runs'
losses, and the minimiser of the target sum_i w_i L_i(r) over the simplex (`fit.py`).

`fit.mixing_law.variant: authors` (default) fits them to the runs' losses extrapolated to the main
run's tokens by a step law along each run (`losses.csv`), and to its size by a size law when there
are proxies of 3 or more sizes (a sweep has one: said so in the JSON), as the released pipeline
does (`nested.py`), with the authors' Huber loss; `direct` fits the final losses and applies the
law unchanged, and the JSON says so."""

from __future__ import annotations

from typing import Any

import numpy as np

from doremi.methods.mixing_law.fit import MixingLawOptions, fit_mixing_law, mixing_law_fit_predict, propose_mixing_law
from doremi.methods.mixing_law.nested import Extrapolation, NestedOptions, ProxyCurves, extrapolate
from doremi.offline.fit.checks import FitError
from doremi.offline.fit.evaluate import held_out
from doremi.offline.fit.table import FitResult, SweepTable, checked

#: The mixing law's Huber delta in the released code (`mix_5_domains.ipynb`, `law.fit(..., delta=0.05)`).
AUTHORS_HUBER = 0.05
#: The key of the weights JSON that records the law's fit (`law_losses`, read by `describe`).
RECORD_KEY = "mixing_law"


def fit_sweep(cfg: Any, t: SweepTable) -> FitResult:
    """The proposal of experiment config `cfg`'s `fit.mixing_law` options on the sweep `t` (its
    sizes and tokens filled: the spec's `fit_reads_main_size`)."""
    held, skipped = None, t.skipped
    fitted, options, record = law_losses(cfg.fit.mixing_law, t)
    law = fit_mixing_law(t.weights, fitted, options)
    if skipped is None:
        predict = mixing_law_fit_predict(options)
        held, skipped = checked(
            lambda: held_out(predict, t.weights, fitted, folds=t.folds, seed=cfg.fit.seed, target_weights=t.target)
        )
    proposal = propose_mixing_law(law, target_weights=t.target, caps=t.caps)
    return FitResult(proposal.weights, proposal.predicted, held, skipped, record={RECORD_KEY: record})


def law_losses(ml: Any, t: SweepTable) -> tuple[np.ndarray, MixingLawOptions | None, dict[str, Any]]:
    """(the losses [n, m] the mixing law is fitted to, its fit options, what the JSON records)
    under options `ml` (`fit.mixing_law`): under `authors`, the runs' curves extrapolated to the
    main run (`nested.py`) and the authors' Huber loss; under `direct`, the final losses as they
    are, and that said."""
    where = {
        "proxy_params": t.proxy_params,
        "proxy_tokens": t.proxy_tokens,
        "main_params": t.main_params,
        "main_tokens": t.budget,
    }
    if ml.variant == "direct":
        return (
            t.per_domain,
            None,
            {
                "variant": "direct",
                **where,
                "fitted_to": "the sweep's final losses at the proxy's size and tokens, applied unchanged to the main run",
            },
        )
    if t.curves is None or t.proxy_params is None or t.tokens_per_step is None or t.main_params is None:
        raise FitError("the authors' mixing law reads the sweep's curves and sizes: its spec sets fit_reads_main_size")
    steps, curves = t.curves()
    proxy = ProxyCurves(params=t.proxy_params, tokens=steps * t.tokens_per_step, losses=curves)
    ext: Extrapolation = extrapolate(
        [proxy], t.budget, t.main_params, NestedOptions(step_from=ml.step_from, step_holdout=ml.step_holdout)
    )
    return (
        ext.losses,
        MixingLawOptions(loss="huber", f_scale=AUTHORS_HUBER),
        {
            "variant": "authors",
            **where,
            "fitted_to": "each run's losses extrapolated by its step law to the main run's tokens"
            + ("" if "skipped" in ext.size else " and by the size law to the main model's size"),
            "huber_delta": AUTHORS_HUBER,
            **ext.to_dict(),
        },
    )


def describe(doc: dict[str, Any]) -> str | None:
    """What a proposal's mixing law was fitted to, with each extrapolating law's held-out check,
    from its weights file `doc` (its `RECORD_KEY` record); None when it has none."""
    record = doc.get(RECORD_KEY)
    if not isinstance(record, dict):
        return None
    where = (
        f"proxy N {record['proxy_params']:.3g}, {record['proxy_tokens']:.3g} tokens; "
        f"main N {record['main_params']:.3g}, {record['main_tokens']:.3g} tokens"
    )
    if record.get("variant") != "authors":
        return f"direct: {record.get('fitted_to')} ({where})"
    parts = []
    for step in record.get("step_law", []):
        check = step.get("held_out")
        parts.append(
            f"step law on {step['points']} evaluations per run, "
            + (
                f"held-out last {check['held']}: MAE {check['mae']:.3g}, max {check['max_abs']:.3g}"
                if check
                else f"not checked ({step.get('held_out_skipped')})"
            )
        )
    size = record.get("size_law", {})
    if "skipped" in size:
        parts.append(f"size law not fitted: {size['skipped']}")
    else:
        check = size.get("held_out")
        parts.append(
            "size law, "
            + (
                f"held-out largest proxy: MAE {check['mae']:.3g}"
                if check
                else f"not checked ({size.get('held_out_skipped')})"
            )
        )
    return f"authors ({where}): " + "; ".join(parts)
