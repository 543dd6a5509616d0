"""The sampler's epoch caps (`data.max_epochs` at run time, data/sampling/sampler.py): no cursor
passes its cap under exact or random draws, the batch stays whole, the freed share goes to the
other domains in proportion to their weights, a resume draws the same batches, a run that asks
for more than the pools hold stops, and a fixed mixture capped ahead of the run
(`sequence_capped`) draws the same batches with and without the caps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.errors import DataError
from data.sampling.apportion import apportion
from data.sampling.mixtures import sequence_capped
from data.sampling.sampler import DomainBatchSampler, capped_share, cursor_caps

POOLS = [10, 50, 50]
ASKED = [0.5, 0.25, 0.25]


def capped(draws: str = "exact", seed: int = 0) -> DomainBatchSampler:
    return DomainBatchSampler(POOLS, 8, seed, caps=cursor_caps(POOLS, 1.0), names=["small", "a", "b"])


def test_cursor_caps_floor_the_epochs_in_sequences():
    assert cursor_caps([10, 50, 7], 2.0) == [20, 100, 14]
    assert cursor_caps([10, 50, 7], 0.55) == [5, 27, 3]
    with pytest.raises(DataError, match="max_epochs: expected a finite value > 0, got 0"):
        cursor_caps([10], 0)


def test_apportion_room_passes_a_full_domain_over_and_keeps_its_debt():
    """B = 8 at [0.5, 0.25, 0.25] asks [4, 2, 2]; domain 0 has room for 2: its other two slots go
    one each to the equal-weight others, and it is still owed 2."""
    assert apportion([0.0] * 3, ASKED, 8, room=[2, 8, 8]) == ([2, 3, 3], [2.0, -1.0, -1.0])
    assert apportion([0.0] * 3, ASKED, 8, room=[4, 2, 2]) == apportion([0.0] * 3, ASKED, 8)
    with pytest.raises(ValueError, match="holds fewer than 8"):
        apportion([0.0] * 3, ASKED, 8, room=[2, 2, 2])


def test_capped_share_by_hand():
    w = np.array(ASKED)
    assert capped_share(w, [4, 40, 40], 8) is w  # nothing binds: unchanged
    np.testing.assert_array_equal(capped_share(w, [2, 40, 40], 8), [0.25, 0.375, 0.375])
    # the freed share in proportion to the others' weights: 0.3 and 0.1 of 0.4 -> 0.75 and 0.25 of 0.5
    np.testing.assert_allclose(capped_share(np.array([0.6, 0.3, 0.1]), [4, 40, 40], 8), [0.5, 0.375, 0.125], atol=1e-15)
    # no weighted domain has room enough: the rest in proportion to the others' room
    np.testing.assert_array_equal(capped_share(np.array([1.0, 0.0, 0.0]), [2, 10, 30], 8), [0.25, 0.1875, 0.5625])


def test_exact_draws_stop_at_the_cap_and_hand_its_share_to_the_others():
    """Domain 0 (10 sequences, cap 1 epoch) asks 4 a step: 4, 4, then the 2 left at step 3 with
    the 2 freed slots to the others (equal weights: one each); from step 4 its weight and the 2
    it was still owed go to the others in proportion, so they draw 4 and 4 with no debt."""
    s = capped()
    counts, weights = [], []
    for t in range(6):
        s.global_batch(t, ASKED)
        counts.append(list(s.counts))
        weights.append(s.weights.tolist())
        assert len(s.last_batch) == 8 and s.cursors[0] <= 10
    assert counts == [[4, 2, 2], [4, 2, 2], [2, 3, 3], [0, 4, 4], [0, 4, 4], [0, 4, 4]]
    assert weights[:3] == [ASKED] * 3 and weights[3:] == [[0.0, 0.5, 0.5]] * 3
    assert s.exhausted == {0: 3} and s.cursors == [10, 19, 19] and s.deficits == [0.0, 0.0, 0.0]
    assert s.epochs()[0] == 1.0
    # nominal: B x the weights drawn with; the 2 forgiven at step 4 are its difference to realised
    assert s.nominal == [12.0, 18.0, 18.0]


def test_random_draws_stop_at_the_cap_and_the_weights_say_what_was_drawn_with():
    s = capped()
    for t in range(12):
        room = s.room()
        s.global_batch(t, ASKED, "random")
        assert sum(s.counts) == 8 and len(s.last_batch) == 8
        assert all(c <= r for c, r in zip(s.counts, room)) and s.cursors[0] <= 10
        np.testing.assert_array_equal(s.weights, capped_share(np.array(ASKED), room, 8))
    assert s.cursors[0] == 10 and list(s.exhausted) == [0]
    step = s.exhausted[0]
    assert step <= 4 and all(s.cursors[0] == 10 for _ in range(step, 12))
    # seed 0: steps 1, 2 draw 3 and 4 of domain 0; step 3 has room for 3 and asks 4: capped to
    # 3/8 with the freed 1/8 split evenly
    assert step == 3 and s.state_dict()["exhausted"] == [3, None, None]


def test_random_draws_past_the_room_are_redrawn_over_the_others():
    """A share at the room still draws past it by chance: the excess goes to the domains with
    room left. Domain 0 with room 1 at share 1/8 over many seeds: never more than 1."""
    over = 0
    for seed in range(200):
        s = DomainBatchSampler([10, 50], 8, seed, caps=[10, 100])
        s.cursors = [9, 0]
        s.global_batch(0, [0.5, 0.5], "random")
        assert s.counts[0] <= 1 and sum(s.counts) == 8
        over += int(np.random.default_rng([seed, 0x5A3D, 0]).multinomial(8, s.weights)[0] > 1)
    assert over > 0  # the cut happened for some seeds, so the assertion above can fail


@pytest.mark.parametrize("draws", ["exact", "random"])
def test_resume_midway_draws_the_same_batches(draws):
    def asked(t: int) -> list[float]:
        return [0.6, 0.3, 0.1] if t % 3 else [0.4, 0.2, 0.4]

    full = capped(draws, seed=5)
    a = [full.global_batch(t, asked(t), draws) for t in range(12)]
    first = capped(draws, seed=5)
    b = [first.global_batch(t, asked(t), draws) for t in range(1)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = capped(draws, seed=5)
    resumed.load_state_dict(state)
    b += [resumed.global_batch(t, asked(t), draws) for t in range(1, 12)]
    assert a == b
    assert full.exhausted == resumed.exhausted and 0 in full.exhausted and full.exhausted[0] > 1
    assert full.state_dict() == resumed.state_dict()


def test_every_pool_read_to_its_cap_stops_with_one_line():
    s = DomainBatchSampler([3, 3], 4, 0, caps=[3, 3], names=["x", "y"])
    s.global_batch(0, [0.5, 0.5])
    with pytest.raises(DataError) as e:
        s.global_batch(1, [0.5, 0.5])
    assert str(e.value) == (
        "data.max_epochs: at step 2 the pools have 2 sequences left under their epoch caps (x 1, y 1), "
        "fewer than the global batch of 4: the run asks for more data than the pools hold at max_epochs"
    )


def test_an_exhausted_domain_with_all_the_weight_hands_the_batch_to_the_others():
    """A one-hot mixture (ODM's whole-batch draws) on an exhausted domain: the batch goes to the
    domains with room, in proportion to their room."""
    for draws in ("exact", "random"):
        s = DomainBatchSampler([4, 10, 30], 4, 0, caps=[4, 10, 30])
        s.global_batch(0, [1.0, 0.0, 0.0], draws)
        s.global_batch(1, [1.0, 0.0, 0.0], draws)
        assert s.counts[0] == 0 and sum(s.counts) == 4 and s.weights.tolist() == [0.0, 0.25, 0.75]


@pytest.mark.parametrize("seed", range(6))
def test_a_capped_fixed_mixture_never_meets_the_runtime_cap(seed):
    """`sequence_capped` leaves one sequence of slack and the exact sampler stays within one of
    nominal, so the caps never move a draw: the same batches with and without them, while the
    domain the mixture capped ends within two sequences of its cap."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 6))
    pools = rng.integers(20, 200, size=k).tolist()
    steps, batch = int(rng.integers(10, 40)), int(rng.choice([4, 8, 16]))
    asked = rng.dirichlet(np.ones(k))
    asked[0] += 3  # domain 0 asks more than its share: the static cap binds on it
    asked /= asked.sum()
    max_epochs = 0.8 * steps * batch * asked[0] / pools[0]
    weights = sequence_capped(asked, pools, steps * batch, max_epochs)
    caps = cursor_caps(pools, max_epochs)
    plain = DomainBatchSampler(pools, batch, seed)
    runtime = DomainBatchSampler(pools, batch, seed, caps=caps)
    for t in range(steps):
        assert runtime.global_batch(t, weights) == plain.global_batch(t, weights)
        assert not runtime.capped
    assert runtime.cursors == plain.cursors and runtime.deficits == plain.deficits
    assert caps[0] - 2 <= runtime.cursors[0] <= caps[0]
