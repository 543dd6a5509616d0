"""ADO's `variant: authors` (doremi/methods/ado/method.py) against the released code, yidingjiang/ado at
commit bc3d8d0e4d6a13f40f03b2e8fb83369d773a2611, file src/data_selectors/ado.py (cited as L<n>):
the update by hand from its equations, its history (per-step rows, imputation, Savitzky-Golay,
every 10th step) and its soft-bounded fit against numbers derived independently."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from doremi.methods.ado.method import (
    ADO,
    ADOConfig,
    _soft_value_grad,
    fit_soft_bounds,
    released_speed,
    smooth_history,
    start_grid,
)
from tests.method_context import method_context
from trainer.config.tools import ConfigError
from trainer.run.hooks import MethodContext, StepSignals

DOMAINS = ["a", "b", "c"]
S = 4
#: (beta, alpha, eps) set by hand; b's alpha is under the released floor 0.05 (L96).
LAWS = [(20.0, 0.6, 1.0), (3.0, 0.02, 2.0), (0.05, 0.5, 1.8)]

#: The fits batch 512 starts of a few points: many small tensor ops, faster on one thread.
pytestmark = pytest.mark.usefixtures("one_thread")


def make_ctx(tmp_path, steps=20, train_tokens=(500, 300, 200)) -> MethodContext:
    return method_context(tmp_path, DOMAINS, steps, 4, S, train_tokens)


def signals(counts, losses) -> StepSignals:
    counts = np.asarray(counts, dtype=np.int64)
    tokens = counts.astype(np.float64) * S
    return StepSignals(
        weights=np.full(3, 1 / 3),
        sequences=counts,
        tokens=torch.tensor(tokens, dtype=torch.float64),
        loss_sum=torch.tensor(np.asarray(losses, dtype=np.float64) * tokens, dtype=torch.float64),
    )


def assert_state(method: ADO, h, rho, policy, average, average_abs: float = 1e-14) -> None:
    """The released update's state after a step: the smoothed credit h (L135-137), the
    preference rho, the policy p and its time average p_avg (L113-114)."""
    assert method.h.tolist() == pytest.approx(h, abs=1e-15)
    assert method.rho.tolist() == pytest.approx(rho, abs=1e-14)
    assert method.policy.tolist() == pytest.approx(policy, abs=1e-14)
    assert method.average.tolist() == pytest.approx(average, abs=average_abs)


def test_variant_defaults_and_draws(tmp_path):
    cfg = ADOConfig()
    cfg.validate()
    assert cfg.variant == "authors" and cfg.warmup == 1000 and cfg.refit_every == 1000 and cfg.record_every == 10
    assert [cfg.choice(n) for n in ("count", "credit", "average", "floor_on")] == [
        "total",
        "counts",
        "preference",
        "preference",
    ]
    assert cfg.credit_smoothing == 0.1 and cfg.credit_exponent == 0.5 and cfg.policy_mix == 0.1 and cfg.floor == 0.01
    paper = ADOConfig(variant="paper", count="total")
    assert [paper.choice(n) for n in ("count", "credit", "average", "floor_on")] == [
        "total",
        "policy",
        "policy",
        "policy",
    ]
    # their loader draws each sequence's domain from the policy (adaptive_loader.py L96)
    assert ADO(cfg, make_ctx(tmp_path)).needs.draws == "random"
    assert ADO(paper, make_ctx(tmp_path)).needs.draws == "exact"
    with pytest.raises(ConfigError, match=r"^mixing.ado.variant: expected one of 'authors', 'paper', got 'x'$"):
        ADOConfig(variant="x").validate()


def test_released_update_by_hand(tmp_path):
    """Two steps of `update` + `curr_dist` (their itr 0 and 1 = our steps 1 and 2) with the laws
    set by hand (their `current_params` = (log beta, log eps, alpha), start_step 0), mu = (0.5,
    0.3, 0.2), counts (3, 1, 0) then (1, 2, 1). Each number follows the released line named:
      n = total sequences seen, the step's own included                   L99-100, L129-131
      h = 0.9 h + 0.1 counts / sum(counts), h(0) = mu                      L135-137, L54
      slope = max(alpha, 0.05) (L(n) - eps) / n                            L94-101
      dist = slope mu h^0.5 / sum, clipped at 0.01 and renormalised         L105-111, L245-250
      p = 0.9 p_avg + 0.1 dist; p_avg = (1 - 1/(itr+1)) p_avg + dist/(itr+1) L113-114
    e.g. at itr 0: n = 4, slope_a = 0.6 * 20 * 4^-0.6 / 4 = 1.3058258..., slope_b = 0.05 * 3 *
    4^-0.02 / 4 = 0.0364745... (floored alpha), h = (0.525, 0.295, 0.18)."""
    cfg = ADOConfig(warmup=10, refit_every=10, record_every=1)
    method = ADO(cfg, make_ctx(tmp_path))
    method.params = [list(law) for law in LAWS]
    method.after_step(1, signals([3, 1, 0], [5.0, 6.0, 7.0]))
    assert_state(
        method,
        h=[0.525, 0.295, 0.18],
        rho=[0.9778095304983008, 0.012284052972177042, 0.009906416529522377],
        policy=[0.5477809530498301, 0.2712284052972177, 0.18099064165295226],
        average=method.rho.tolist(),
        average_abs=1e-15,
    )
    method.after_step(2, signals([1, 2, 1], [4.0, 5.0, 6.0]))
    assert_state(
        method,
        h=[0.4975, 0.3155, 0.187],
        rho=[0.9707263628306205, 0.01936660163665248, 0.009907035532727131],
        policy=[0.9771012137315328, 0.012992307838624586, 0.009906478429842852],
        average=[0.9742679466644606, 0.01582532730441476, 0.009906726031124753],
    )
    # the clip may leave an entry under 0.01 (L245-250): no second floor on the policy
    assert method.policy[2] < 0.01
    method.close()


def test_released_speed_floors_alpha_only_in_the_slope():
    # L96-101: expnt = max(alpha, 0.05), L(n) with the fitted alpha
    assert released_speed(4.0, 3.0, 0.02, 2.0) == pytest.approx(0.05 * 3.0 * 4.0**-0.02 / 4.0, rel=1e-15)
    assert released_speed(4.0, 20.0, 0.6, 1.0) == pytest.approx(0.6 * 20.0 * 4.0**-0.6 / 4.0, rel=1e-15)


def test_released_history_rows_imputation_and_kept_rows(tmp_path):
    """L144-153: a domain's loss is its batch mean; an absent domain repeats its last row, or on
    the first row takes the batch's mean loss; rows are float32 (`task_loss_TxK`, L46). Kept rows:
    row >= warmup, every record_every-th (L221: `[ignore_steps::10]`), n the cumulative count."""
    cfg = ADOConfig(warmup=1, refit_every=100, record_every=2)
    method = ADO(cfg, make_ctx(tmp_path))
    method.after_step(1, signals([3, 1, 0], [5.1, 6.0, 7.0]))
    method.after_step(2, signals([0, 2, 2], [0.0, 5.5, 6.5]))
    method.after_step(3, signals([4, 0, 0], [4.5, 0.0, 0.0]))
    method.after_step(4, signals([1, 1, 2], [4.25, 5.0, 6.0]))
    mean1 = (3 * 5.1 + 6.0) / 4
    want = np.array([[5.1, 6.0, mean1], [5.1, 5.5, 6.5], [4.5, 5.5, 6.5], [4.25, 5.0, 6.0]], dtype=np.float32)
    assert method.rows[: method.row_count].tolist() == want.tolist()
    assert method.kept == [1, 3] and method.kept_n == [[8.0] * 3, [16.0] * 3]
    method.close()


def test_savgol_reproduces_a_cubic_and_shrinks_for_short_histories():
    """A Savitzky-Golay filter of order 3 returns a cubic unchanged (interior and `interp` edges)."""
    t = np.arange(150, dtype=np.float64)
    cubic = 3.0 + 0.02 * t - 3e-4 * t**2 + 1e-6 * t**3
    rows = np.stack((cubic, 2 * cubic), axis=1)
    assert np.allclose(smooth_history(rows), rows, rtol=0, atol=1e-11)
    assert np.allclose(smooth_history(rows[:8]), rows[:8], rtol=0, atol=1e-12)  # window 7
    noisy = rows + 0.01 * np.sin(7 * t)[:, None]
    assert not np.allclose(smooth_history(noisy), noisy, rtol=0, atol=1e-3)
    assert smooth_history(noisy[:4]).tolist() == noisy[:4].tolist()  # fewer than 5 rows: as is


def test_rows_before_row0_cannot_reach_a_kept_point(tmp_path):
    """The method keeps rows from warmup - 100 on: the smoothed values at kept rows equal those of
    the whole history (the released code smooths all of it, L223-224)."""
    rng = np.random.default_rng(0)
    full = 4.0 + 0.1 * rng.standard_normal((400, 2))
    warmup = 250
    kept = np.arange(warmup, 400, 10)
    whole = smooth_history(full)[kept]
    row0 = warmup - 100
    assert np.allclose(smooth_history(full[row0:])[kept - row0], whole, rtol=0, atol=1e-13)


def test_start_grid_is_the_released_one():
    grid = start_grid()  # L294-299
    assert grid.shape == (512, 3)
    assert sorted(set(grid[:, 0].tolist())) == [-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert sorted(set(grid[:, 1].tolist())) == [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5]
    assert len(set(grid[:, 2].tolist())) == 8 and grid[:, 2].max() == pytest.approx(0.7, abs=1e-7)
    assert grid[:9].tolist()[8] == [-2.0, -1.5, 0.0]  # meshgrid 'ij': alpha fastest


def test_soft_objective_and_gradient_by_hand():
    """L273-284 at one point: log L = log 3, n = 100, (a, e, alpha) = (1, 0, 0.5): pred = log(e^1 /
    10 + 1), residual r = log 3 - pred, huber = 1e-3 (|r| - 5e-4); the penalties: e_term = 0.5,
    alpha_term2 = -0.001, the others 0."""
    theta = torch.tensor([[1.0, 0.0, 0.5]], dtype=torch.float64)
    logn = torch.tensor([[math.log(100.0)]], dtype=torch.float64)
    y = torch.tensor([[math.log(3.0)]], dtype=torch.float64)
    value, grad = _soft_value_grad(theta, logn, y, torch.ones_like(y))
    pred = math.log(math.e / 10 + 1)
    r = math.log(3.0) - pred
    assert value.item() == pytest.approx(1e-3 * (abs(r) - 5e-4) + 0.5 - 0.001, abs=1e-15)
    share = (math.e / 10) / (math.e / 10 + 1)
    sign = 1.0 if r > 0 else -1.0
    want = [-1e-3 * sign * share, -1e-3 * sign * (1 - share) - 1.0, 1e-3 * sign * share * math.log(100.0)]
    assert grad[0].tolist() == pytest.approx(want, abs=1e-15)
    # a tie at a soft bound splits the slope in halves, as JAX's max/min do: e = 0.5 exactly
    _, g = _soft_value_grad(torch.tensor([[1.0, 0.5, 0.5]], dtype=torch.float64), logn, y, torch.zeros_like(y))
    assert g[0].tolist() == [0.0, -0.5, 0.0]


def test_fit_inside_the_soft_bounds_recovers_the_law():
    """Points exactly on L = 2 + 40 n^-0.35 (log eps = 0.69 >= 0.5, log beta = 3.69 <= 6.5):
    every term of L273-284 is >= its least value, -0.001 (alpha_term2), reached only with zero
    residuals, so the generating law is the fit's unique minimum."""
    n = np.array([2560.0, 5120.0, 12800.0, 25600.0, 64000.0, 128000.0])
    fit = fit_soft_bounds(n[None], (2.0 + 40.0 * n**-0.35)[None])
    beta, alpha, eps = fit[0]
    assert beta == pytest.approx(40.0, rel=1e-4) and alpha == pytest.approx(0.35, abs=1e-5)
    assert eps == pytest.approx(2.0, abs=1e-5)


