"""Aioli (Chen et al. 2025, Algorithms 1 and 2) on the method interface: the pure math by hand,
the probe schedule, the method driven by a synthetic linear mixing law, resume, config errors and
the weight log."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from doremi.methods.aioli.method import (
    Aioli,
    AioliConfig,
    ProbeSchedule,
    estimate_mixing_law,
    mixture_update,
    normalize_mixing_law,
    probe_matrix,
    probe_mixture,
    round_length,
    smooth_mixing_law,
)
from doremi.methods.history import read_history
from tests.method_context import method_context
from trainer.config.tools import ConfigError
from trainer.run.hooks import MethodContext, StepSignals

DOMAINS = ["a", "b", "c"]
# The true mixing law of the synthetic runs: L_{t+1} = L_t - RATE * A_TRUE p_t every step.
A_TRUE = np.array([[0.5, 0.1, 0.0], [0.2, 0.3, 0.05], [0.0, 0.1, 0.4]])
RATE = 0.01


def context(tmp_path: Path, steps: int, domains: list[str] = DOMAINS) -> MethodContext:
    return method_context(tmp_path, domains, steps, 8, 16, [100] * len(domains))


def signals(weights: np.ndarray, k: int) -> StepSignals:
    seqs = np.full(k, 2, dtype=np.int64)
    tokens = torch.full((k,), 32.0, dtype=torch.float64)
    return StepSignals(weights=weights, sequences=seqs, tokens=tokens, loss_sum=tokens * 2.5)


class LinearRun:
    """A trainer stand-in: validation losses follow the linear mixing law exactly."""

    def __init__(self, method: Aioli, losses: np.ndarray):
        self.method, self.losses = method, losses.copy()
        self.weights: list[list[float]] = []
        self.sampling: list[list[float]] = []
        self.rows: list[dict] = []

    def run(self, first: int, last: int) -> None:
        m = self.method
        if first == 1 and m.validation_due(0):
            m.observe_validation(0, torch.tensor(self.losses))
        for t in range(first, last + 1):
            w = m.sampling_weights(t)
            self.sampling.append(w.tolist())
            self.losses = self.losses - RATE * (A_TRUE @ w)
            self.rows.append(m.after_step(t, signals(w, m.k)))
            self.weights.append(m.weights.tolist())
            if m.validation_due(t):
                m.observe_validation(t, torch.tensor(self.losses))


# --- pure functions, by hand -------------------------------------------------------------------


def test_probe_mixture_by_hand():
    assert probe_mixture(3, 1, 0.2).tolist() == [0.1, 0.8, 0.1]
    assert probe_mixture(2, 0, 0.0).tolist() == [1.0, 0.0]
    assert probe_mixture(1, 0, 0.3).tolist() == [1.0]
    assert probe_matrix(2, 0.25).tolist() == [[0.75, 0.25], [0.25, 0.75]]


def test_estimate_mixing_law_solves_the_smoothed_probes():
    # A = [[2, 0], [1, 4]], probes q_0 = [.75, .25], q_1 = [.25, .75]: D[i, j] = A[i] . q_j
    d = np.array([[2 * 0.75, 2 * 0.25], [1 * 0.75 + 4 * 0.25, 1 * 0.25 + 4 * 0.75]])
    np.testing.assert_allclose(estimate_mixing_law(d, 0.25), [[2.0, 0.0], [1.0, 4.0]], rtol=0, atol=1e-12)
    assert estimate_mixing_law(d, 0.0).tolist() == d.tolist()
    # diagonal variant: D[i, i] / (1 - eps)
    np.testing.assert_allclose(
        estimate_mixing_law(d, 0.25, diagonal=True), [[2.0, 0.0], [0.0, 3.25 / 0.75]], rtol=0, atol=1e-12
    )


def test_normalize_mixing_law_by_hand():
    # shift by -min = 1: [[2, 0], [3, 1]], sum 6
    np.testing.assert_allclose(
        normalize_mixing_law(np.array([[1.0, -1.0], [2.0, 0.0]])), [[2 / 6, 0.0], [3 / 6, 1 / 6]], rtol=0, atol=1e-15
    )
    assert normalize_mixing_law(np.array([[1.0, 3.0], [0.0, 0.0]])).tolist() == [[0.25, 0.75], [0.0, 0.0]]
    assert normalize_mixing_law(np.full((2, 2), -0.5)).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_smooth_mixing_law_by_hand():
    a = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert smooth_mixing_law(None, a, 0.1).tolist() == a.tolist()
    prev = np.array([[0.0, 1.0], [1.0, 0.0]])
    np.testing.assert_allclose(smooth_mixing_law(prev, a, 0.1), [[0.9, 0.1], [0.1, 0.9]], rtol=0, atol=1e-15)


def test_mixture_update_by_hand():
    # column sums [0.75, 0.25], eta 2: p proportional to [e^1.5, e^0.5] -> p_0 = 1 / (1 + e^-1)
    log_p = np.log([0.5, 0.5])
    p = np.exp(mixture_update(log_p, np.array([[0.25, 0.25], [0.5, 0.0]]), 2.0))
    assert abs(p[0] - 1 / (1 + math.exp(-1))) < 1e-12 and abs(p.sum() - 1) < 1e-12
    # onto the previous mixture: [0.2, 0.8] * [e^1, e^0]
    p = np.exp(mixture_update(np.log([0.2, 0.8]), np.array([[1.0, 0.0], [0.0, 0.0]]), 1.0))
    assert abs(p[0] - 0.2 * math.e / (0.2 * math.e + 0.8)) < 1e-12
    # eta = 0 leaves p alone
    assert np.allclose(np.exp(mixture_update(np.log([0.2, 0.8]), np.ones((2, 2)), 0.0)), [0.2, 0.8], atol=1e-15)


# --- schedule ----------------------------------------------------------------------------------


def test_schedule_rounds_probes_and_boundaries():
    # k 2, delta 2, one sweep: P = 4 probe steps per round of 10
    s = ProbeSchedule(k=2, steps=20, round_len=round_length(20, 2, None), delta=2, sweeps=1, shuffle=False, seed=0)
    assert s.round_len == 10
    probes = {t: s.probe_at(t) for t in range(1, 21) if s.probe_at(t) is not None}
    assert probes == {1: (0, 0), 2: (0, 0), 3: (0, 1), 4: (0, 1), 11: (1, 0), 12: (1, 0), 13: (1, 1), 14: (1, 1)}
    assert [t for t in range(21) if s.boundary(t) is not None] == [0, 2, 4, 10, 12, 14]
    assert s.boundary(14) == (1, 2) and s.boundary(10) == (1, 0)
    # a last round with no step left after its probes only trains on p
    short = ProbeSchedule(k=2, steps=14, round_len=10, delta=2, sweeps=1, shuffle=False, seed=0)
    assert [t for t in range(15) if short.boundary(t) is not None] == [0, 2, 4]
    assert short.probe_at(11) is None
    assert round_length(21, 2, None) == 11 and round_length(21, 2, 7) == 7


def test_shuffled_order_is_a_permutation_per_sweep_and_deterministic():
    s = ProbeSchedule(k=3, steps=100, round_len=50, delta=1, sweeps=3, shuffle=True, seed=5)
    order = s.order(1)
    assert order == s.order(1)
    assert all(sorted(order[i : i + 3]) == [0, 1, 2] for i in range(0, 9, 3))
    assert ProbeSchedule(3, 100, 50, 1, 2, False, 5).order(0) == [0, 1, 2, 0, 1, 2]


# --- the method --------------------------------------------------------------------------------


def cfg(**kw) -> AioliConfig:
    base = {"rounds": 2, "delta": 2, "sweeps": 2, "one_hot_eps": 0.2, "eta": 3.0, "ema": 0.5}
    return AioliConfig(**{**base, **kw})


def test_method_recovers_a_linear_mixing_law(tmp_path):
    # 2 rounds of 20 steps; probes: 3 domains x 2 sweeps x 2 steps = 12 steps, then 8 on p
    m = Aioli(cfg(variant="paper"), context(tmp_path, 40))
    run = LinearRun(m, np.array([3.0, 3.0, 3.0]))
    run.run(1, 12)
    # each interval drops L by delta * RATE * A_TRUE q_j: the estimate is delta * RATE * A_TRUE
    np.testing.assert_allclose(m.a_last, 2 * RATE * A_TRUE, rtol=0, atol=1e-12)
    a1 = normalize_mixing_law(m.a_last)
    p1 = np.exp(mixture_update(np.full(3, -math.log(3)), a1, 3.0))
    assert m.weights.tolist() == p1.tolist()
    # probes drew the smoothed one-hots; steps 13..20 draw p_1; log weights were p_0 until then
    run.run(13, 40)
    assert sorted(run.sampling[0]) == [0.1, 0.1, 0.8]
    assert run.sampling[12] == p1.tolist()
    assert run.weights[10] == [1 / 3] * 3 and run.weights[12] == p1.tolist()
    a2 = normalize_mixing_law(2 * RATE * A_TRUE)
    p2 = np.exp(mixture_update(np.log(p1), smooth_mixing_law(a1, a2, 0.5), 3.0))
    np.testing.assert_allclose(m.weights, p2, rtol=0, atol=1e-12)
    # the domain whose data lowers the losses most (A's largest column sum: a, 0.7) gains weight
    assert np.argmax(m.weights) == int(np.argmax(A_TRUE.sum(axis=0)))
    assert "aioli_A" not in run.rows[11]
    np.testing.assert_allclose(run.rows[12]["aioli_A"], (2 * RATE * A_TRUE).ravel(), rtol=0, atol=1e-12)
    assert [r["aioli_probe"] for r in run.rows[10:14]] == [1, 1, 0, 0]
    assert run.rows[-1]["domain_weights"] == dict(zip(DOMAINS, run.weights[-1]))
    m.close()


def test_variant_authors_restarts_from_uniform(tmp_path):
    m = Aioli(cfg(variant="authors", ema=0.0, normalize=False, shuffle=False), context(tmp_path, 40))
    LinearRun(m, np.array([3.0, 3.0, 3.0])).run(1, 40)
    a = 2 * RATE * A_TRUE
    expected = np.exp(mixture_update(np.full(3, -math.log(3)), a, 3.0))
    np.testing.assert_allclose(m.weights, expected, rtol=0, atol=1e-12)
    m.close()


def test_validation_due_exactly_at_interval_boundaries(tmp_path):
    m = Aioli(cfg(), context(tmp_path, 40))
    assert [t for t in range(41) if m.validation_due(t)] == [0, 2, 4, 6, 8, 10, 12, 20, 22, 24, 26, 28, 30, 32]
    m.close()


def test_resume_is_bitwise(tmp_path):
    steps = 40
    full = LinearRun(Aioli(cfg(), context(tmp_path / "full", steps)), np.array([3.0, 2.5, 2.0]))
    full.run(1, steps)
    for cut in (17, 23):  # inside round 0's steps on p; inside round 1's probes
        first = LinearRun(Aioli(cfg(), context(tmp_path / f"cut{cut}", steps)), np.array([3.0, 2.5, 2.0]))
        first.run(1, cut)
        state = json.loads(json.dumps(first.method.state_dict()))
        first.method.close()
        second = Aioli(cfg(), context(tmp_path / f"cut{cut}", steps))
        second.load_state_dict(state)
        rest = LinearRun(second, first.losses)
        rest.run(cut + 1, steps)
        assert first.weights + rest.weights == full.weights
        assert first.sampling + rest.sampling == full.sampling
        assert second.state_dict() == full.method.state_dict()
        second.close()
        assert [r["weights"] for r in read_history(tmp_path / f"cut{cut}")] == full.weights
    full.method.close()


def test_domain_weights_log_is_readable(tmp_path):
    m = Aioli(cfg(), context(tmp_path, 40))
    run = LinearRun(m, np.array([3.0, 3.0, 3.0]))
    run.run(1, 14)
    m.close()
    hist = read_history(tmp_path)
    assert [r["step"] for r in hist] == list(range(1, 15))
    assert [r["weights"] for r in hist] == run.weights
    assert [r["sampling"] for r in hist] == run.sampling
    assert hist[0]["probe"] in DOMAINS and hist[13]["probe"] is None
    assert hist[0]["tokens"] == [32, 32, 32] and hist[0]["sequences"] == [2, 2, 2]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("eta", -1.0, "mixing.aioli.eta: expected a finite value >= 0, got -1.0"),
        ("rounds", 0, "mixing.aioli.rounds: expected >= 1, got 0"),
        ("round_steps", 1, "mixing.aioli.round_steps: expected >= 2 or null, got 1"),
        ("delta", 0, "mixing.aioli.delta: expected >= 1, got 0"),
        ("sweeps", 0, "mixing.aioli.sweeps: expected >= 1, got 0"),
        ("one_hot_eps", 1.0, "mixing.aioli.one_hot_eps: expected a value in [0, 1), got 1.0"),
        ("ema", 1.0, "mixing.aioli.ema: expected a value in [0, 1), got 1.0"),
        ("variant", "last", "mixing.aioli.variant: expected 'authors' or 'paper', got 'last'"),
        ("eval_sequences", -1, "mixing.aioli.eval_sequences: expected >= 0 or null, got -1"),
        ("eval_budget", 0.0, "mixing.aioli.eval_budget: expected a finite value > 0, got 0.0"),
    ],
)
def test_config_errors(field, value, message):
    with pytest.raises(ConfigError) as e:
        AioliConfig(**{field: value}).validate("mixing.aioli")
    assert str(e.value) == message


def test_run_level_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"mixing.aioli.one_hot_eps: expected a value below \(k-1\)/k = 0.5"):
        Aioli(AioliConfig(one_hot_eps=0.5, rounds=1), context(tmp_path, 100, ["a", "b"]))
    with pytest.raises(ConfigError, match=r"mixing.aioli.rounds: expected rounds longer than their probes"):
        Aioli(AioliConfig(rounds=20), context(tmp_path, 100))  # 3 * 4 * 4 = 48 probe steps, rounds of 5
    with pytest.raises(ConfigError, match=r"mixing.aioli.round_steps: .* got rounds of 48 steps"):
        Aioli(AioliConfig(round_steps=48), context(tmp_path, 100))
