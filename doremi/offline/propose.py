"""`doremi fit CONFIG --method <offline method>`: a mixture proposed from a sweep's table
(`doremi/offline/sweep.py` `final.csv`) by one of the catalog's offline methods, written as the
common weights JSON with the fit's provenance: its held-out rank correlation and error on runs
it did not see, and the compute the sweep spent.

This module reads the sweep into a `SweepTable` (doremi/offline/fit/table.py) and writes the
proposal; the fit itself is the method's (its spec's `fit`, in its catalog folder: RegMix's
regressor and top-k average in doremi/methods/regmix/, data mixing laws' law and nested
step/size-law extrapolation in doremi/methods/mixing_law/). A fit that draws around the sweep's
prior (`fit_reads_prior`) gets it once checked to be the sweep's; one that extrapolates to the
main run (`fit_reads_main_size`) gets the sizes, tokens and curves. Every proposal keeps every
domain within `fit.max_epochs` epochs of the main run, counted as that run reads them (sequences
over its sampler's pools, doremi/offline/sweep.py `sequence_caps`).

Several sweeps are one fit over all their runs (`--sweep A B ...`) when they are the same sweep
but for its seeds (`POOLED_KEYS`): the comparison pools its six seeds' sweeps of 64 runs into one
fit of 384 (doremi/study/comparison/protocol.py, pooled SWEPT arms), because a mixture searched
anew on every seed spread the study's pairs to sigma_D 0.0507 where one pooled mixture's spread
0.0056 (experiments/results/doremi_study.md, session 12). Sweeps of other domains, stores or
design keys are refused: their losses are not one table.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from data import artifact
from data.preprocess.preprocess import check_stores_match
from data.sampling.mixtures import SEQUENCE_SLACK
from data.sampling.pools import pool_sizes
from data.sampling.weights import resolve_weights
from data.store.store import read_manifest
from doremi.config import ExperimentConfig
from doremi.errors import DoReMiError
from doremi.methods import registry
from doremi.offline.fit.table import FitResult, SweepTable
from doremi.offline.provenance import proposal_provenance, write_proposal
from doremi.offline.sweep import SWEEP_FILE, final_table, loss_curves, run_sequences, sequence_caps, sweep_keys
from trainer.model.flops import non_embedding_params
from trainer.records.run_dir import changed_keys

#: The keys in which sweeps pooled into one fit may differ: their seeds (each draws its own
#: mixtures and trains its own runs); every other key of `sweep_keys` must be the same.
POOLED_KEYS = ("sweep.seed", "train.seed", "data.seed")


def propose(
    cfg: ExperimentConfig,
    method: str,
    out: str | Path,
    sweep_dir: str | Path | Sequence[str | Path] | None = None,
    budget: int | None = None,
    allow_unfinished: bool = False,
    main_params: float | None = None,
    main: ExperimentConfig | None = None,
) -> Path:
    """Fit `method` to the sweep in `sweep_dir` (default `sweep.run_dir`; several: one fit over
    all their runs, `read_sweeps`) and write its mixture to `out`. `main`: the config of the run
    the mixture is for (default `cfg`): `fit.max_epochs` caps the weights in its unit, sequences over its sampler's pools (`sequence_caps`, the cap
    that run applies under `data.max_epochs`, so that it reads the proposal unchanged);
    `budget`: its token budget (default `main`'s), to which the mixing law's step law
    extrapolates; `main_params`: its model size (default `main`'s model's)."""
    offline = registry.names(registry.OFFLINE)  # the catalog's when called (a test may extend it)
    if method not in offline:
        raise DoReMiError(f"--method: expected one of {', '.join(offline)}, got {method!r}")
    spec = registry.spec(method)
    given = [sweep_dir] if isinstance(sweep_dir, (str, Path)) else list(sweep_dir or [cfg.sweep.run_dir])
    roots = [Path(r) for r in given]
    root = roots[0]
    headers = [_checked_sweep(r, allow_unfinished) for r in roots]
    domains, weights, losses = read_sweeps(roots)
    manifest = read_manifest(cfg.data.store_dir)
    check_stores_match(cfg.data, manifest)
    if manifest.domain_names != domains:
        raise DoReMiError(f"{root}: the sweep's domains {domains} are not the stores' {manifest.domain_names}")
    main = main or cfg
    budget = budget or main.budget_tokens
    caps, counted = _fit_caps(cfg.fit.max_epochs, main, domains)
    table = _sweep_table(cfg, root, domains, weights, losses, manifest, budget, caps)
    if spec.fit_reads_prior:
        for r in roots:
            check_prior(cfg, r)
        table = replace(table, prior=resolve_weights(cfg.sweep.prior, manifest, "sweep.prior", budget))
    if spec.fit_reads_main_size:
        table = _with_sizes(table, cfg, roots, float(main_params or non_embedding_params(main.model)))
    assert spec.fit is not None  # an offline spec has one (MethodSpec.__post_init__)
    result: FitResult = spec.fit(cfg, table)
    provenance = _provenance(method, table, cfg.fit, len(weights), result, counted, roots)
    sources = [artifact.Source("sweep", str(r), h.fingerprint) for r, h in zip(roots, headers) if h]
    notes = [
        f"--allow-unfinished: fitted a sweep that did not finish ({h.describe()})"
        for h in headers
        if h is not None and h.status != "finished"
    ]
    return write_proposal(out, domains, result.weights, provenance, sources=sources, notes=notes)


def _sweep_table(
    cfg: ExperimentConfig,
    root: Path,
    domains: list[str],
    weights: np.ndarray,
    losses: dict[str, np.ndarray],
    manifest: Any,
    budget: int,
    caps: np.ndarray | None,
) -> SweepTable:
    """What every fit reads: the runs' weights and per-domain losses, the target mixture its
    proposal is scored on, the caps, and the held-out folds (`fit.folds`, at most half the runs)."""
    f = cfg.fit
    n = len(weights)
    folds = min(f.folds, n // 2)
    return SweepTable(
        root=root,
        weights=weights,
        per_domain=np.stack([losses[d] for d in domains], axis=1),
        target=resolve_weights(f.target, manifest, "fit.target", budget),
        caps=caps,
        folds=folds,
        skipped=None if folds >= 2 else f"{n} runs are too few for 2 folds",
        budget=budget,
        seed=f.seed,
    )


def read_sweeps(roots: Sequence[Path]) -> tuple[list[str], np.ndarray, dict[str, np.ndarray]]:
    """`final_table` of one sweep, or of several as one table (their runs in the order given):
    refused, naming the sweep, when one is given twice, or its domains or its keys other than
    `POOLED_KEYS` (design, schedule, model, stores by their fingerprint) are not the first's."""
    if len(set(map(str, roots))) != len(roots):
        raise DoReMiError(f"--sweep: a sweep given twice ({', '.join(map(str, roots))})")
    tables = [final_table(r) for r in roots]
    first_keys = _unseeded_keys(roots[0])
    seeds = {}
    for r, (domains, _, _) in zip(roots[1:], tables[1:]):
        if domains != tables[0][0]:
            raise DoReMiError(
                f"{r}: its domains {domains} are not {roots[0]}'s {tables[0][0]}: one fit pools one corpus"
            )
        keys = _unseeded_keys(r)
        if keys != first_keys:
            raise DoReMiError(
                f"{r}: not the sweep of {roots[0]} but for its seeds ({changed_keys(first_keys, keys)}); "
                f"pooled sweeps differ only in {', '.join(POOLED_KEYS)}"
            )
    for r in roots:
        saved = json.loads((r / SWEEP_FILE).read_text()).get("keys", {})
        seed = tuple(saved.get(k) for k in POOLED_KEYS)
        if len(roots) > 1 and seed in seeds:
            raise DoReMiError(
                f"{r}: the same seeds as {seeds[seed]} ({dict(zip(POOLED_KEYS, seed))}): the same sweep twice"
            )
        seeds[seed] = r
    domains = tables[0][0]
    weights = np.concatenate([t[1] for t in tables])
    losses = {key: np.concatenate([t[2][key] for t in tables]) for key in tables[0][2]}
    return domains, weights, losses


def _unseeded_keys(root: Path) -> dict[str, Any]:
    keys = json.loads((root / SWEEP_FILE).read_text()).get("keys", {})
    return {k: v for k, v in keys.items() if k not in POOLED_KEYS}


def _pooled_curves(roots: Sequence[Path]) -> tuple[np.ndarray, np.ndarray]:
    """`loss_curves` of every sweep, runs concatenated in `read_sweeps`' order; their steps are
    one (the same keys), checked."""
    curves = [loss_curves(r) for r in roots]
    for r, (steps, _) in zip(roots[1:], curves[1:]):
        if steps.tolist() != curves[0][0].tolist():
            raise DoReMiError(f"{r}: evaluated at other steps than {roots[0]}")
    return curves[0][0], np.concatenate([c[1] for c in curves])


def _fit_caps(
    max_epochs: float | None, main: ExperimentConfig, domains: list[str]
) -> tuple[np.ndarray | None, dict | None]:
    """`fit.max_epochs`' caps over the main run's pools and sequences (`sequence_caps`), and how
    they were counted, for the proposal's provenance; (None, None) without the key."""
    if max_epochs is None:
        return None, None
    pools, sequences = pool_sizes(main.data), run_sequences(main)
    caps = sequence_caps(pools, sequences, max_epochs, domains, "fit.max_epochs")
    return caps, {"unit": "sequences", "pools": pools, "run_sequences": sequences, "slack": SEQUENCE_SLACK}


def _with_sizes(table: SweepTable, cfg: ExperimentConfig, roots: Sequence[Path], main_params: float) -> SweepTable:
    """`table` with what the nested laws extrapolate across: the proxies' size and tokens (from
    the first sweep: pooled sweeps share their keys), the main run's size, and the proxies' loss
    curves (read when the fit asks)."""
    root = roots[0]
    proxy_params, per_step = proxy_of(cfg, root)
    keys = json.loads((root / SWEEP_FILE).read_text()).get("keys", {})
    return replace(
        table,
        main_params=main_params,
        proxy_params=proxy_params,
        proxy_tokens=int(keys.get("train.steps", cfg.train.steps)) * per_step,
        tokens_per_step=per_step,
        curves=lambda: _pooled_curves(roots),
    )


def _provenance(
    method: str,
    t: SweepTable,
    f: Any,
    n: int,
    result: FitResult,
    counted: dict[str, Any] | None,
    roots: Sequence[Path] = (),
) -> dict[str, Any]:
    """What the weights JSON records of the fit: the method's options, its held-out check, the
    sweep it was fitted to (its runs and compute; several pooled: `sweeps`, each one's path, and
    their runs and compute summed), what its caps count (`caps_counted`: the main run's pools and
    sequences), then the method's own record."""
    docs = [json.loads((r / SWEEP_FILE).read_text()) for r in roots or [t.root]]
    sweep = docs[0]
    pooled: dict[str, Any] = {}
    if len(docs) > 1:
        computes = [d.get("compute") or {} for d in docs]
        keys = [k for k in computes[0] if all(isinstance(c.get(k), (int, float)) for c in computes)]
        sweep = {
            "design": [row for d in docs for row in d.get("design", [])],
            "compute": {k: sum(c[k] for c in computes) for k in keys},
        }
        pooled = {"sweeps": [str(r) for r in roots]}
    return proposal_provenance(
        method=method,
        n_runs=n,
        held_out=result.held,
        seed=f.seed,
        **result.provenance,
        caps=t.caps,
        max_epochs=f.max_epochs,
        target_weights=t.target,
        predicted_loss=result.predicted,
        extra={
            "sweep": str(t.root),
            "sweep_runs": len(sweep.get("design", [])),
            "compute": sweep.get("compute"),
            "held_out_skipped": result.skipped,
            "caps_counted": counted,
            **pooled,
            **result.record,
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


class FitQualityError(DoReMiError):
    """A fit's held-out rank correlation is below `pipeline.guardrails.min_fit_spearman`: the
    pipeline stops before a main run trains on its proposal."""


def fit_quality(path: str | Path) -> dict[str, Any]:
    """A proposal's held-out quality from its weights file: `spearman` (None: undefined, a
    constant prediction), `mae`, `folds`, `n` when it was checked, else `skipped` (why not);
    `laws`, the line its method's `describe_fit` gives of what the fit was fitted to (the
    mixing law's extrapolating laws and their held-out checks), where it gives one."""
    doc = json.loads(Path(path).read_text())
    held = doc.get("held_out")
    spec = registry.specs().get(doc.get("method"))  # type: ignore[arg-type]
    line = spec.describe_fit(doc) if spec is not None and spec.describe_fit is not None else None
    laws = {"laws": line} if line is not None else {}
    if isinstance(held, dict):
        return {**{k: held.get(k) for k in ("spearman", "mae", "folds", "n")}, **laws}
    return {"skipped": doc.get("held_out_skipped") or "no held-out evaluation recorded", "n": doc.get("n_runs"), **laws}


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
