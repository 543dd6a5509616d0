"""ODM (Albalak et al. 2023, Algorithm 1): the pure math by hand, the method driven by synthetic
signals, resume, the config's errors and the common log."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from doremi.methods.history import read_history
from doremi.methods.odm.method import ODM, ODMConfig, exp3_policy, exploration_rate, step_rewards, update_rewards
from tests.method_context import method_context
from trainer.config.tools import ConfigError
from trainer.run.hooks import StepSignals


def context(tmp_path: Path, k: int = 2, steps: int = 20, batch: int = 8, tokens: list[int] | None = None):
    return method_context(
        tmp_path, [f"d{i}" for i in range(k)], steps, batch, 4, tokens or [100 * (i + 1) for i in range(k)]
    )


def signals(weights: np.ndarray, sequences: list[int], loss: list[float], seq_len: int = 4) -> StepSignals:
    """Every drawn sequence has `seq_len` tokens, each with its domain's loss."""
    tokens = torch.tensor([n * seq_len for n in sequences], dtype=torch.float64)
    return StepSignals(
        weights=np.asarray(weights),
        sequences=np.asarray(sequences),
        tokens=tokens,
        loss_sum=tokens * torch.tensor(loss, dtype=torch.float64),
    )


# --- the pure functions, by hand ---------------------------------------------------------------


def test_exploration_rate_by_hand():
    assert exploration_rate(0, 4) == 0.25
    assert exploration_rate(1, 4) == 0.25  # sqrt(ln 4 / 4) = 0.589 > 1/4
    assert exploration_rate(10, 4) == math.sqrt(math.log(4) / 40)
    assert exploration_rate(2, 2) == math.sqrt(math.log(2) / 4)
    assert exploration_rate(-3, 5) == 0.2
    assert exploration_rate(7, 1) == 0.0


def test_softmax_policy_by_hand():
    e = [math.exp(0.5 * 1), math.exp(0.5 * 2), math.exp(0.5 * 4)]
    want = [(1 - 3 * 0.1) * x / sum(e) + 0.1 for x in e]
    got = exp3_policy(np.array([1.0, 2.0, 4.0]), eps=0.1, temperature=0.5)
    assert np.allclose(got, want, rtol=0, atol=1e-12)
    assert abs(got.sum() - 1) < 1e-12
    # pure exploration at eps = 1/K, whatever the rewards
    assert np.allclose(exp3_policy(np.array([5.0, -3.0, 100.0]), 1 / 3, 2.0), [1 / 3] * 3, rtol=0, atol=1e-12)
    # large rewards do not overflow
    huge = exp3_policy(np.array([1e6, 0.0]), eps=0.1, temperature=1.0)
    assert np.allclose(huge, [0.9, 0.1], rtol=0, atol=1e-12)


def test_linear_policy_by_hand():
    got = exp3_policy(np.array([1.0, 3.0, 0.0]), eps=0.1, temperature=0.7, policy="linear")
    assert np.allclose(got, [0.7 * 0.25 + 0.1, 0.7 * 0.75 + 0.1, 0.1], rtol=0, atol=1e-12)
    assert np.allclose(exp3_policy(np.zeros(4), 0.05, 1.0, "linear"), [0.25] * 4, rtol=0, atol=1e-12)


def test_step_rewards_by_hand():
    loss, probs = np.array([2.0, 0.0, 3.0]), np.array([0.5, 0.25, 0.25])
    assert step_rewards(loss, probs).tolist() == [4.0, 0.0, 12.0]
    assert np.allclose(step_rewards(loss, probs, scale=0.1), [0.4, 0.0, 1.2], rtol=0, atol=1e-12)
    got = step_rewards(loss, probs, reward="exp_loss", importance_weighting=False)
    assert got.tolist() == [math.exp(2.0), 1.0, math.exp(3.0)]
    assert step_rewards(np.array([1.0, 1.0]), np.array([1.0, 0.0])).tolist() == [1.0, 0.0]


