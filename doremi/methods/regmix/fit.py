"""RegMix (Liu et al., ICLR 2025, "RegMix: Data Mixture as Regression for Language Model
Pre-training"): a regressor from a run's domain weights to its target loss, then the top-k
average of many simulated mixtures ranked by the regressor.

Regressors (Sec. 2.3, Table 1 there):

- gradient-boosted trees, LightGBM, with the authors' settings (github sail-sg/regmix,
  `regression_fitting/regression.ipynb`): gbdt, L2 objective, 1000 iterations, learning rate
  0.01, seed 42, LightGBM's other defaults (31 leaves, 20 samples per leaf), early stopping after
  3 rounds without gain on a validation set (used here when `valid_fraction` > 0: the notebook
  stops on its separate test mixtures, which a sweep does not have);
- ridge regression y ~ b + beta . phi(r), closed form, the intercept unpenalised: phi(r) = r
  (degree 1, the paper's linear regression) or r with the products r_j r_l (degree 2, not in the
  paper: a linear model's optimum is a vertex of the simplex, a quadratic one can be interior).

Proposer (Sec. 2.4; the notebook's "Simulate" cells): draw `n_simulations` mixtures from
Dir(c * p) around the prior p (the notebook: p = token distribution, c = 1, 100000 draws), predict
each, and average the `top_k` (the notebook: 128) with the lowest predicted loss. Draws above an
epoch cap are rejected (`doremi.offline.fit.design.dirichlet_design`), so the average, a convex combination of
capped mixtures, is within the caps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from doremi.offline.fit.checks import FitError, as_caps, as_distribution, as_losses, as_mixtures
from doremi.offline.fit.design import dirichlet_design


class Regressor(Protocol):
    """A fitted model: predicted target loss for mixtures [n, k] -> [n]."""

    def predict(self, weights: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class LightGBMOptions:
    """LightGBM settings; defaults are the RegMix authors' (`regression.ipynb`, `hyper_params`)
    and LightGBM's own. `valid_fraction` > 0 holds out that share of the runs (the last ones of a
    `default_rng(seed)` permutation) for early stopping after `early_stopping_rounds`."""

    num_iterations: int = 1000
    learning_rate: float = 1e-2
    num_leaves: int = 31
    min_data_in_leaf: int = 20
    seed: int = 42
    early_stopping_rounds: int = 3
    valid_fraction: float = 0.0
    num_threads: int = 1


@dataclass(frozen=True)
class RidgeOptions:
    """Ridge penalty `alpha` on the (unstandardised) features; `degree` 1 (linear, the paper's)
    or 2 (with pairwise products)."""

    alpha: float = 1e-4
    degree: Literal[1, 2] = 1


@dataclass(frozen=True)
class RegMixOptions:
    """Proposer settings (the authors' notebook): `n_simulations` draws from Dir(c p) with c in
    `concentration` (log-uniform; (1, 1): c = 1), the mean of the `top_k` best predicted; `seed`
    for the draws."""

    n_simulations: int = 100_000
    top_k: int = 128
    concentration: tuple[float, float] = (1.0, 1.0)
    seed: int = 42


@dataclass(frozen=True)
class LightGBMModel:
    """A fitted LightGBM booster and the number of boosting rounds it kept."""

    booster: Any
    rounds: int

    def predict(self, weights: np.ndarray) -> np.ndarray:
        return np.asarray(self.booster.predict(np.asarray(weights, dtype=np.float64)), dtype=np.float64)


@dataclass(frozen=True)
class RidgeModel:
    """y = intercept + coef . phi(r), phi of `degree` (see `ridge_features`)."""

    intercept: float
    coef: np.ndarray
    degree: int

    def predict(self, weights: np.ndarray) -> np.ndarray:
        return self.intercept + ridge_features(np.asarray(weights, dtype=np.float64), self.degree) @ self.coef


@dataclass(frozen=True)
class RegMixProposal:
    """The top-k average `weights`, the regressor's prediction there (`predicted`) and the mean
    prediction over the top k (`top_k_predicted`)."""

    weights: np.ndarray
    predicted: float
    top_k_predicted: float
    n_simulations: int
    top_k: int


def ridge_features(r: np.ndarray, degree: int) -> np.ndarray:
    """phi(r): the weights r_j, and for degree 2 also r_j r_l for j <= l."""
    if degree == 1:
        return r
    if degree == 2:
        j, l = np.triu_indices(r.shape[1])
        return np.concatenate([r, r[:, j] * r[:, l]], axis=1)
    raise FitError(f"degree: expected 1 or 2, got {degree}")


def fit_ridge(weights: Any, target: Any, options: RidgeOptions | None = None) -> RidgeModel:
    """Closed-form ridge: beta = (Xc^T Xc + alpha I)^-1 Xc^T yc on centred features Xc and target
    yc, intercept = mean(y) - mean(X) . beta (unpenalised)."""
    options = options or RidgeOptions()
    r = as_mixtures(weights)
    y = as_losses(target, r.shape[0], "target")
    if y.ndim != 1:
        raise FitError(f"target: expected one loss per run [{r.shape[0]}], got shape {y.shape}")
    if not (math.isfinite(options.alpha) and options.alpha >= 0):
        raise FitError(f"alpha: expected a non-negative number, got {options.alpha}")
    n, k = r.shape
    need = k if options.degree == 1 else k * (k + 1) // 2
    if n < max(need, 2):
        # On the simplex an intercept and k weights (or the k(k+1)/2 products) have this many
        # free parameters: fewer runs leave a direction the penalty alone decides.
        raise FitError(
            f"ridge: {n} runs are too few for degree {options.degree} over {k} domains; expected at least {max(need, 2)}"
        )
    x = ridge_features(r, options.degree)
    xm, ym = x.mean(axis=0), y.mean()
    xc = x - xm
    gram = xc.T @ xc + options.alpha * np.eye(x.shape[1])
    beta = np.linalg.lstsq(gram, xc.T @ (y - ym), rcond=None)[0]
    return RidgeModel(intercept=float(ym - xm @ beta), coef=beta, degree=options.degree)


def _lightgbm() -> Any:
    try:
        import lightgbm
    except ImportError:
        raise FitError("regmix: the lightgbm regressor needs lightgbm (pip install 'doremi-mix[sweep]')") from None
    return lightgbm


def check_splittable(n_train: int, min_data_in_leaf: int) -> None:
    """Refuse a tree fit that cannot split: with fewer than 2 x min_data_in_leaf runs every tree
    is one leaf, the booster predicts the mean loss for every mixture, and the proposal would
    be the average of the first top_k simulated draws (the prior), not a fitted optimum."""
    if n_train < 2 * min_data_in_leaf:
        raise FitError(
            f"lightgbm: {n_train} runs are too few for trees with min_data_in_leaf {min_data_in_leaf} "
            f"(no split below {2 * min_data_in_leaf} runs: the fit would be a constant); "
            "use more runs or fit.regressor: ridge"
        )


def fit_lightgbm(weights: Any, target: Any, options: LightGBMOptions | None = None) -> LightGBMModel:
    """Gradient-boosted trees from weights to target (RegMix's regressor, the authors' settings)."""
    options = options or LightGBMOptions()
    r = as_mixtures(weights)
    y = as_losses(target, r.shape[0], "target")
    if y.ndim != 1:
        raise FitError(f"target: expected one loss per run [{r.shape[0]}], got shape {y.shape}")
    if not (0.0 <= options.valid_fraction < 1.0):
        raise FitError(f"valid_fraction: expected a number in [0, 1), got {options.valid_fraction}")
    n_valid = int(round(options.valid_fraction * r.shape[0]))
    if r.shape[0] - n_valid < 2 or (options.valid_fraction > 0 and n_valid < 1):
        raise FitError(f"lightgbm: {r.shape[0]} runs are too few for valid_fraction {options.valid_fraction}")
    check_splittable(r.shape[0] - n_valid, options.min_data_in_leaf)
    lgb = _lightgbm()
    params = {
        "objective": "regression",
        "boosting_type": "gbdt",
        "learning_rate": options.learning_rate,
        "num_leaves": options.num_leaves,
        "min_data_in_leaf": options.min_data_in_leaf,
        "seed": options.seed,
        "deterministic": True,
        "force_col_wise": True,
        "num_threads": options.num_threads,
        "verbosity": -1,
    }
    if n_valid:
        order = np.random.default_rng(options.seed).permutation(r.shape[0])
        tr, va = order[:-n_valid], order[-n_valid:]
        train = lgb.Dataset(r[tr], y[tr], params={"verbosity": -1})
        valid = lgb.Dataset(r[va], y[va], reference=train)
        booster = lgb.train(
            params,
            train,
            num_boost_round=options.num_iterations,
            valid_sets=[valid],
            callbacks=[lgb.early_stopping(options.early_stopping_rounds, verbose=False)],
        )
        return LightGBMModel(booster=booster, rounds=int(booster.best_iteration or options.num_iterations))
    booster = lgb.train(params, lgb.Dataset(r, y, params={"verbosity": -1}), num_boost_round=options.num_iterations)
    return LightGBMModel(booster=booster, rounds=options.num_iterations)


def fit_regressor(
    weights: Any,
    target: Any,
    regressor: Literal["lightgbm", "ridge"] = "lightgbm",
    options: LightGBMOptions | RidgeOptions | None = None,
) -> Regressor:
    """`fit_lightgbm` or `fit_ridge` by name."""
    if regressor == "lightgbm":
        if options is not None and not isinstance(options, LightGBMOptions):
            raise FitError(f"regmix: lightgbm takes LightGBMOptions, got {type(options).__name__}")
        return fit_lightgbm(weights, target, options)
    if regressor == "ridge":
        if options is not None and not isinstance(options, RidgeOptions):
            raise FitError(f"regmix: ridge takes RidgeOptions, got {type(options).__name__}")
        return fit_ridge(weights, target, options)
    raise FitError(f"regressor: expected lightgbm or ridge, got {regressor!r}")


def propose_regmix(
    model: Regressor,
    prior: Sequence[float] | np.ndarray,
    *,
    caps: Sequence[float] | np.ndarray | None = None,
    options: RegMixOptions | None = None,
) -> RegMixProposal:
    """RegMix's proposal: the mean of the `top_k` of `n_simulations` mixtures drawn around the
    prior (within the caps) with the lowest predicted target."""
    options = options or RegMixOptions()
    p = np.asarray(prior, dtype=np.float64)
    p = as_distribution(p, p.size, "prior")
    u = as_caps(caps, p.size)
    if not (1 <= options.top_k <= options.n_simulations):
        raise FitError(f"top_k: expected 1 <= top_k <= n_simulations ({options.n_simulations}), got {options.top_k}")
    sims = dirichlet_design(
        p, options.n_simulations, seed=options.seed, concentration=options.concentration, caps=u
    ).weights
    pred = np.asarray(model.predict(sims), dtype=np.float64)
    if pred.shape != (sims.shape[0],) or not np.all(np.isfinite(pred)):
        raise FitError(f"regmix: the regressor returned {pred.shape} predictions (or non-finite ones)")
    if np.ptp(pred) == 0:
        raise FitError(
            f"regmix: the regressor predicts the same loss for all {sims.shape[0]} simulated mixtures, "
            "so it ranks none above another; the sweep's losses do not vary with the mixture it saw"
        )
    top = np.argsort(pred, kind="stable")[: options.top_k]
    w = sims[top].mean(axis=0)
    w = w / w.sum()
    return RegMixProposal(
        weights=w,
        predicted=float(model.predict(w[None, :])[0]),
        top_k_predicted=float(pred[top].mean()),
        n_simulations=options.n_simulations,
        top_k=options.top_k,
    )


def regmix_fit_predict(
    regressor: Literal["lightgbm", "ridge"] = "lightgbm", options: LightGBMOptions | RidgeOptions | None = None
) -> Any:
    """A `doremi.offline.fit.evaluate.FitPredict` for its `held_out` (a scalar target per run)."""

    def fit_predict(r_train: np.ndarray, y_train: np.ndarray, r_test: np.ndarray) -> np.ndarray:
        return fit_regressor(r_train, y_train, regressor, options).predict(r_test)

    return fit_predict
