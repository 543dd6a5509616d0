import collections
import math

import numpy as np
import pytest

from data.errors import DataError
from data.sampling.apportion import apportion
from data.sampling.holdout import holdout_split
from data.sampling.sampler import DomainBatchSampler, interleave

NUM = [37, 11, 5, 60]


def weight_schedule(steps, k=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.dirichlet(np.ones(k)) for _ in range(steps)]


def counts_of(batch, k):
    got = collections.Counter(d for d, _ in batch)
    return np.array([got[d] for d in range(k)])


def run_counts(num, b, schedule, seed=0):
    """Per-step counts and nominal B x w_t of a sampler drawn over `schedule`."""
    s = DomainBatchSampler(num, b, seed=seed)
    rows, nominal = [], []
    for t, w in enumerate(schedule):
        rows.append(counts_of(s.global_batch(t, w), len(num)))
        nominal.append(b * np.asarray(w) / np.sum(w))
    return np.array(rows), np.array(nominal), s


def test_apportion_hand_cases():
    assert apportion([0.0] * 3, [0.5, 0.3, 0.2], 7)[0] == [4, 2, 1]
    # Uniform over 3 at B = 4: the extra sequence rotates instead of always going to domain 0.
    d, got = [0.0] * 3, []
    for _ in range(3):
        c, d = apportion(d, [1 / 3] * 3, 4)
        got.append(c)
    assert sorted(map(tuple, got)) == [(1, 1, 2), (1, 2, 1), (2, 1, 1)]
    assert max(abs(x) for x in d) < 1e-9  # after 3 steps every domain has exactly its 4 x 3 / 3
    counts, after = apportion([0.0, 0.0], [1.0, 0.0], 5)
    assert counts == [5, 0] and after == [0.0, 0.0]


def test_fixed_small_weight_is_drawn_as_often_as_it_asks():
    """w = 0.002 at B = 32: 64 sequences in 1000 steps (rounding afresh drew none)."""
    w = [0.002, 0.499, 0.499]
    rows, nominal, _ = run_counts([500, 5000, 5000], 32, [w] * 1000)
    cum, target = rows.cumsum(0), nominal.cumsum(0)
    assert cum[-1, 0] == 64
    assert np.abs(cum - target).max() <= 1.0
    gap = math.ceil(2 / (32 * 0.002))
    drawn_at = np.flatnonzero(rows[:, 0])
    assert np.diff(np.concatenate([[-1], drawn_at, [1000]])).max() <= gap


@pytest.mark.parametrize("k,b", [(3, 32), (12, 240), (5, 7), (7, 12), (22, 64), (2, 1)])
def test_fixed_weights_within_one_sequence_and_no_long_gaps(k, b):
    """B not a multiple of k included; weights from very skewed to flat."""
    rng = np.random.default_rng(k * 100 + b)
    for conc in (0.05, 0.5, 5.0):
        w = rng.dirichlet(np.ones(k) * conc)
        rows, nominal, _ = run_counts([10_000] * k, b, [w] * 400, seed=k)
        dev = rows.cumsum(0) - nominal.cumsum(0)
        assert np.abs(dev).max() <= 1.0, (conc, np.abs(dev).max())
        assert (rows.sum(1) == b).all()
        for i in range(k):
            if w[i] * b * 400 < 4:
                continue
            gap = math.ceil(2 / (b * w[i]))
            at = np.flatnonzero(rows[:, i])
            assert np.diff(np.concatenate([[-1], at])).max() <= gap, (i, w[i])


def test_changing_weights_within_two_sequences():
    rng = np.random.default_rng(7)
    for k, b in [(3, 8), (6, 32), (12, 24), (5, 5)]:
        for conc in (0.05, 1.0):
            schedule = [rng.dirichlet(np.ones(k) * conc) for _ in range(300)]
            rows, nominal, _ = run_counts([10_000] * k, b, schedule)
            assert np.abs(rows.cumsum(0) - nominal.cumsum(0)).max() <= 2.0
    # Alternating one-hot schedules, the hardest case for carried deficits.
    schedule = [np.eye(4)[t % 4] * 0.7 + 0.075 for t in range(200)]
    rows, nominal, _ = run_counts([10_000] * 4, 3, schedule)
    assert np.abs(rows.cumsum(0) - nominal.cumsum(0)).max() <= 2.0


def test_state_reports_realised_and_nominal():
    rows, nominal, s = run_counts(NUM, 12, [[0.1, 0.2, 0.3, 0.4]] * 10)
    assert s.drawn() == rows.sum(0).tolist()
    assert s.nominal == pytest.approx(nominal.sum(0).tolist(), abs=1e-9)
    assert sum(s.deficits) == pytest.approx(0.0, abs=1e-9)