def test_update_rewards_by_hand():
    old, r, drawn = np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0]), np.array([True, False, True])
    got = update_rewards(old, r, drawn, smoothing=0.9)
    assert np.allclose(got, [0.9 * 1 + 0.1 * 10, 2.0, 0.9 * 3 + 0.1 * 30], rtol=0, atol=1e-12)
    assert got[1] == 2.0
    assert update_rewards(old, r, drawn, 0.9, "cumulative").tolist() == [11.0, 2.0, 33.0]
    assert update_rewards(old, r, drawn, 0.0).tolist() == [10.0, 2.0, 30.0]


# --- the method -------------------------------------------------------------------------------


def test_paper_steps_by_hand(tmp_path):
    """k = 2, alpha = 0.9: pi_1 uniform; after step 1 R_hat_i = 0.1 L_i / (1/2); pi_2 =
    (1 - 2 eps_2) softmax(eps_1 R_hat) + eps_2 with eps_1 = 1/2, eps_2 = sqrt(ln 2 / 4)."""
    ctx = context(tmp_path, k=2, batch=8)
    m = ODM(ODMConfig(), ctx)
    assert m.needs.draws == "random"
    pi1 = m.sampling_weights(1)
    assert pi1.tolist() == [0.5, 0.5]
    row = m.after_step(1, signals(pi1, [3, 5], [2.0, 1.0]))
    r = [0.1 * 2.0 / 0.5, 0.1 * 1.0 / 0.5]
    assert np.allclose(m.estimate, r, rtol=0, atol=1e-12)
    eps2 = math.sqrt(math.log(2) / 4)
    e = [math.exp(0.5 * x) for x in r]
    pi2 = [(1 - 2 * eps2) * x / sum(e) + eps2 for x in e]
    assert np.allclose(m.sampling_weights(2), pi2, rtol=0, atol=1e-12)
    assert np.allclose(list(row["domain_weights"].values()), pi2, rtol=0, atol=1e-12)
    assert row["odm_exploration"] == eps2

    # step 2: only d1 drawn; d0 keeps its reward
    before = m.estimate[0]
    m.after_step(2, signals(pi2, [0, 8], [0.0, 3.0]))
    r2 = [r[0], 0.9 * r[1] + 0.1 * 3.0 / pi2[1]]
    assert np.allclose(m.estimate, r2, rtol=0, atol=1e-12)
    assert m.estimate[0] == before
    eps3 = math.sqrt(math.log(2) / 6)
    e = [math.exp(eps2 * x) for x in r2]
    pi3 = [(1 - 2 * eps3) * x / sum(e) + eps3 for x in e]
    assert np.allclose(m.sampling_weights(3), pi3, rtol=0, atol=1e-12)
    m.close()

    hist = read_history(tmp_path)
    assert [h["step"] for h in hist] == [1, 2]
    assert hist[0]["sampling"] == [0.5, 0.5]
    assert hist[0]["sequences"] == [3, 5]
    assert hist[0]["tokens"] == [12, 20]
    assert hist[0]["loss"] == [2.0, 1.0]
    assert hist[1]["sampling"] == hist[0]["weights"]
    assert np.allclose(hist[1]["weights"], pi3, rtol=0, atol=1e-12)
    assert hist[1]["reward"] == m.estimate.tolist()


def test_early_steps_are_uniform(tmp_path):
    """eps_t = 1/K while t <= K ln K: K = 3 explores uniformly for steps 1..3."""
    m = ODM(ODMConfig(), context(tmp_path, k=3))
    for t in (1, 2, 3):
        pi = m.sampling_weights(t)
        assert np.allclose(pi, [1 / 3] * 3, rtol=0, atol=1e-15)
        m.after_step(t, signals(pi, [2, 3, 3], [1.0, 5.0, 2.0]))
    assert m.sampling_weights(4)[1] > m.sampling_weights(4)[0]
    m.close()


