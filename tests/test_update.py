"""The DoReMi update (doremi/methods/doremi/update.py) on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from doremi.methods.doremi.update import (
    domain_excess,
    domain_excess_sums,
    per_domain_mean_loss,
    to_log_weights,
    uniform_log_weights,
    update_weights,
)

NAN = float("nan")


def _batch(dtype=torch.float32):
    """k = 3, b = 4, s = 3. Per-token excess (clipped, masked) by sequence:
    seq 0, domain 0: [2, 0 (2-3 -> 0), 3]                  -> sum 5, 3 tokens
    seq 1, domain 2: [0 (1-2 -> 0), 1, masked]             -> sum 1, 2 tokens
    seq 2, domain 0: [3, 0 (0-1 -> 0), 1]                  -> sum 4, 3 tokens
    seq 3, domain 1: [2, 2, masked NaN]                    -> sum 4, 2 tokens
    """
    proxy = torch.tensor([[3, 2, 5], [1, 1, 1], [4, 0, 2], [2, 2, 2]], dtype=dtype)
    ref = torch.tensor([[1, 3, 2], [2, 0, 1], [1, 1, 1], [0, 0, NAN]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    ids = torch.tensor([0, 2, 0, 1])
    return proxy, ref, ids, mask


def test_excess_sums_clip_per_token_and_ignore_masked_nan():
    proxy, ref, ids, mask = _batch()
    sums, counts = domain_excess_sums(proxy, ref, ids, mask, 3)
    assert sums.tolist() == [9.0, 4.0, 1.0]
    assert counts.tolist() == [6, 2, 2]
    assert counts.dtype == torch.int64
    lam = domain_excess(sums, counts)
    assert lam.tolist() == [1.5, 2.0, 0.5]  # unclipped mean for domain 0 would be 7/6


def test_excess_sums_add_up_across_splits_of_the_batch():
    """The all-reduce contract: sums over pieces (dp ranks, micro-batches) equal the whole."""
    g = torch.Generator().manual_seed(0)
    proxy = torch.rand(8, 5, generator=g) * 4
    ref = torch.rand(8, 5, generator=g) * 4
    ids = torch.randint(0, 4, (8,), generator=g)
    mask = torch.rand(8, 5, generator=g) > 0.3
    whole = domain_excess_sums(proxy, ref, ids, mask, 4)
    parts = [
        domain_excess_sums(proxy[i : i + 2], ref[i : i + 2], ids[i : i + 2], mask[i : i + 2], 4) for i in range(0, 8, 2)
    ]
    torch.testing.assert_close(sum(p[0] for p in parts), whole[0], rtol=0, atol=1e-6)
    assert torch.equal(sum(p[1] for p in parts), whole[1])


def test_absent_domain_keeps_previous_lambda_and_starts_at_zero():
    sums = torch.tensor([3.0, 0.0, 2.0])
    counts = torch.tensor([2, 0, 4])
    assert domain_excess(sums, counts).tolist() == [1.5, 0.0, 0.5]
    prev = torch.tensor([9.0, 7.0, 9.0])
    assert domain_excess(sums, counts, prev).tolist() == [1.5, 7.0, 0.5]


def test_per_domain_mean_loss():
    proxy, _, ids, mask = _batch()
    sums, counts = per_domain_mean_loss(proxy, ids, mask, 3)
    assert sums.tolist() == [16.0, 4.0, 2.0]
    assert counts.tolist() == [6, 2, 2]


def test_update_hand_computed_two_steps_with_carry_over():
    # Step 1: uniform, lambda = [0, ln 2, ln 4], eta = 1 -> alpha' ∝ [1, 2, 4] -> [1, 2, 4]/7;
    # c = 0.1: alpha_1 = 0.9 [1, 2, 4]/7 + 0.1/3 = [17/105, 61/210, 23/42].
    log_a0 = uniform_log_weights(3, dtype=torch.float64)
    lam1 = torch.tensor([0.0, math.log(2), math.log(4)], dtype=torch.float64)
    log_a1, a1 = update_weights(log_a0, lam1, eta=1.0, smoothing=0.1)
    torch.testing.assert_close(a1, torch.tensor([17 / 105, 61 / 210, 23 / 42], dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(log_a1, a1.log(), rtol=0, atol=1e-15)
    # Step 2 carries alpha_1 over: lambda = [ln 2, 0, 0] -> alpha' ∝ [68, 61, 115]/210,
    # normalised [68, 61, 115]/244; alpha_2 = 0.9 * that + 1/30.
    lam2 = torch.tensor([math.log(2), 0.0, 0.0], dtype=torch.float64)
    _, a2 = update_weights(log_a1, lam2, eta=1.0, smoothing=0.1)
    expect = [0.9 * 68 / 244 + 1 / 30, 0.9 * 61 / 244 + 1 / 30, 0.9 * 115 / 244 + 1 / 30]
    torch.testing.assert_close(a2, torch.tensor(expect, dtype=torch.float64), rtol=0, atol=1e-15)
    assert a2.tolist() == pytest.approx([0.2841530055, 0.2583333333, 0.4575136612], abs=1e-10)


def test_update_eta_scales_the_step():
    # eta = 0.5 with lambda = [0, 2 ln 2, 4 ln 2] equals eta = 1 with [0, ln 2, 2 ln 2]:
    # alpha' ∝ [1, 2, 4]; c = 0 -> [1/7, 2/7, 4/7].
    lam = torch.tensor([0.0, 2 * math.log(2), 4 * math.log(2)], dtype=torch.float64)
    _, a = update_weights(uniform_log_weights(3, dtype=torch.float64), lam, 0.5, 0.0)
    torch.testing.assert_close(a, torch.tensor([1 / 7, 2 / 7, 4 / 7], dtype=torch.float64), rtol=0, atol=1e-15)


def test_update_from_batch_losses_end_to_end():
    proxy, ref, ids, mask = _batch()
    lam = domain_excess(*domain_excess_sums(proxy, ref, ids, mask, 3))
    _, a = update_weights(uniform_log_weights(3), lam, eta=1.0, smoothing=1e-3)
    e = [math.exp(1.5), math.exp(2.0), math.exp(0.5)]
    expect = [(1 - 1e-3) * x / sum(e) + 1e-3 / 3 for x in e]
    assert a.tolist() == pytest.approx(expect, abs=1e-7)


def test_eta_zero_keeps_weights_up_to_smoothing():
    alpha = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    lam = torch.tensor([5.0, 0.0, 1.0], dtype=torch.float64)
    _, a = update_weights(to_log_weights(alpha), lam, eta=0.0, smoothing=0.0)
    torch.testing.assert_close(a, alpha, rtol=0, atol=1e-15)
    _, a = update_weights(uniform_log_weights(3), lam.float(), eta=0.0, smoothing=1e-3)
    torch.testing.assert_close(a, torch.full((3,), 1 / 3), rtol=0, atol=1e-7)


def test_permuting_domains_permutes_weights():
    g = torch.Generator().manual_seed(1)
    log_a = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), 0)
    lam = torch.rand(5, generator=g, dtype=torch.float64) * 3
    perm = torch.tensor([3, 0, 4, 1, 2])
    la, a = update_weights(log_a, lam, 1.0, 1e-3)
    lap, ap = update_weights(log_a[perm], lam[perm], 1.0, 1e-3)
    torch.testing.assert_close(ap, a[perm], rtol=0, atol=1e-15)
    torch.testing.assert_close(lap, la[perm], rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_losses_do_not_overflow_and_respect_floor(dtype):
    c, k = 1e-3, 3
    log_a = uniform_log_weights(k, dtype=dtype)
    for _ in range(3):  # repeated huge steps: log alpha would reach ~3e4 without normalising
        log_a, a = update_weights(log_a, torch.tensor([1e4, 0.0, 5e3], dtype=dtype), 1.0, c)
    assert torch.isfinite(log_a).all() and torch.isfinite(a).all()
    assert a[1].item() == pytest.approx(c / k, rel=1e-6)
    assert a[2].item() == pytest.approx(c / k, rel=1e-6)
    assert a[0].item() == pytest.approx(1 - c + c / k, rel=1e-6)
    assert log_a[1].item() == pytest.approx(math.log(c / k), rel=1e-6)
    assert a.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_smoothing_floor_and_sum_to_one_over_a_random_trajectory():
    g = torch.Generator().manual_seed(2)
    c, k = 0.05, 6
    log_a = uniform_log_weights(k, dtype=torch.float64)
    for _ in range(50):
        lam = torch.rand(k, generator=g, dtype=torch.float64) * 20
        log_a, a = update_weights(log_a, lam, 1.0, c)
        assert a.min().item() >= c / k * (1 - 1e-12)
        assert a.sum().item() == pytest.approx(1.0, abs=1e-12)


def test_fp32_matches_fp64():
    g = torch.Generator().manual_seed(3)
    lam = torch.rand(4, generator=g, dtype=torch.float64) * 2
    _, a64 = update_weights(uniform_log_weights(4, dtype=torch.float64), lam, 1.0, 1e-3)
    la32, a32 = update_weights(uniform_log_weights(4), lam.float(), 1.0, 1e-3)
    assert a32.dtype == torch.float32 and la32.dtype == torch.float32
    torch.testing.assert_close(a32.double(), a64, rtol=1e-6, atol=0)


def test_to_log_weights_round_trip_and_bad_input():
    alpha = torch.tensor([0.25, 0.75])
    torch.testing.assert_close(to_log_weights(alpha).exp(), alpha, rtol=0, atol=0)
    with pytest.raises(ValueError, match="summing to 1"):
        to_log_weights(torch.tensor([0.5, 0.6]))
    with pytest.raises(ValueError, match="summing to 1"):
        to_log_weights(torch.tensor([1.5, -0.5]))


def test_bad_arguments_name_the_problem():
    proxy, ref, ids, mask = _batch()
    with pytest.raises(ValueError, match=r"ref_loss: expected shape \(4, 3\)"):
        domain_excess_sums(proxy, ref[:, :2], ids, mask, 3)
    with pytest.raises(ValueError, match="mask: expected dtype torch.bool"):
        domain_excess_sums(proxy, ref, ids, mask.float(), 3)
    with pytest.raises(ValueError, match=r"domain_ids: expected shape \(4,\)"):
        domain_excess_sums(proxy, ref, ids[:3], mask, 3)
    with pytest.raises(ValueError, match="eta: expected"):
        update_weights(uniform_log_weights(3), torch.zeros(3), eta=-1.0)
    with pytest.raises(ValueError, match="smoothing: expected"):
        update_weights(uniform_log_weights(3), torch.zeros(3), smoothing=1.5)
    with pytest.raises(ValueError, match="excess: expected shape"):
        update_weights(uniform_log_weights(3), torch.zeros(4))