def test_fit_irreducible_loss_bound_binds_under_1000_points():
    """Points on L = 1.2 + 30 n^-0.3 (eps below the soft bound e^0.5 = 1.6487). Under 1000 points
    the bound is hard: the Huber terms change by at most 1e-3 per point per unit of log eps, the
    penalty by 1 (L253-257, L283), so the fit has log eps = 0.5 exactly. (beta, alpha) then minimise
    the Huber terms with eps = e^0.5; derived separately by Nelder-Mead over (log beta, alpha) from
    a 13 x 8 grid of starts (xatol 1e-12): log beta = 3.82185824, alpha = 0.37623671."""
    n = np.array([1e3, 2e3, 4e3, 8e3, 1.6e4, 3.2e4])
    fit = fit_soft_bounds(np.stack((n, n)), np.stack((1.2 + 30.0 * n**-0.3, 1.2 + 30.0 * n**-0.3)))
    assert fit[0].tolist() == fit[1].tolist()
    beta, alpha, eps = fit[0]
    assert eps == pytest.approx(math.exp(0.5), abs=1e-6)
    assert beta == pytest.approx(math.exp(3.82185824), rel=1e-4) and alpha == pytest.approx(0.37623671, abs=1e-5)


def test_fit_rows_without_points_are_nan():
    n = np.array([[1e3, 2e3, 4e3], [1e3, 2e3, 4e3]])
    loss = 2.0 + 40.0 * n**-0.35
    fit = fit_soft_bounds(n, loss, valid=np.array([[True] * 3, [False] * 3]))
    assert np.isnan(fit[1]).all() and np.isfinite(fit[0]).all()