def test_single_domain_k1(tmp_path):
    m = ODM(ODMConfig(), context(tmp_path, k=1))
    for t in (1, 2, 3):
        pi = m.sampling_weights(t)
        assert pi.tolist() == [1.0]
        m.after_step(t, signals(pi, [8], [3.0]))
    m.close()


def test_batch_draw_unit(tmp_path):
    """One domain per step, drawn from pi_t; the reward is divided by pi_t(i), not by 1."""
    cfg = ODMConfig(draw_unit="batch")
    m = ODM(cfg, context(tmp_path, k=3, batch=6))
    w = m.sampling_weights(1)
    assert sorted(w.tolist()) == [0.0, 0.0, 1.0]
    assert m.sampling_weights(1).tolist() == w.tolist()
    arm = int(w.argmax())
    seqs = [0, 0, 0]
    seqs[arm] = 6
    m.after_step(1, signals(w, seqs, [2.0, 2.0, 2.0]))
    want = [0.0, 0.0, 0.0]
    want[arm] = 0.1 * 2.0 * 3
    assert np.allclose(m.estimate, want, rtol=0, atol=1e-12)
    assert read_history(tmp_path)[0]["sampling"] == [1 / 3] * 3
    arms = {int(m.sampling_weights(t).argmax()) for t in range(1, 40)}
    assert arms == {0, 1, 2}
    m.close()


def test_authors_variant(tmp_path):
    """Warmup 2 from the token mixture, lag 1, exp(loss) rewards without importance weights,
    linear policy: steps 1..3 draw the initial weights, steps 1, 2 update nothing, and
    pi_4 = (1 - 2 eps_3) R_hat / sum(R_hat) + eps_3."""
    cfg = ODMConfig(
        warmup_steps=2,
        epsilon_lag=1,
        initial_weights="tokens",
        reward="exp_loss",
        importance_weighting=False,
        policy="linear",
        smoothing=0.5,
    )
    m = ODM(cfg, context(tmp_path, k=2, tokens=[100, 300]))
    for t in (1, 2):
        assert m.sampling_weights(t).tolist() == [0.25, 0.75]
        m.after_step(t, signals([0.25, 0.75], [2, 6], [1.0, 2.0]))
        assert m.estimate.tolist() == [0.0, 0.0]
    assert m.sampling_weights(3).tolist() == [0.25, 0.75]
    m.after_step(3, signals([0.25, 0.75], [2, 6], [1.0, 2.0]))
    r = [0.5 * math.exp(1.0), 0.5 * math.exp(2.0)]
    assert np.allclose(m.estimate, r, rtol=0, atol=1e-12)
    eps3 = math.sqrt(math.log(2) / 6)
    want = [(1 - 2 * eps3) * x / sum(r) + eps3 for x in r]
    assert np.allclose(m.sampling_weights(4), want, rtol=0, atol=1e-12)
    assert m.epsilons(4) == (eps3, 0.5)
    assert m.epsilons(5) == (math.sqrt(math.log(2) / 8), eps3)
    m.close()


def test_cumulative_exp3_variant(tmp_path):
    m = ODM(ODMConfig(estimator="cumulative", reward_scale=0.1), context(tmp_path, k=2))
    m.after_step(1, signals([0.5, 0.5], [4, 4], [3.0, 1.0]))
    pi2 = m.policy(2)
    m.after_step(2, signals(pi2, [8, 0], [2.0, 0.0]))
    assert np.allclose(m.estimate, [0.1 * 3 / 0.5 + 0.1 * 2 / pi2[0], 0.1 * 1 / 0.5], rtol=0, atol=1e-12)
    m.close()


def run(m: ODM, steps: range, rng_seed: int = 3) -> list[list[float]]:
    out = []
    for t in steps:
        pi = m.sampling_weights(t)
        counts = np.random.default_rng([rng_seed, t]).multinomial(8, pi)
        loss = (np.random.default_rng([rng_seed, t, 1]).random(len(pi)) * 4 + 1) * (counts > 0)
        row = m.after_step(t, signals(pi, counts.tolist(), loss.tolist()))
        out.append(list(row["domain_weights"].values()))
    return out


