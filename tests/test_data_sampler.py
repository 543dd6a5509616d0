import collections

import numpy as np
import pytest

from data.errors import DataError
from data.sampler import DomainBatchSampler, interleave, largest_remainder

NUM = [37, 11, 5, 60]


def weight_schedule(steps, k=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.dirichlet(np.ones(k)) for _ in range(steps)]


def test_largest_remainder_hand_cases():
    assert largest_remainder([0.5, 0.3, 0.2], 7) == [4, 2, 1]  # quotas 3.5, 2.1, 1.4
    assert largest_remainder([1 / 3] * 3, 4) == [2, 1, 1]      # equal remainders: lower index first
    assert largest_remainder([1 / 3] * 3, 3) == [1, 1, 1]
    assert largest_remainder([0.1, 0.9], 10) == [1, 9]
    assert largest_remainder([0.0, 0.25, 0.75], 2) == [0, 1, 1]  # quotas 0, .5, 1.5: .5 wins the tie
    assert largest_remainder([0.05, 0.05, 0.9], 8) == [1, 0, 7]  # quotas .4, .4, 7.2


def test_per_domain_counts_equal_largest_remainder():
    s = DomainBatchSampler(NUM, 16, seed=0)
    for step, w in enumerate(weight_schedule(30)):
        batch = s.global_batch(step, w)
        got = collections.Counter(d for d, _ in batch)
        assert [got[d] for d in range(4)] == largest_remainder(w / w.sum(), 16) == s.counts(w)


def test_without_replacement_within_an_epoch_and_epoch_report():
    s = DomainBatchSampler([6, 10], 4, seed=3)
    drawn = [i for step in range(6) for d, i in s.global_batch(step, [0.5, 0.5]) if d == 0]
    assert len(drawn) == 12
    assert sorted(drawn[:6]) == list(range(6)) and sorted(drawn[6:]) == list(range(6))
    assert drawn[:6] != drawn[6:]  # reshuffled for the next epoch
    assert s.epochs() == [2.0, 1.2]


def test_same_seed_same_batches_and_resume_from_step_n():
    weights = weight_schedule(20)
    a, b = DomainBatchSampler(NUM, 12, seed=5), DomainBatchSampler(NUM, 12, seed=5)
    run_a = [a.global_batch(t, w) for t, w in enumerate(weights)]
    run_b = [b.global_batch(t, w) for t, w in enumerate(weights)]
    assert run_a == run_b
    assert DomainBatchSampler(NUM, 12, seed=6).global_batch(0, weights[0]) != run_a[0]
    first = DomainBatchSampler(NUM, 12, seed=5)
    for t in range(7):
        first.global_batch(t, weights[t])
    state = first.state_dict()
    assert set(state) == {"step", "cursors", "seed", "num_sequences", "global_batch_size"}
    resumed = DomainBatchSampler(NUM, 12, seed=5)
    resumed.load_state_dict(state)
    assert [resumed.global_batch(t, weights[t]) for t in range(7, 20)] == run_a[7:]


def test_skip_to_matches_drawing_with_constant_weights():
    w = [0.1, 0.2, 0.3, 0.4]
    drawn, skipped = DomainBatchSampler(NUM, 12, seed=2), DomainBatchSampler(NUM, 12, seed=2)
    for t in range(9):
        drawn.global_batch(t, w)
    skipped.skip_to(9, w)
    assert skipped.state_dict() == drawn.state_dict()
    assert skipped.global_batch(9, w) == drawn.global_batch(9, w)


def test_union_over_ranks_and_micro_batches_is_the_global_batch():
    for dp, micro in [(1, 1), (2, 1), (1, 4), (2, 2), (4, 3)]:
        samplers = [DomainBatchSampler(NUM, 24, seed=1) for _ in range(dp)]
        ref = DomainBatchSampler(NUM, 24, seed=1)
        for step, w in enumerate(weight_schedule(5)):
            glob = ref.global_batch(step, w)
            parts = [s.local(step, w, r, dp, micro) for r, s in enumerate(samplers)]
            assert all(len(p) == micro and all(len(mb) == 24 // (dp * micro) for mb in p) for p in parts)
            assert [item for p in parts for mb in p for item in mb] == glob


def test_domains_are_spread_over_micro_batches():
    s = DomainBatchSampler([100, 100, 100], 24, seed=0)
    micro = s.local(0, [0.5, 1 / 3, 1 / 6], 0, 1, 4)  # counts 12, 8, 4 over 4 micro-batches of 6
    assert [collections.Counter(d for d, _ in mb) for mb in micro] == [{0: 3, 1: 2, 2: 1}] * 4
    order = interleave([6, 2])
    assert order == [0, 0, 1, 0, 0, 0, 1, 0]


def test_repeated_request_for_the_same_step_is_cached_and_order_is_enforced():
    s = DomainBatchSampler(NUM, 8, seed=0)
    w = [0.25] * 4
    first = s.global_batch(0, w)
    assert s.local(0, w, 0, 1, 1) == [first] and s.step == 1
    with pytest.raises(DataError, match="step 0 was drawn with counts"):
        s.global_batch(0, [1, 0, 0, 0])
    with pytest.raises(DataError, match="next step is 1, asked for step 5"):
        s.global_batch(5, w)


def test_sampler_errors():
    s = DomainBatchSampler([10, 0], 8, seed=0)
    with pytest.raises(DataError, match=r"domain\(s\) \[1\] have weight > 0 but no sequences"):
        s.global_batch(0, [0.5, 0.5])
    assert s.counts([1.0, 0.0]) == [8, 0]
    with pytest.raises(DataError, match=r"must be finite and >= 0, got 1=-0.5"):
        s.counts([1.5, -0.5])
    with pytest.raises(DataError, match="expected 2 weights"):
        s.counts([1.0])
    with pytest.raises(DataError, match="not a multiple of dp x micro_batches = 3 x 1"):
        s.local(0, [1, 0], 0, 3, 1)
    other = DomainBatchSampler([10, 0], 8, seed=1)
    with pytest.raises(DataError, match="sampler state: seed is 0 in the checkpoint but 1 now"):
        other.load_state_dict(s.state_dict())