def test_refit_schedule_is_the_released_one(tmp_path):
    """L178: refit at itr >= start_step with itr % update_interval == 0 (itr = step - 1); the
    first fit sees the kept rows up to itr (a single one when warmup is a multiple of the interval)."""
    cfg = ADOConfig(warmup=3, refit_every=2, record_every=1)
    method = ADO(cfg, make_ctx(tmp_path))
    refits, rng = [], np.random.default_rng(1)
    for t in range(1, 9):
        counts = [2, 1, 1]
        losses = [6.0 - 0.3 * math.log(t), 6.5 - 0.1 * math.log(t), 7.0 - 0.2 * math.log(t)] + 0.001 * rng.random(3)
        row = method.after_step(t, signals(counts, losses))
        if "ado_alpha" in row:
            refits.append((t, len(method.kept)))
    assert refits == [(5, 2), (7, 4)]
    assert all(p is not None for p in method.params)
    method.close()


def test_authors_resume_is_bitwise(tmp_path):
    cfg = ADOConfig(warmup=2, refit_every=4, record_every=1)

    def feed(method, first, last):
        out = []
        for t in range(first, last + 1):
            counts = [1 + t % 2, 1, 2 - t % 2]
            losses = [6.0 / t**0.2, 5.0 / t**0.1, 7.0 / t**0.3]
            method.after_step(t, signals(counts, losses))
            out.append(method.sampling_weights(t + 1).tolist())
        return out

    a = ADO(cfg, make_ctx(tmp_path / "a"))
    full = feed(a, 1, 9)
    b = ADO(cfg, make_ctx(tmp_path / "b"))
    head = feed(b, 1, 5)
    state = copy.deepcopy(b.state_dict())
    assert state["rows"].dtype == torch.float32 and state["rows"].shape == (5, 3)
    b.close()
    c = ADO(cfg, make_ctx(tmp_path / "b"))
    c.load_state_dict(state)
    assert head + feed(c, 6, 9) == full
    assert full[-1] != full[0]
    a.close()
    c.close()