@pytest.mark.parametrize("cfg", [ODMConfig(), ODMConfig(draw_unit="batch", warmup_steps=2, epsilon_lag=1)])
def test_resume_is_bitwise(tmp_path, cfg):
    n, mid = 30, 11
    full = ODM(cfg, context(tmp_path / "a", k=4))
    a = run(full, range(1, n + 1))
    full.close()

    first = ODM(cfg, context(tmp_path / "b", k=4))
    b = run(first, range(1, mid + 1))
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    second = ODM(cfg, context(tmp_path / "b", k=4))
    second.load_state_dict(state)
    b += run(second, range(mid + 1, n + 1))
    second.close()

    assert a == b
    assert read_history(tmp_path / "a") == read_history(tmp_path / "b")
    assert a[-1] != a[0]


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("smoothing", 1.0, "mixing.odm.smoothing: expected a value in [0, 1), got 1.0"),
        ("smoothing", -0.1, "mixing.odm.smoothing: expected a value in [0, 1), got -0.1"),
        ("reward", "perplexity", "mixing.odm.reward: expected one of loss, exp_loss, got 'perplexity'"),
        ("importance_weighting", "yes", "mixing.odm.importance_weighting: expected true or false, got 'yes'"),
        ("reward_scale", 0.0, "mixing.odm.reward_scale: expected a finite value > 0, got 0.0"),
        ("reward_scale", float("inf"), "mixing.odm.reward_scale: expected a finite value > 0, got inf"),
        ("estimator", "sum", "mixing.odm.estimator: expected one of smoothed, cumulative, got 'sum'"),
        ("policy", "greedy", "mixing.odm.policy: expected one of softmax, linear, got 'greedy'"),
        ("epsilon_lag", 2, "mixing.odm.epsilon_lag: expected 0 or 1, got 2"),
        ("warmup_steps", -1, "mixing.odm.warmup_steps: expected an integer >= 0, got -1"),
        ("initial_weights", "natural", "mixing.odm.initial_weights: expected one of uniform, tokens, got 'natural'"),
        ("draw_unit", "micro", "mixing.odm.draw_unit: expected one of sequence, batch, got 'micro'"),
    ],
)
def test_validate_errors(field, value, message):
    cfg = ODMConfig(**{field: value})
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert str(e.value) == message


def test_validate_defaults_and_path():
    ODMConfig().validate()
    ODMConfig(smoothing=0.0, epsilon_lag=1, warmup_steps=2000, policy="linear").validate()
    with pytest.raises(ConfigError, match=r"^odm\.smoothing: "):
        ODMConfig(smoothing=2.0).validate("odm")


def test_state_dict_is_json(tmp_path):
    m = ODM(ODMConfig(), context(tmp_path, k=3))
    assert m.state_dict() == {"estimate": [0.0, 0.0, 0.0]}
    m.load_state_dict({})
    run(m, range(1, 4))
    state = m.state_dict()
    assert json.loads(json.dumps(state)) == state
    m.close()


def test_one_arm_per_step_is_refused_under_an_epoch_cap():
    from types import SimpleNamespace

    from doremi.methods.odm import check_caps
    from trainer.config.tools import ConfigError

    def cfg(draw_unit, max_epochs):
        return SimpleNamespace(
            mixing=SimpleNamespace(odm=ODMConfig(draw_unit=draw_unit)), data=SimpleNamespace(max_epochs=max_epochs)
        )

    for draw_unit, max_epochs in (("sequence", 2.0), ("batch", None), ("sequence", None)):
        check_caps(cfg(draw_unit, max_epochs))
    with pytest.raises(
        ConfigError, match=r"^mixing.odm.draw_unit: batch pulls one domain per step and cannot keep data.max_epochs 2: "
    ):
        check_caps(cfg("batch", 2.0))
