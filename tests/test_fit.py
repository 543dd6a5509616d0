"""The offline mixture search (doremi/offline/fit): designs, RegMix and data-mixing-law fits and proposers,
held-out evaluation and provenance, on synthetic sweeps whose loss is a known function of the
mixture.

Two synthetic truths over k = 4 domains, both with a known interior optimum:

- LAW: a data mixing law (Ye et al. 2025, Eq. 2) per validation domain, the target their mean;
  its optimum is found here by brute force on the 1/80 grid (an independent check of the convex
  solve): r_law = argmin over 91881 grid mixtures.
- BOWL: 3 + (r - r*)^T A (r - r*), r* = (0.5, 0.25, 0.15, 0.10), A = diag(1, 2, 3, 4): smooth, not
  a mixing law, optimum r* by construction.

Tolerances. The fits that can represent the truth exactly are held to numerical precision: the
law's parameters to 1e-4 noise-free, its proposal to L1 < 0.05 of the grid optimum (the grid's own
resolution is 1/80 per weight) and a true loss no worse than the grid's best + 1e-6. RegMix's
proposal is an average of simulated mixtures ranked by a regressor, so it is held to the share of
the gap closed between the uniform mixture (the prior here: what an uninformative regressor's
top-k average would return) and the optimum: gap = (L(uniform) - L(proposal)) / (L(uniform) -
L(opt)). Measured (seed 1): LightGBM 0.98 (bowl) and 0.99 (law) with 256 runs, ridge with
quadratic features 0.98 (bowl) and 0.83 (law; a quadratic only approximates the exponential law);
required >= 0.9, 0.9, 0.9 and 0.7. Uniform closes 0 and a linear ridge (a vertex optimum) closes
less than 0, both checked to fail the same test.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from doremi.methods.mixing_law.fit import (
    MixingLawOptions,
    canonical,
    fit_mixing_law,
    mixing_law_fit_predict,
    project_capped_simplex,
    propose_mixing_law,
)
from doremi.methods.regmix.fit import (
    LightGBMOptions,
    RegMixOptions,
    RidgeOptions,
    fit_regressor,
    propose_regmix,
    regmix_fit_predict,
)
from doremi.offline.fit import FitError
from doremi.offline.fit.design import (
    concat_designs,
    dirichlet_design,
    epoch_caps,
    grid_design,
    one_hot_design,
    smoothed_one_hot_design,
)
from doremi.offline.fit.evaluate import HeldOut, held_out, kfold_indices, spearman
from doremi.offline.provenance import proposal_provenance, write_proposal

K = 4
UNIFORM = np.full(K, 1.0 / K)
LAW = canonical(
    c=[2.0, 2.5, 1.8, 3.0],
    k=[1.0, 0.6, 1.5, 0.8],
    t=[[-3.0, 0.3, 0.2, 0.1], [0.2, -2.0, 0.4, 0.1], [0.1, 0.5, -4.0, 0.3], [0.3, 0.2, 0.1, -1.5]],
)
R_STAR = np.array([0.5, 0.25, 0.15, 0.10])
A = np.diag([1.0, 2.0, 3.0, 4.0])
NOISE = 0.002


def bowl(r: np.ndarray) -> np.ndarray:
    d = np.atleast_2d(r) - R_STAR
    return 3.0 + np.einsum("nj,jl,nl->n", d, A, d)


def law_target(r: np.ndarray) -> np.ndarray:
    return np.atleast_1d(LAW.target(np.atleast_2d(r)))


GRID = grid_design(K, 80).weights


def grid_optimum(f, caps=None) -> np.ndarray:
    g = GRID if caps is None else GRID[np.all(GRID <= np.asarray(caps) + 1e-12, axis=1)]
    return g[np.argmin(f(g))]


def sweep(n: int, seed: int = 1) -> np.ndarray:
    return dirichlet_design(UNIFORM, n, seed=seed).weights


def gap_closed(f, proposal: np.ndarray, optimum_loss: float) -> float:
    lu = f(UNIFORM)[0]
    return float((lu - f(proposal)[0]) / (lu - optimum_loss))


# ---- mixing law -----------------------------------------------------------------------------


def test_mixing_law_recovers_parameters_noise_free():
    r = sweep(96)
    law = fit_mixing_law(r, LAW.domain_losses(r))
    assert np.allclose(law.c, LAW.c, atol=1e-4)
    assert np.allclose(law.k, LAW.k, atol=1e-4)
    assert np.allclose(law.t, LAW.t, atol=1e-4)
    assert np.allclose(law.t.sum(axis=1), 0.0) and np.all(law.rmse < 1e-6)


def test_canonical_gauge_is_the_same_function():
    shifted = canonical(LAW.c, LAW.k * np.exp(-0.7), LAW.t + 0.7)
    assert np.allclose(shifted.t, LAW.t) and np.allclose(shifted.k, LAW.k)
    r = sweep(8)
    assert np.allclose(shifted.domain_losses(r), LAW.domain_losses(r))


def test_mixing_law_proposal_matches_the_true_optimum():
    r = sweep(96)
    law = fit_mixing_law(r, LAW.domain_losses(r))
    best = grid_optimum(law_target)
    prop = propose_mixing_law(law)
    assert np.abs(prop.weights - best).sum() < 0.05
    assert law_target(prop.weights)[0] <= law_target(best)[0] + 1e-6
    assert abs(prop.predicted - law_target(best)[0]) < 1e-3
    assert np.abs(UNIFORM - best).sum() > 0.05


def test_mixing_law_with_noise_and_caps():
    r = sweep(128)
    y = LAW.domain_losses(r) + np.random.default_rng(0).normal(0.0, NOISE, (128, K))
    law = fit_mixing_law(r, y)
    assert np.allclose(law.t, LAW.t, atol=0.1)
    caps = [0.25, 1.0, 1.0, 1.0]
    best = grid_optimum(law_target, caps)
    prop = propose_mixing_law(law, caps=caps)
    assert np.all(prop.weights <= np.asarray(caps) + 1e-9) and prop.weights[0] == pytest.approx(0.25, abs=1e-6)
    assert np.abs(prop.weights - best).sum() < 0.05
    assert law_target(prop.weights)[0] - law_target(best)[0] < 1e-3


def test_mixing_law_target_weights_and_single_target():
    r = sweep(64)
    s = np.array([0.7, 0.1, 0.1, 0.1])
    law = fit_mixing_law(r, LAW.domain_losses(r))
    prop = propose_mixing_law(law, target_weights=s)
    best = grid_optimum(lambda g: LAW.target(g, s))
    assert np.abs(prop.weights - best).sum() < 0.05
    one = fit_mixing_law(r, LAW.domain_losses(r)[:, 0])
    assert np.allclose(one.t[0], LAW.t[0], atol=1e-4)


def test_mixing_law_huber_option_fits():
    r = sweep(64)
    law = fit_mixing_law(r, LAW.domain_losses(r), MixingLawOptions(loss="huber", f_scale=0.05))
    assert np.allclose(law.t, LAW.t, atol=1e-3)


def test_project_capped_simplex():
    p = project_capped_simplex([0.9, 0.5, -0.2, 0.1], [0.5, 1.0, 1.0, 0.3])
    assert p.sum() == pytest.approx(1.0) and np.all(p >= 0) and p[0] <= 0.5 + 1e-12 and p[3] <= 0.3 + 1e-12


# ---- RegMix ---------------------------------------------------------------------------------


CASES = [
    ("lightgbm", None, "bowl", 0.9),
    ("lightgbm", None, "law", 0.9),
    ("ridge", RidgeOptions(degree=2), "bowl", 0.9),
    ("ridge", RidgeOptions(degree=2), "law", 0.7),
]
TRUTHS = {"bowl": (bowl, 3.0), "law": (law_target, None)}
SIM = RegMixOptions(n_simulations=20_000, top_k=128, seed=42)


@pytest.mark.parametrize("regressor,options,truth,required", CASES)
def test_regmix_proposal_closes_the_gap(regressor, options, truth, required):
    f, opt = TRUTHS[truth]
    opt = f(grid_optimum(f))[0] if opt is None else opt
    r = sweep(256)
    y = f(r) + np.random.default_rng(2).normal(0.0, NOISE, len(r))
    model = fit_regressor(r, y, regressor, options)
    prop = propose_regmix(model, UNIFORM, options=SIM)
    assert prop.weights.sum() == pytest.approx(1.0) and np.all(prop.weights >= 0)
    assert gap_closed(f, prop.weights, opt) >= required
    assert gap_closed(f, UNIFORM, opt) < required


def test_regmix_test_fails_a_wrong_regressor():
    r = sweep(256)
    model = fit_regressor(r, bowl(r), "ridge", RidgeOptions(degree=1))
    prop = propose_regmix(model, UNIFORM, options=SIM)
    assert gap_closed(bowl, prop.weights, 3.0) < 0.9


def test_regmix_respects_caps_and_is_deterministic():
    r = sweep(128)
    model = fit_regressor(r, bowl(r), "ridge", RidgeOptions(degree=2))
    caps = [0.3, 1.0, 1.0, 1.0]
    a = propose_regmix(model, UNIFORM, caps=caps, options=RegMixOptions(n_simulations=5000, top_k=32))
    b = propose_regmix(model, UNIFORM, caps=caps, options=RegMixOptions(n_simulations=5000, top_k=32))
    assert np.array_equal(a.weights, b.weights) and a.weights[0] <= 0.3 + 1e-6


def test_lightgbm_defaults_and_early_stopping():
    assert LightGBMOptions().num_iterations == 1000 and LightGBMOptions().learning_rate == 0.01
    r = sweep(128)
    m = fit_regressor(r, bowl(r), "lightgbm", LightGBMOptions(valid_fraction=0.2))
    assert 1 <= m.rounds <= 1000
    a = fit_regressor(r, bowl(r), "lightgbm").predict(r[:5])
    assert np.array_equal(a, fit_regressor(r, bowl(r), "lightgbm").predict(r[:5]))


# ---- held-out evaluation --------------------------------------------------------------------


def test_held_out_spearman_on_the_law():
    r = sweep(128)
    y = LAW.domain_losses(r) + np.random.default_rng(0).normal(0.0, NOISE, (128, K))
    law = held_out(mixing_law_fit_predict(), r, y, folds=5, seed=0)
    assert isinstance(law, HeldOut) and law.spearman > 0.99 and law.mae < 0.005 and law.n == 128
    gbm = held_out(regmix_fit_predict("lightgbm"), r, y.mean(axis=1), folds=5, seed=0)
    assert gbm.spearman > 0.9
    again = held_out(regmix_fit_predict("lightgbm"), r, y.mean(axis=1), folds=5, seed=0)
    assert again == gbm


def test_kfold_and_spearman():
    folds = kfold_indices(23, 5, seed=3)
    assert sorted(np.concatenate(folds).tolist()) == list(range(23))
    assert {len(f) for f in folds} <= {4, 5}
    assert all(np.array_equal(a, b) for a, b in zip(folds, kfold_indices(23, 5, seed=3)))
    assert spearman(np.array([1.0, 2, 3, 4]), np.array([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 2, 3]), np.array([3.0, 2, 1])) == pytest.approx(-1.0)
    assert math.isnan(spearman(np.ones(4), np.arange(4.0)))


# ---- designs --------------------------------------------------------------------------------


def test_dirichlet_design_caps_minimum_determinism():
    prior = np.array([0.5, 0.3, 0.15, 0.05])
    caps = epoch_caps([500, 300, 150, 50], budget_tokens=1000, max_epochs=2.0)
    assert np.allclose(caps, [1.0, 0.6, 0.3, 0.1])
    d = dirichlet_design(prior, 200, seed=7, concentration=(0.1, 5.0), min_weight=0.02, caps=caps)
    w = d.weights
    assert w.shape == (200, K) and len(d) == 200 and len(d.names) == len(d.params) == 200
    assert np.allclose(w.sum(axis=1), 1.0)
    assert np.all(w <= caps + 1e-9)
    assert np.all((w == 0) | (w >= 0.02))
    assert all(0.1 <= p["concentration"] <= 5.0 for p in d.params)
    assert np.array_equal(w, dirichlet_design(prior, 200, seed=7, min_weight=0.02, caps=caps).weights)
    assert not np.array_equal(w, dirichlet_design(prior, 200, seed=8, min_weight=0.02, caps=caps).weights)
    assert json.dumps(d.rows()[0])


def test_epoch_caps_keep_their_slack():
    """A sweep counts its caps in sequences over its pools, with one of slack (the exact sampler's
    realised count may run one past the nominal one): (2 x 9 - 1) / 40 = 0.425; a pool too small
    to give a sequence within the slack gets a cap of 0."""
    assert epoch_caps([9, 28, 58], budget_tokens=40, max_epochs=2.0, slack=1.0).tolist() == [0.425, 1.0, 1.0]
    assert epoch_caps([1, 80], budget_tokens=40, max_epochs=0.5, slack=1.0).tolist() == [0.0, 39 / 40]
    assert epoch_caps([9, 28, 58], budget_tokens=40, max_epochs=2.0).tolist() == [0.45, 1.0, 1.0]


@pytest.mark.parametrize(
    "kwargs, weights_sha, params_sha",
    [
        (
            dict(prior=[0.5, 0.3, 0.2], n=5, seed=0),
            "8bd47d7d0243a11971bfadede04a7a1dd3e22df8bc8178f22dbef6530bd1ccaa",
            "02c16a5e6ca975199e669737a1b52330f2647cc5fada3437b720253d5517fd80",
        ),
        (
            dict(prior=[0.1, 0.2, 0.3, 0.4], n=7, seed=3, temperature=0.5, min_weight=0.05),
            "12a35cadaf76b925b22b1cbc9f012907bb076669753a6ff8d7f7a1cd820f299f",
            "69156ce8b9d0c7244aa6da63e784cc60dead98ebbdb9ba8880a076dce726be2d",
        ),
        (
            dict(prior=[0.25] * 4, n=6, seed=11, caps=[0.6, 0.6, 0.9, 1.0], concentration=(0.5, 2.0)),
            "0665553d9b553aa30c552ed2b70b4b296da0f5f99df3b643ce6467debebf10db",
            "734d6d381fd2bf67db6c00190d5cfc7bcd7c5d5073a6c1a85340ca2dd8dafc4a",
        ),
    ],
)
def test_dirichlet_design_bit_for_bit_as_before_its_split(kwargs, weights_sha, params_sha):
    """The hashes were computed with `dirichlet_design` before it was split into named pieces
    (issue 43): the same weights to the last bit and the same concentrations. The capped cases
    are not hashed: their bits differ between CPU hosts (on an AMD EPYC host the pre-split code
    and this one agree with each other, not with hashes taken on another host), so they are
    checked by `test_capped_dirichlet_design_is_repeatable_and_within_its_bounds`."""
    import hashlib

    d = dirichlet_design(**kwargs)
    assert hashlib.sha256(d.weights.tobytes()).hexdigest() == weights_sha
    assert hashlib.sha256(repr(d.params).encode()).hexdigest() == params_sha


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prior=[0.7, 0.2, 0.1], n=300, seed=5, min_weight=0.02, caps=[0.8, 0.9, 0.9]),
        dict(prior=[0.7, 0.2, 0.1], n=50, seed=2, min_weight=0.05, caps=[0.5, 0.5, 0.5]),
    ],
)
def test_capped_dirichlet_design_is_repeatable_and_within_its_bounds(kwargs):
    import hashlib

    a, b = dirichlet_design(**kwargs), dirichlet_design(**kwargs)
    assert hashlib.sha256(a.weights.tobytes()).hexdigest() == hashlib.sha256(b.weights.tobytes()).hexdigest()
    assert repr(a.params) == repr(b.params)
    w = a.weights
    assert w.shape == (kwargs["n"], 3)
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=0, atol=1e-12)
    assert (w <= np.asarray(kwargs["caps"]) + 1e-12).all()
    assert ((w == 0) | (w >= kwargs["min_weight"] - 1e-12)).all()


def test_grid_and_one_hot_designs():
    g = grid_design(3, 10)
    assert len(g) == math.comb(12, 2) == 66
    assert np.allclose(g.weights.sum(axis=1), 1.0) and np.allclose(g.weights * 10, np.round(g.weights * 10))
    assert len({tuple(x) for x in g.weights}) == 66
    capped = grid_design(3, 10, caps=[0.5, 1.0, 1.0], min_weight=0.2)
    assert np.all(capped.weights[:, 0] <= 0.5) and np.all((capped.weights == 0) | (capped.weights >= 0.2 - 1e-12))
    assert np.array_equal(one_hot_design(3).weights, np.eye(3))
    assert one_hot_design(3, caps=[1.0, 0.5, 1.0]).params == ({"domain": 0}, {"domain": 2})
    s = smoothed_one_hot_design(4, 0.1).weights
    assert np.allclose(np.diag(s), 0.9) and np.allclose(s[0, 1:], 0.1 / 3)
    both = concat_designs(one_hot_design(3), g)
    assert len(both) == 69 and both.names[0] == "one_hot" and both.names[-1] == "grid"


# ---- provenance -----------------------------------------------------------------------------


def test_provenance_written_through_weights_file(tmp_path):
    from data.sampling.weights_file import read_weights_file

    h = HeldOut(spearman=0.97, mae=0.01, folds=5, n=128, seed=0)
    prov = proposal_provenance(
        method="regmix",
        regressor="lightgbm",
        n_runs=128,
        held_out=h,
        seed=42,
        prior=np.array([0.25] * 4),
        top_k=128,
        n_simulations=100_000,
        caps=np.ones(4),
    )
    path = write_proposal(tmp_path / "weights.json", ["a", "b", "c", "d"], np.array([0.4, 0.3, 0.2, 0.1]), prov)
    doc = read_weights_file(path)
    assert doc["method"] == "regmix" and doc["held_out"]["spearman"] == 0.97 and doc["top_k"] == 128
    assert doc["prior"] == [0.25] * 4 and "max_epochs" not in doc


# ---- bad input ------------------------------------------------------------------------------


def _one_line(exc: pytest.ExceptionInfo) -> None:
    assert isinstance(exc.value, ValueError) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: fit_mixing_law(np.ones((10, 3)), np.ones(10)), "rows summing to 1"),
        (lambda: fit_mixing_law(np.full((10, 2), 0.5), np.ones(9)), r"expected an array \[10\]"),
        (lambda: fit_mixing_law(np.full((10, 2), 0.5), np.r_[np.ones(9), np.nan]), "NaN"),
        (lambda: fit_mixing_law(np.full((3, 4), 0.25), np.ones(3)), "too few"),
        (lambda: fit_regressor(np.full(4, 0.25), np.ones(4), "ridge"), "expected an array"),
        (lambda: fit_regressor(np.full((5, 2), 0.5), np.ones(5), "svm"), "lightgbm or ridge"),
        (lambda: held_out(regmix_fit_predict("ridge"), np.full((6, 2), 0.5), np.ones(6), folds=5), "too few"),
        (lambda: kfold_indices(10, 1), "folds"),
        (lambda: dirichlet_design([0.5, 0.5], 4, seed=0, caps=[0.4, 0.4]), "no mixture fits"),
        (lambda: dirichlet_design([0.5, 0.0], 4, seed=0), "positive"),
        (lambda: dirichlet_design([0.9, 0.1], 4, seed=0, caps=[0.505, 0.5], max_draws=20), "within the caps"),
        (lambda: grid_design(1, 4), "k:"),
        (lambda: epoch_caps([1, 2], budget_tokens=0, max_epochs=1), "budget_tokens"),
        (lambda: epoch_caps([1, 2], budget_tokens=1, max_epochs=1, slack=-1), "slack"),
        (
            lambda: propose_regmix(
                fit_regressor(sweep(8), np.ones(8), "ridge"), UNIFORM, options=RegMixOptions(100, 200)
            ),
            "top_k",
        ),
        (lambda: proposal_provenance(method="doge", n_runs=1, held_out=None, seed=0), "method"),
    ],
)
def test_bad_input_one_line_errors(call, match):
    with pytest.raises(FitError, match=match) as exc:
        call()
    _one_line(exc)
