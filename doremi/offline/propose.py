"""`doremi fit CONFIG --method regmix|mixing_law`: a mixture proposed from a sweep's table
(`doremi/offline/sweep.py` `final.csv`) by one of the offline methods, written as the common weights JSON
with the fit's provenance: its held-out rank correlation and error on runs it did not see, and
the compute the sweep spent.

- `regmix` (Liu et al. 2025): a regressor (`fit.regressor`) from mixture to the target loss;
  the mean of the `fit.top_k` best of `fit.simulations` mixtures drawn around the sweep's prior.
- `mixing_law` (Ye et al. 2025): per-domain laws L_i(r) = c_i + k_i exp(sum_j t_ij r_j); the
  minimiser of the target sum_i w_i L_i(r) over the simplex. `fit.mixing_law.variant: authors`
  (default) fits them to the runs' losses extrapolated to the main run's tokens by a step law
  along each run (`losses.csv`), and to its size by a size law when there are proxies of 3 or more
  sizes (a sweep has one: said so in the JSON), as the released pipeline does (fit/nested.py);
  `direct` fits the final losses and applies the law unchanged.
Both keep every weight within `fit.max_epochs` epochs of the main run's token budget.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data import artifact
from data.preprocess import check_stores_match
from data.store import read_manifest
from data.weights import resolve_weights
from doremi.config import OFFLINE_METHODS, ExperimentConfig
from doremi.errors import DoReMiError
from doremi.offline.fit.checks import FitError
from doremi.offline.fit.design import epoch_caps
from doremi.offline.fit.evaluate import HeldOut, held_out, target_of
from doremi.offline.fit.mixing_law import MixingLawOptions, fit_mixing_law, mixing_law_fit_predict, propose_mixing_law
from doremi.offline.fit.nested import Extrapolation, NestedOptions, ProxyCurves, extrapolate
from doremi.offline.fit.provenance import proposal_provenance, write_proposal
from doremi.offline.fit.regmix import RegMixOptions, fit_regressor, propose_regmix, regmix_fit_predict
from doremi.offline.sweep import SWEEP_FILE, final_table, loss_curves, sweep_keys
from trainer.model.flops import non_embedding_params
from trainer.records.run_dir import changed_keys

#: The mixing law's Huber delta in the released code (`mix_5_domains.ipynb`, `law.fit(..., delta=0.05)`).
AUTHORS_HUBER = 0.05


def propose(
    cfg: ExperimentConfig,
    method: str,
    out: str | Path,
    sweep_dir: str | Path | None = None,
    budget: int | None = None,
    allow_unfinished: bool = False,
    main_params: float | None = None,
) -> Path:
    """Fit `method` to the sweep in `sweep_dir` (default `sweep.run_dir`) and write its mixture
    to `out`. `budget`: the token budget of the run the mixture is for (default the config's),
    against which `fit.max_epochs` caps the weights and to which the mixing law's step law
    extrapolates; `main_params`: that run's model size (default the config's model's)."""
    if method not in OFFLINE_METHODS:
        raise DoReMiError(f"--method: expected one of {', '.join(OFFLINE_METHODS)}, got {method!r}")
    root = Path(sweep_dir or cfg.sweep.run_dir)
    made_from = _checked_sweep(root, allow_unfinished)
    domains, weights, losses = final_table(root)
    manifest = read_manifest(cfg.data.store_dir)
    check_stores_match(cfg.data, manifest)
    if manifest.domain_names != domains:
        raise DoReMiError(f"{root}: the sweep's domains {domains} are not the stores' {manifest.domain_names}")
    f = cfg.fit
    budget = budget or cfg.budget_tokens
    per_domain = np.stack([losses[d] for d in domains], axis=1)
    target = resolve_weights(f.target, manifest, "fit.target", budget)
    tokens = [d.train.tokens for d in manifest.domains]
    caps = epoch_caps(tokens, budget, f.max_epochs) if f.max_epochs is not None else None
    n = len(weights)
    folds = min(f.folds, n // 2)
    skipped: str | None = None if folds >= 2 else f"{n} runs are too few for 2 folds"
    prior = None
    law_record: dict[str, Any] = {}
    table = SweepTable(root, weights, per_domain, target, caps, folds, skipped, budget)
    if method == "regmix":
        proposal, held, skipped, prior = _fit_regmix(cfg, table, manifest)
    else:
        main_params = float(main_params or non_embedding_params(cfg.model))
        proposal, held, skipped, law_record = _fit_law(cfg, table, main_params)
    weights_out, predicted = proposal.weights, proposal.predicted
    provenance = _provenance(method, root, f, n, held, skipped, prior, caps, target, predicted, law_record)
    sources = [artifact.Source("sweep", str(root), made_from.fingerprint)] if made_from else []
    notes = [f"--allow-unfinished: fitted a sweep that did not finish ({made_from.describe()})"]
    notes = notes if made_from and made_from.status != "finished" else []
    return write_proposal(out, domains, weights_out, provenance, sources=sources, notes=notes)


def _provenance(
    method: str,
    root: Path,
    f: Any,
    n: int,
    held: HeldOut | None,
    skipped: str | None,
    prior: np.ndarray | None,
    caps: Any,
    target: np.ndarray,
    predicted: Any,
    law_record: dict[str, Any],
) -> dict[str, Any]:
    """What the weights JSON records of the fit: the method's options, its held-out check, and
    the sweep it was fitted to (its runs and compute)."""
    sweep = json.loads((root / SWEEP_FILE).read_text())
    return proposal_provenance(
        method=method,
        n_runs=n,
        held_out=held,
        seed=f.seed,
        regressor=f.regressor if method == "regmix" else None,
        prior=prior,
        top_k=f.top_k if method == "regmix" else None,
        n_simulations=f.simulations if method == "regmix" else None,
        caps=caps,
        max_epochs=f.max_epochs,
        target_weights=target,
        predicted_loss=predicted,
        extra={
            "sweep": str(root),
            "sweep_runs": len(sweep.get("design", [])),
            "compute": sweep.get("compute"),
            "held_out_skipped": skipped,
            **({"mixing_law": law_record} if method == "mixing_law" else {}),
        },
    )


@dataclass(frozen=True)
class SweepTable:
    """What both fits read of the sweep: its directory, the runs' mixtures [n, k] and final
    per-domain losses [n, m], the target's weights, the epoch caps (None: none), the held-out
    folds (or why there are none: `skipped`), and the token budget of the run proposed for."""

    root: Path
    weights: np.ndarray
    per_domain: np.ndarray
    target: np.ndarray
    caps: Any
    folds: int
    skipped: str | None
    budget: int


def _fit_regmix(
    cfg: ExperimentConfig, t: SweepTable, manifest: Any
) -> tuple[Any, HeldOut | None, str | None, np.ndarray]:
    """RegMix: (the proposal, the held-out check, why it was skipped, the sweep's prior)."""
    f = cfg.fit
    held, skipped = None, t.skipped
    check_prior(cfg, t.root)
    y = target_of(t.per_domain, t.target)
    model = fit_regressor(t.weights, y, f.regressor)
    if skipped is None:
        held, skipped = _held_out(
            lambda: held_out(regmix_fit_predict(f.regressor), t.weights, y, folds=t.folds, seed=f.seed)
        )
    prior = resolve_weights(cfg.sweep.prior, manifest, "sweep.prior", t.budget)
    options = RegMixOptions(n_simulations=f.simulations, top_k=f.top_k, seed=f.seed)
    return propose_regmix(model, prior, caps=t.caps, options=options), held, skipped, prior


def _fit_law(
    cfg: ExperimentConfig, t: SweepTable, main_params: float
) -> tuple[Any, HeldOut | None, str | None, dict[str, Any]]:
    """The mixing law: (the proposal, the held-out check, why it was skipped, what the JSON
    records of the law's fit)."""
    held, skipped = None, t.skipped
    fitted, options, law_record = _mixing_law_losses(cfg, t.root, t.per_domain, t.budget, main_params)
    law = fit_mixing_law(t.weights, fitted, options)
    if skipped is None:
        predict = mixing_law_fit_predict(options)
        held, skipped = _held_out(
            lambda: held_out(predict, t.weights, fitted, folds=t.folds, seed=cfg.fit.seed, target_weights=t.target)
        )
    return propose_mixing_law(law, target_weights=t.target, caps=t.caps), held, skipped, law_record


def _mixing_law_losses(
    cfg: ExperimentConfig, root: Path, final: np.ndarray, budget: int, main_params: float
) -> tuple[np.ndarray, MixingLawOptions | None, dict[str, Any]]:
    """(the losses [n, m] the mixing law is fitted to, its fit options, what the JSON records):
    under `authors`, the runs' curves extrapolated to the main run (fit/nested.py) and the
    authors' Huber loss; under `direct`, the final losses as they are, and that said."""
    ml = cfg.fit.mixing_law
    proxy_params, per_step = proxy_of(cfg, root)
    keys = json.loads((root / SWEEP_FILE).read_text()).get("keys", {})
    proxy_tokens = int(keys.get("train.steps", cfg.train.steps)) * per_step
    where = {
        "proxy_params": proxy_params,
        "proxy_tokens": proxy_tokens,
        "main_params": main_params,
        "main_tokens": budget,
    }
    if ml.variant == "direct":
        return (
            final,
            None,
            {
                "variant": "direct",
                **where,
                "fitted_to": "the sweep's final losses at the proxy's size and tokens, applied unchanged to the main run",
            },
        )
    steps, curves = loss_curves(root)
    proxy = ProxyCurves(params=proxy_params, tokens=steps * per_step, losses=curves)
    ext: Extrapolation = extrapolate(
        [proxy], budget, main_params, NestedOptions(step_from=ml.step_from, step_holdout=ml.step_holdout)
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


def proxy_of(cfg: ExperimentConfig, root: Path) -> tuple[float, int]:
    """(model size, tokens per step) of the sweep's runs, from its `sweep.json`; a sweep written
    before it recorded them is read with this config's, which must then be the sweep's."""
    doc = json.loads((root / SWEEP_FILE).read_text())
    proxy = doc.get("proxy")
    if isinstance(proxy, dict) and {"params", "tokens_per_step"} <= set(proxy):
        return float(proxy["params"]), int(proxy["tokens_per_step"])
    saved = doc.get("keys", {})
    here = json.loads(json.dumps(sweep_keys(cfg), default=str))

    def of(keys: dict) -> dict:
        return {
            k: v for k, v in keys.items() if k.startswith("model.") or k in ("train.global_batch_size", "data.seq_len")
        }

    if of(saved) and of(saved) != of(here):
        raise DoReMiError(
            f"{root}: the sweep's runs are not this config's ({changed_keys(of(saved), of(here))}) and the sweep "
            "did not record their size: fit it with the sweep's config"
        )
    return float(non_embedding_params(cfg.model)), cfg.train.global_batch_size * cfg.data.seq_len


def _checked_sweep(root: Path, allow_unfinished: bool) -> artifact.Header | None:
    """The sweep's header (docs/design.md section 6b): its runs all finished (unless told
    otherwise) and its tables as written. None for a sweep made before headers."""
    header = artifact.read(root) if (root / SWEEP_FILE).is_file() else None
    if header is None or header.kind != "sweep":
        return None
    artifact.check_content(root, "the sweep's record")
    artifact.verify_files(root, header.files, "sweep")
    if header.status != "finished" and not allow_unfinished:
        raise artifact.ArtifactError(
            f"{root}: the sweep did not finish ({header.step} of {header.steps} runs); run `doremi sweep` to "
            f"finish it, or `doremi fit --allow-unfinished` to fit the runs there"
        )
    return header


def check_prior(cfg: ExperimentConfig, root: Path) -> None:
    """Refuse a RegMix fit whose `sweep.prior` is not the one the sweep in `root` drew its
    mixtures around: the proposer simulates around the config's prior, and a regressor fitted on
    mixtures near one prior ranks mixtures near another by extrapolation, silently."""
    saved = json.loads((root / SWEEP_FILE).read_text()).get("keys", {})
    if not any(k == "sweep.prior" or k.startswith("sweep.prior.") for k in saved):
        return  # a sweep recorded without its keys: nothing to compare
    here = json.loads(json.dumps(sweep_keys(cfg), default=str))

    def prior_of(keys: dict) -> dict:
        return {k: v for k, v in keys.items() if k == "sweep.prior" or k.startswith("sweep.prior.")}

    if prior_of(saved) != prior_of(here):
        raise DoReMiError(
            f"{root}: the sweep was drawn around another sweep.prior than this config's "
            f"({changed_keys(prior_of(saved), prior_of(here))}); RegMix simulates around the sweep's prior: "
            "set sweep.prior as the sweep had it"
        )


def _held_out(evaluate: Callable[[], HeldOut]) -> tuple[HeldOut | None, str | None]:
    """(the held-out evaluation, None), or (None, why not) when the folds leave too few runs to
    fit: the proposal is still made from all runs, and says it was not checked."""
    try:
        return evaluate(), None
    except FitError as e:
        return None, str(e)


class FitQualityError(DoReMiError):
    """A fit's held-out rank correlation is below `pipeline.guardrails.min_fit_spearman`: the
    pipeline stops before a main run trains on its proposal."""


def fit_quality(path: str | Path) -> dict[str, Any]:
    """A proposal's held-out quality from its weights file: `spearman` (None: undefined, a
    constant prediction), `mae`, `folds`, `n` when it was checked, else `skipped` (why not)."""
    doc = json.loads(Path(path).read_text())
    held = doc.get("held_out")
    laws = {"laws": describe_laws(doc["mixing_law"])} if isinstance(doc.get("mixing_law"), dict) else {}
    if isinstance(held, dict):
        return {**{k: held.get(k) for k in ("spearman", "mae", "folds", "n")}, **laws}
    return {"skipped": doc.get("held_out_skipped") or "no held-out evaluation recorded", "n": doc.get("n_runs"), **laws}


def describe_laws(record: dict[str, Any]) -> str:
    """What a mixing-law fit was fitted to, with each extrapolating law's held-out check, from
    its weights file's `mixing_law` record (`_mixing_law_losses`)."""
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


def describe_quality(q: dict[str, Any]) -> str:
    """`held-out Spearman 0.812, mean abs error 0.0123 (16 runs, 5 folds)`, or why unchecked."""
    if "skipped" in q:
        return f"not checked on held-out runs ({q['skipped']})"
    rho = "undefined (constant predictions)" if q["spearman"] is None else f"{q['spearman']:.3f}"
    return f"held-out Spearman {rho}, mean abs error {q['mae']:.4g} ({q['n']} runs, {q['folds']} folds)"


def check_fit_quality(name: str, path: str | Path, threshold: float) -> str:
    """Refuse (FitQualityError, one line naming the fit and the number) a fit whose held-out
    Spearman is below `threshold`, undefined, or unchecked (unless `threshold` is -1, which takes
    any fit); else return the line describing its quality. A fit that cannot rank runs it did
    not see proposes the optimum of its noise (issue 41: a RegMix fit at -0.74 proposed a 0.998
    one-hot mixture, and the main run trained on it)."""
    q = fit_quality(path)
    rho = q.get("spearman")
    if threshold > -1 and ("skipped" in q or rho is None or rho < threshold):
        why = "unchecked" if "skipped" in q else f"below pipeline.guardrails.min_fit_spearman {threshold:g}"
        raise FitQualityError(
            f"{name}: fit {path}: {describe_quality(q)}, {why}: its proposal is not trained on; run a "
            "larger sweep (sweep.runs), or lower pipeline.guardrails.min_fit_spearman (-1 takes any fit)"
        )
    return describe_quality(q)
