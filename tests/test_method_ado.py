"""ADO (doremi/methods/ado/method.py): the power-law fit, the policy's pure functions, and the method
driven by synthetic step signals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from doremi.methods.ado.method import (
    ADO,
    ADOConfig,
    credit_update,
    fit_power_law,
    floor_clip,
    floor_exact,
    learning_speed,
    merge_points,
    mix_policy,
    power_law,
    preference,
    running_mean,
)
from doremi.methods.history import read_history
from tests.method_context import method_context
from trainer.config.tools import ConfigError
from trainer.run.hooks import MethodContext, StepSignals

DOMAINS = ["a", "b", "c"]
B, S = 16, 8
#: True power laws (beta, alpha, eps) of the synthetic domains' training loss against their n.
LAWS = [(20.0, 0.6, 1.0), (3.0, 0.2, 2.0), (8.0, 0.4, 1.5)]


def make_ctx(tmp_path, steps=40, train_tokens=(500, 300, 200), is_main=True) -> MethodContext:
    return method_context(tmp_path, DOMAINS, steps, B, S, train_tokens, is_main)


def small_cfg(**kw) -> ADOConfig:
    base = dict(warmup=4, refit_every=4, record_every=2, max_points=6, min_points=3, floor=0.05, variant="paper")
    base.update(kw)
    cfg = ADOConfig(**base)
    cfg.validate()
    return cfg


def counts_for(w: np.ndarray) -> np.ndarray:
    """Largest-remainder apportionment of B sequences (ties to the lower index)."""
    raw = w * B
    c = np.floor(raw).astype(np.int64)
    order = sorted(range(len(w)), key=lambda i: (-(raw[i] - c[i]), i))
    for i in order[: B - int(c.sum())]:
        c[i] += 1
    return c


def signals_for(step: int, w: np.ndarray, seen: np.ndarray) -> StepSignals:
    """One step's signals: losses on the true laws at the domain's n, with a small deterministic wiggle."""
    c = counts_for(w)
    n = seen + c
    tokens = c.astype(np.float64) * S
    loss = np.array(
        [power_law(max(n[i], 1), *LAWS[i]) * (1 + 0.01 * math.sin(step + i)) for i in range(len(w))], dtype=np.float64
    )
    return StepSignals(
        weights=w,
        sequences=c,
        tokens=torch.tensor(tokens, dtype=torch.float64),
        loss_sum=torch.tensor(loss * tokens, dtype=torch.float64),
    )


def drive(method: ADO, first: int, last: int, seen: np.ndarray) -> list[list[float]]:
    out = []
    for t in range(first, last + 1):
        w = method.sampling_weights(t)
        sig = signals_for(t, w, seen)
        seen += np.asarray(sig.sequences)
        method.after_step(t, sig)
        out.append(method.sampling_weights(t + 1).tolist())
    return out


# --- the fit -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "beta,alpha,eps,huber",
    [(12.5, 0.37, 1.7, None), (5.0, 0.3, 2.0, None), (40.0, 0.71, 0.4, None), (12.5, 0.37, 1.7, 1e-3)],
)
def test_fit_recovers_known_power_law(beta, alpha, eps, huber):
    n = np.geomspace(50.0, 2e5, 60)
    loss = eps + beta * n ** (-alpha)
    fit = fit_power_law(n, loss, weights=np.linspace(1.0, 2.0, 60), huber_delta=huber)
    assert fit is not None
    b, a, e = fit
    assert abs(b - beta) <= 1e-6 * beta
    assert abs(a - alpha) <= 1e-6
    assert abs(e - eps) <= 1e-6


def test_fit_is_deterministic_and_handles_degenerate_input():
    n = np.geomspace(10.0, 1e4, 30)
    loss = 2.0 + 7.0 * n**-0.5 + 0.01 * np.sin(np.arange(30))
    assert fit_power_law(n, loss) == fit_power_law(n.copy(), loss.copy())
    assert fit_power_law([1.0, 2.0], [3.0, 2.0]) is None
    assert fit_power_law([1.0, 2.0, 0.0], [3.0, 2.0, 1.0]) is None
    assert fit_power_law([1.0, 2.0, 3.0], [3.0, float("nan"), 1.0]) is None
    # losses that rise with n: no learning potential
    beta, alpha, eps = fit_power_law([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0])
    assert beta == 0.0 and alpha == 0.0 and eps == 2.5


def test_learning_speed_is_the_derivative_of_eq_2():
    beta, alpha, eps, n = 6.0, 0.25, 1.5, 400.0
    by_hand = (alpha / n) * ((eps + beta * n**-alpha) - eps)
    assert abs(float(learning_speed(n, beta, alpha, eps)) - by_hand) <= 1e-15
    h = 1e-3
    numeric = -(power_law(n + h, beta, alpha, eps) - power_law(n - h, beta, alpha, eps)) / (2 * h)
    assert abs(float(numeric) - by_hand) <= 1e-9


# --- the policy's pure functions ---------------------------------------------------------------


def test_credit_preference_and_mix_by_hand():
    h = credit_update(np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.2, 0.6]), 0.1)
    assert h.tolist() == [0.1 * 0.2 + 0.9 * 0.5, 0.1 * 0.2 + 0.9 * 0.3, 0.1 * 0.6 + 0.9 * 0.2]

    mu, hh, speed = np.array([0.5, 0.25, 0.25]), np.array([0.25, 0.16, 0.64]), np.array([1.0, 2.0, 0.5])
    num = [0.5 * 0.5 * 1.0, 0.25 * 0.4 * 2.0, 0.25 * 0.8 * 0.5]  # mu * h^0.5 * speed
    rho = preference(mu, hh, 0.5, speed)
    assert np.allclose(rho, np.array(num) / sum(num), rtol=0, atol=1e-15)
    assert preference(mu, hh, 0.5, np.zeros(3)).tolist() == mu.tolist()

    pi = mix_policy(np.array([1.0, 0.0, 0.0]), np.array([0.2, 0.4, 0.4]), 0.1)
    assert np.allclose(pi, [0.1 + 0.9 * 0.2, 0.9 * 0.4, 0.9 * 0.4], rtol=0, atol=1e-15)

    m = running_mean(np.array([0.5, 0.5]), 3, np.array([1.0, 0.0]))
    assert m.tolist() == [0.5 + 0.5 / 4, 0.5 - 0.5 / 4]


def test_floor_exact_by_hand():
    p = np.array([0.7, 0.295, 0.005, 0.0])
    mask = np.array([True, True, True, False])
    q = floor_exact(p, 0.01, mask)
    c = 0.99 / 0.995
    assert np.allclose(q, [0.7 * c, 0.295 * c, 0.01, 0.0], rtol=0, atol=1e-15)
    # two rounds: flooring the smallest pushes the next one under delta
    q = floor_exact(np.array([0.88, 0.1, 0.02]), 0.1, np.ones(3, bool))
    assert np.allclose(q, [0.8, 0.1, 0.1], rtol=0, atol=1e-15)
    assert np.allclose(floor_exact(p, 0.0, mask), p, rtol=0, atol=1e-15)


def test_floor_clip_is_the_authors_rule():
    q = floor_clip(np.array([0.7, 0.295, 0.005]), 0.01, np.ones(3, bool))
    assert np.allclose(q, np.array([0.7, 0.295, 0.01]) / 1.005, rtol=0, atol=1e-15)


def test_merge_points_keeps_tokens_and_weighted_means():
    n, loss, w = merge_points([1.0, 3.0, 5.0], [4.0, 2.0, 1.0], [1.0, 3.0, 2.0])
    assert n == [(1.0 + 9.0) / 4, 5.0] and loss == [(4.0 + 6.0) / 4, 1.0] and w == [4.0, 2.0]


# --- the method -------------------------------------------------------------------------------


def test_prior_during_warmup_then_fastest_learner_gains(tmp_path):
    method = ADO(small_cfg(), make_ctx(tmp_path))
    mu = np.array([0.5, 0.3, 0.2])
    assert method.sampling_weights(1).tolist() == mu.tolist()
    seen = np.zeros(3, dtype=np.int64)
    weights = drive(method, 1, 40, seen)
    # no fit before step 12 (min_points history points): the natural mixture
    assert all(w == mu.tolist() for w in weights[:11]) and weights[11] != mu.tolist()
    assert all(p is not None for p in method.params)
    final = np.array(weights[-1])
    assert abs(final.sum() - 1) <= 1e-12 and final.min() >= 0.05 - 1e-15
    # domain b's law is the flattest: it loses weight against the prior
    assert final[1] < mu[1]
    assert len(method.points[0]["n"]) <= 6
    method.close()


def test_resume_is_bitwise(tmp_path):
    for kw in (
        {},
        dict(count="total", credit="counts", average="preference", floor_on="preference", huber_delta=1e-3),
    ):
        a = ADO(small_cfg(**kw), make_ctx(tmp_path / "a"))
        full = drive(a, 1, 40, np.zeros(3, dtype=np.int64))
        b = ADO(small_cfg(**kw), make_ctx(tmp_path / "b"))
        seen = np.zeros(3, dtype=np.int64)
        head = drive(b, 1, 17, seen)
        state = json.loads(json.dumps(b.state_dict()))
        b.close()
        c = ADO(small_cfg(**kw), make_ctx(tmp_path / "b"))
        c.load_state_dict(state)
        tail = drive(c, 18, 40, seen)
        assert head + tail == full
        assert c.state_dict() == a.state_dict()
        a.close()
        c.close()
        assert [r["weights"] for r in read_history(tmp_path / "b")] == full


def test_authors_variant_time_average_weights_by_hand(tmp_path):
    """The authors' code (`AdoSelector.curr_dist` at its 0-based step itr = t - 1): p = 0.9 p_avg +
    0.1 dist, then p_avg = (1 - 1/(itr + 1)) p_avg + dist / (itr + 1), p_avg starting at mu; so with
    fits from step 1 on, p_avg after step 1 is dist(1) and pi(3) = 0.1 dist(2) + 0.9 dist(1)."""
    kw = dict(warmup=0, floor=0.01, count="total", credit="counts", average="preference", floor_on="preference")
    method = ADO(small_cfg(**kw), make_ctx(tmp_path))
    method.params = [list(law) for law in LAWS]
    mu = np.array([0.5, 0.3, 0.2])
    h, total, dists, seen = mu.copy(), 0, [], np.zeros(3, dtype=np.int64)
    for t in (1, 2):
        w = method.sampling_weights(t)
        sig = signals_for(t, w, seen)
        c = np.asarray(sig.sequences, dtype=np.float64)
        seen += np.asarray(sig.sequences)
        method.after_step(t, sig)
        total += c.sum()
        h = 0.9 * h + 0.1 * c / c.sum()
        slope = np.array([a * b * total ** (-a - 1.0) for b, a, _ in LAWS])
        d = slope * mu * h**0.5
        d = np.maximum(d / d.sum(), 0.01)
        dists.append(d / d.sum())
    assert np.allclose(method.average, dists[1] / 2 + dists[0] / 2, rtol=0, atol=1e-15)
    assert np.allclose(method.sampling_weights(3), 0.1 * dists[1] + 0.9 * dists[0], rtol=0, atol=1e-15)
    method.close()


def test_log_is_written_and_readable(tmp_path):
    method = ADO(small_cfg(), make_ctx(tmp_path))
    drive(method, 1, 12, np.zeros(3, dtype=np.int64))
    method.close()
    records = read_history(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all(len(r["weights"]) == 3 and len(r["tokens"]) == 3 for r in records)
    # 2 points per domain at step 8 (fewer than min_points), 4 at step 12: the first fit
    assert records[7]["fit"] == [None, None, None] and "preference" not in records[7]
    assert records[11]["fit"][0]["alpha"] > 0 and "preference" in records[11]
    assert records[0]["sampling"] == [0.5, 0.3, 0.2]


def test_not_main_writes_nothing(tmp_path):
    method = ADO(small_cfg(), make_ctx(tmp_path, is_main=False))
    row = drive(method, 1, 3, np.zeros(3, dtype=np.int64))
    method.close()
    assert row and not (tmp_path / "domain_weights.jsonl").exists()


def test_domain_without_data_stays_at_zero(tmp_path):
    method = ADO(small_cfg(), make_ctx(tmp_path, train_tokens=(500, 500, 0)))
    weights = drive(method, 1, 20, np.zeros(3, dtype=np.int64))
    assert all(w[2] == 0.0 for w in weights)
    method.close()


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(warmup=-1), "mixing.ado.warmup: expected an integer >= 0, got -1"),
        (dict(refit_every=0), "mixing.ado.refit_every: expected an integer >= 1, got 0"),
        (dict(refit_every=15, record_every=10), "mixing.ado.refit_every: expected a multiple of record_every"),
        (dict(min_points=2), "mixing.ado.min_points: expected an integer >= 3, got 2"),
        (dict(max_points=4), "mixing.ado.max_points: expected >= min_points (5)"),
        (dict(credit_smoothing=0.0), "mixing.ado.credit_smoothing: expected a value in (0, 1], got 0.0"),
        (dict(policy_mix=1.5), "mixing.ado.policy_mix: expected a value in [0, 1], got 1.5"),
        (dict(credit_exponent=-1.0), "mixing.ado.credit_exponent: expected a finite value >= 0"),
        (dict(floor=1.0), "mixing.ado.floor: expected a value in [0, 1), got 1.0"),
        (dict(alpha_max=0.0), "mixing.ado.alpha_max: expected a finite value > 0"),
        (dict(huber_delta=0.0), "mixing.ado.huber_delta: expected a finite value > 0 or null"),
        (dict(count="steps"), "mixing.ado.count: expected one of 'domain', 'total', got 'steps'"),
        (dict(credit="x"), "mixing.ado.credit: expected one of"),
        (dict(average="x"), "mixing.ado.average: expected one of"),
        (dict(floor_on="x"), "mixing.ado.floor_on: expected one of"),
    ],
)
def test_validate_errors(kw, message):
    with pytest.raises(ConfigError) as e:
        ADOConfig(**kw).validate()
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_floor_too_large_for_the_domains(tmp_path):
    with pytest.raises(ConfigError, match="mixing.ado.floor: expected at most 1/3"):
        ADO(ADOConfig(floor=0.4), make_ctx(tmp_path))
