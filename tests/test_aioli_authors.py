"""Aioli's `variant: authors` (doremi/methods/aioli/method.py) against the released code (github
HazyResearch/aioli, commit a2361123335cb91d68f5ad86a6c85de7a79e6d5e, `trainer/aioli_trainer.py`):
two rounds of a fixed case computed by hand from its equations, the paper's variant on the same
losses, and the budgeted validation subset with the passes the trainer makes and the ledger
counts (issue 35, point 4)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from doremi.methods.aioli.method import Aioli, AioliConfig, ProbeSchedule, eval_sequences, validation_passes
from doremi.reports.ledger import _flops_per_token, run_cost
from tests.method_context import method_context
from trainer.run.hooks import MethodContext

pytestmark = pytest.mark.usefixtures("one_thread")


def context(tmp_path: Path, steps: int, k: int = 2, batch: int = 8) -> MethodContext:
    return method_context(tmp_path, [f"d{i}" for i in range(k)], steps, batch, 16, [100] * k, is_main=False)


#: Validation losses at steps 0..4 (round 0) and 6..10 (round 1) of a 12-step run: rounds of 6
#: steps, 2 domains x 2 sweeps x 1 step of probes, in domain order (shuffle off).
LOSSES = {
    0: (4.0, 4.0),
    1: (3.8, 3.9),
    2: (3.7, 3.6),
    3: (3.5, 3.55),
    4: (3.45, 3.35),
    6: (3.0, 3.0),
    7: (2.9, 2.8),
    8: (2.6, 2.7),
    9: (2.5, 2.3),
    10: (2.4, 2.2),
}


def drive(variant: str, tmp_path: Path) -> list[np.ndarray]:
    cfg = AioliConfig(
        variant=variant,  # type: ignore[arg-type]
        rounds=2,
        delta=1,
        sweeps=2,
        one_hot_eps=0.25,
        eta=2.6,
        ema=0.5,
        shuffle=False,
        eval_sequences=4,
    )
    m = Aioli(cfg, context(tmp_path, 12))
    assert [t for t in range(13) if m.validation_due(t)] == sorted(LOSSES)
    weights = []
    for t in range(13):
        if t in LOSSES:
            m.observe_validation(t, torch.tensor(LOSSES[t], dtype=torch.float64))
        if t in (4, 10):
            weights.append(m.weights.copy())
    m.close()
    return weights


def test_two_rounds_by_hand(tmp_path):
    """one_hot_factor 0.75 (one_hot_eps 0.25), lp_rounds 2, lp_steps 1, eta 2.6, ema 0.5.

    Round 0. Lines 154-161: D[:, j] += previous_loss - new_loss over the probes 0, 1, 0, 1:
      D = [[0.2 + 0.2, 0.1 + 0.05], [0.1 + 0.05, 0.3 + 0.2]]; line 164: D /= 2 =
      [[0.2, 0.075], [0.075, 0.25]]. Lines 168-176: A[i] = solve(W, D[i]) with W = [[0.75, 0.25],
      [0.25, 0.75]], W^-1 = [[1.5, -0.5], [-0.5, 1.5]]: A = [[0.2625, 0.0125], [-0.0125, 0.3375]].
      Lines 325-330: min -0.0125 < 0, so A - min = [[0.275, 0.025], [0, 0.35]], / 0.65 =
      [[11/26, 1/26], [0, 14/26]]. Line 336 (i == 0): ema_graph = A; line 340: weights =
      ones * exp(2.6 (11/26, 15/26)) = (e^1.1, e^1.5): p_1 = (1, e^0.4) / (1 + e^0.4) =
      (0.401312339887548, 0.598687660112452).
    Round 1. D = [[0.1 + 0.1, 0.3 + 0.1], [0.2 + 0.4, 0.1 + 0.1]] / 2 = [[0.1, 0.2], [0.3, 0.1]];
      A = [[0.05, 0.25], [0.4, 0.0]] (min 0: no shift), / 0.7. Line 338: ema_graph =
      0.5 A + 0.5 ema_graph, column sums 0.5 (9/14 + 11/26, 5/14 + 15/26) = (97/182, 85/182);
      line 340, from ones (the uniform prior), not from p_1: log-odds 2.6 (85 - 97) / 182 = -6/35:
      p_2 = (1, e^(-6/35)) / (1 + e^(-6/35)) = (0.5427524941173192, 0.4572475058826808).
    The paper's Algorithm 1 multiplies onto p_1 instead (log-odds 0.4 - 6/35 = 8/35):
      p_2 = (0.44310463514496207, 0.5568953648550379), what their code does without --ema (line 345).
    """
    p1, p2 = drive("authors", tmp_path / "authors")
    np.testing.assert_allclose(p1, [0.401312339887548, 0.598687660112452], rtol=1e-13)
    np.testing.assert_allclose(p2, [0.5427524941173192, 0.4572475058826808], rtol=1e-13)
    q1, q2 = drive("paper", tmp_path / "paper")
    np.testing.assert_array_equal(q1, p1)  # the first round starts from uniform in both
    np.testing.assert_allclose(q2, [0.44310463514496207, 0.5568953648550379], rtol=1e-13)


def test_the_default_is_the_authors_variant():
    assert AioliConfig().variant == "authors"


def test_diagonal_follows_the_released_condition(tmp_path):
    """Line 166/181: --aioli_diagonal acts only with one_hot_factor != 1; with exact one-hot
    probes (one_hot_eps 0) the authors' variant keeps the full D, the paper's the diagonal."""

    def a_last(variant: str) -> np.ndarray:
        cfg = AioliConfig(variant=variant, rounds=2, delta=1, sweeps=2, one_hot_eps=0.0, diagonal=True)  # type: ignore[arg-type]
        m = Aioli(cfg, context(tmp_path / variant, 12))
        for t in (0, 1, 2, 3, 4):
            m.observe_validation(t, torch.tensor(LOSSES[t], dtype=torch.float64))
        m.close()
        return m.a_last

    order = ProbeSchedule(2, 12, 6, 1, 2, True, 0).order(0)
    drops = np.zeros((2, 2))
    for i, j in enumerate(order):
        drops[:, j] += np.subtract(LOSSES[i], LOSSES[i + 1])
    np.testing.assert_allclose(a_last("authors"), drops / 2, rtol=1e-13)
    np.testing.assert_allclose(a_last("paper"), np.diag(np.diag(drops / 2)), rtol=1e-13)


def test_validation_subset_keeps_within_a_tenth_of_training():
    """The quickstart's proxy: 160 steps of 32 sequences, 6 domains, rounds of 40 steps with one
    sweep of 2 steps: 4 rounds x 7 passes = 28 passes; floor(0.1 x 3 x 160 x 32 / (28 x 6)) = 9
    sequences per domain, 28 x 9 x 6 / (3 x 160 x 32) = 0.0984 of the training FLOPs."""
    cfg = AioliConfig(rounds=4, delta=2, sweeps=1)
    s = ProbeSchedule(6, 160, 40, 2, 1, True, 0)
    assert validation_passes(s) == 28 and eval_sequences(cfg, s, 32) == 9
    assert 28 * 9 * 6 / (3 * 160 * 32) == pytest.approx(0.0984375) and 28 * 10 * 6 / (3 * 160 * 32) > 0.1
    # the default schedule (20 rounds, 4 sweeps of 4 steps) on 7 domains, 10k steps of 64 sequences
    default = AioliConfig()
    s = ProbeSchedule(7, 10_000, 500, 4, 4, True, 0)
    n = eval_sequences(default, s, 64)
    assert validation_passes(s) == 20 * 29 and n == 47 and validation_passes(s) * n * 7 / (3 * 10_000 * 64) <= 0.1
    assert eval_sequences(AioliConfig(eval_sequences=0), s, 64) == 0  # the whole split, as theirs
    assert eval_sequences(cfg, ProbeSchedule(3, 5, 5, 1, 1, True, 0), 1) == 1  # at least one


def test_default_validation_flops_are_at_most_a_tenth_of_training_by_the_ledgers_formulas():
    """The default `mixing.aioli` (20 rounds, 4 sweeps of 4 steps, `eval_sequences: null`) on 7
    domains, 10k steps of 64 sequences of 2048 tokens, costed as the ledger costs a run
    (`train_flops`, `forward_flops`; a model's FLOPs per token, which cancel): 580 passes
    of 47 sequences per domain, 580 x 47 x 7 / (3 x 10,000 x 64) = 0.0994 of the training FLOPs.
    The authors' schedule (`eval_sequences: 0`, every pass the whole split) on a split of 1,000
    sequences per domain would spend 2.11 times the training FLOPs."""
    import itertools

    from doremi.methods.aioli.method import round_length
    from doremi.reports.ledger import forward_flops, train_flops
    from trainer.config.schema import ModelConfig
    from trainer.model.flops import flops_per_token

    k, steps, batch, seq = 7, 10_000, 64, 2048
    fpt = flops_per_token(ModelConfig(vocab_size=32_000, max_seq_len=seq), seq)
    s = ProbeSchedule(k, steps, round_length(steps, AioliConfig().rounds, None), 4, 4, True, 0)
    n = eval_sequences(AioliConfig(), s, batch)
    passes = validation_passes(s)
    train = train_flops(fpt, steps * batch * seq)
    assert (passes, n) == (580, 47)
    share = forward_flops(fpt, passes * n * k * seq) / train
    assert share == pytest.approx(580 * 47 * 7 / (3 * 10_000 * 64), rel=1e-12) and share <= 0.1
    assert share == pytest.approx(0.0993854, abs=1e-7)
    assert forward_flops(fpt, passes * (n + 1) * k * seq) / train > 0.1  # the most sequences that fit
    assert forward_flops(fpt, passes * 1000 * k * seq) / train == pytest.approx(2.1145833, abs=1e-7)
    # every run whose budget allows a sequence per domain stays within it
    for k, steps, batch in itertools.product((2, 5, 7, 22), (2_000, 10_000, 50_000), (8, 64, 512)):
        s = ProbeSchedule(k, steps, round_length(steps, 20, None), 4, 4, True, 0)
        n, passes = eval_sequences(AioliConfig(), s, batch), validation_passes(s)
        if passes and 0.1 * 3 * steps * batch >= passes * k:
            assert forward_flops(fpt, passes * n * k * seq) <= 0.1 * train_flops(fpt, steps * batch * seq)


def test_trainer_validates_the_subset_and_the_ledger_counts_it(stores, tmp_path):
    """A 5-step proxy (3 domains, 8 sequences a step, one round of one sweep of 1 step): 4
    passes of floor(0.1 x 3 x 5 x 8 / (4 x 3)) = 1 sequence per domain (train.eval_sequences 16
    is not used); the ledger's validation FLOPs are a forward over exactly those tokens."""
    from doremi.pipeline import stages
    from tests.runs import config
    from trainer.records.metrics import read_jsonl

    run = tmp_path / "proxy"
    sets = ["train.steps=5", "mixing.method=aioli", "mixing.aioli.rounds=1", "mixing.aioli.delta=1"]
    cfg = config(stores, run, *sets, "mixing.aioli.sweeps=1")
    stages.train_proxy(cfg)
    evals = [r["method_evals"] for r in read_jsonl(run / "metrics.jsonl") if "method_evals" in r][-1]
    assert evals["passes"] == 4
    assert 0 < evals["tokens"] <= 4 * 1 * 3 * 32
    cost = run_cost(run, "method")
    fpt = _flops_per_token(yaml.safe_load((run / "config.yaml").read_text()))
    assert cost["validation"] == pytest.approx(fpt / 3 * evals["tokens"], rel=1e-12)
    assert cost["validation"] <= 0.1 * cost["train"]
    assert cost["validation_seconds"] == evals["seconds"] > 0  # the passes' measured time, beside their FLOPs


def test_config_rejects_unknown_variant():
    from trainer.config.tools import ConfigError

    with pytest.raises(ConfigError, match=r"^mixing.aioli.variant: expected 'authors' or 'paper', got 'x'$"):
        AioliConfig(variant="x").validate("mixing.aioli")  # type: ignore[arg-type]