def test_pools_exclude_held_back_sequences_in_every_epoch():
    pool, held = holdout_split(40, 8, split_seed=3, domain="a")
    assert len(held) == 8 and sorted(set(pool) | set(held)) == list(range(40))
    again = holdout_split(40, 8, split_seed=3, domain="a")[1]
    assert held.tolist() == again.tolist()
    assert holdout_split(40, 8, split_seed=3, domain="b")[1].tolist() != held.tolist()
    s = DomainBatchSampler([40, 10], 8, seed=1, pools=[pool, np.arange(10)])
    drawn = [i for t in range(20) for d, i in s.global_batch(t, [0.5, 0.5]) if d == 0]
    assert len(drawn) == 80 and not set(drawn) & set(held.tolist())
    assert sorted(drawn[:32]) == sorted(pool.tolist())  # one epoch is the pool, once each
    assert s.epochs()[0] == 80 / 32
    with pytest.raises(DataError, match="domain 'a' has 12 training sequences; holding back 4 leaves too few"):
        holdout_split(12, 4, split_seed=0, domain="a")


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
    assert set(state) == {"step", "cursors", "deficits", "nominal", "seed", "num_sequences", "global_batch_size"}
    resumed = DomainBatchSampler(NUM, 12, seed=5)
    resumed.load_state_dict(state)
    assert [resumed.global_batch(t, weights[t]) for t in range(7, 20)] == run_a[7:]


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
    with pytest.raises(DataError, match="step 0 was drawn with weights"):
        s.global_batch(0, [1, 0, 0, 0])
    with pytest.raises(DataError, match="next step is 1, asked for step 5"):
        s.global_batch(5, w)


def test_sampler_errors():
    s = DomainBatchSampler([10, 0], 8, seed=0)
    with pytest.raises(DataError, match=r"domain\(s\) \[1\] have weight > 0 but no sequences"):
        s.global_batch(0, [0.5, 0.5])
    assert counts_of(s.global_batch(0, [1.0, 0.0]), 2).tolist() == [8, 0]
    with pytest.raises(DataError, match=r"must be finite and >= 0, got 1=-0.5"):
        s.check([1.5, -0.5])
    with pytest.raises(DataError, match="expected 2 weights"):
        s.check([1.0])
    with pytest.raises(DataError, match="not a multiple of dp x micro_batches = 3 x 1"):
        s.local(0, [1, 0], 0, 3, 1)
    other = DomainBatchSampler([10, 0], 8, seed=1)
    with pytest.raises(DataError, match="sampler state: seed is 0 in the checkpoint but 1 now"):
        other.load_state_dict(s.state_dict())


def test_random_draws_depend_on_seed_and_step_only_and_follow_the_weights():
    """Random draws: multinomial counts from (seed, step), the same for a sampler resumed at any
    step and for every dp x micro-batch split; over many steps the shares approach the weights."""
    w = [0.5, 0.3, 0.1, 0.1]
    a = DomainBatchSampler(NUM, 12, seed=5)
    run = [a.global_batch(t, w, "random") for t in range(200)]
    counts = np.array([counts_of(b, 4) for b in run])
    assert len({tuple(c) for c in counts}) > 10  # not one apportioned count every step
    assert counts.sum(axis=1).tolist() == [12] * 200
    assert np.abs(counts.sum(axis=0) / counts.sum() - w).max() < 0.02
    b = DomainBatchSampler(NUM, 12, seed=5)
    for t in range(7):
        b.global_batch(t, w, "random")
    resumed = DomainBatchSampler(NUM, 12, seed=5)
    resumed.load_state_dict(b.state_dict())
    assert [resumed.global_batch(t, w, "random") for t in range(7, 20)] == run[7:20]
    assert DomainBatchSampler(NUM, 12, seed=6).global_batch(0, w, "random") != run[0]
    parts = [DomainBatchSampler(NUM, 12, seed=5).local(0, w, r, 2, 3, "random") for r in range(2)]
    assert [i for rank in parts for mb in rank for i in mb] == run[0]


def test_a_step_redrawn_in_another_mode_is_refused():
    s = DomainBatchSampler(NUM, 12, seed=5)
    w = [0.5, 0.25, 0.125, 0.125]
    s.global_batch(0, w)
    with pytest.raises(DataError, match=r"\(exact\), now asked with .* \(random\)"):
        s.global_batch(0, w, "random")
    with pytest.raises(DataError, match="sampler draws: expected one of exact, random, got 'some'"):
        DomainBatchSampler(NUM, 12, seed=5).global_batch(0, w, "some")
