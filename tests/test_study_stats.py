"""doremi/study/stats.py against hand-computed numbers and printed t and chi-square tables."""

from __future__ import annotations

import math

import pytest

from doremi.study import stats


@pytest.mark.parametrize(
    ("q", "df", "table"),
    [(0.95, 5, 2.0150483733), (0.975, 3, 3.1824463053), (0.8, 5, 0.9195437802), (0.95, 3, 2.3533634348)],
)
def test_t_quantiles_match_the_tables(q, df, table):
    assert stats.t_quantile(q, df) == pytest.approx(table, abs=1e-6)


def test_paired_test_by_hand():
    # mean -0.025; deviations -+0.005, -+0.015: sd = sqrt(0.0005 / 3); SE = sd / 2.
    p = stats.paired_test([-0.03, -0.01, -0.02, -0.04])
    sd = math.sqrt(0.0005 / 3)
    assert (p.n, p.mean) == (4, pytest.approx(-0.025, abs=1e-15))
    assert p.sd == pytest.approx(sd, abs=1e-12) and p.se == pytest.approx(sd / 2, abs=1e-12)
    assert p.threshold == pytest.approx(2.3533634348 * sd / 2, abs=1e-9)  # t_{0.95,3} x SE
    assert p.ci == pytest.approx((-0.025 - 3.1824463053 * sd / 2, -0.025 + 3.1824463053 * sd / 2), abs=1e-9)
    assert p.verdict == "works" and p.p_lower == pytest.approx(0.0152331458, abs=1e-6)
    assert p.p_lower + p.p_upper == pytest.approx(1.0)


def test_verdict_compares_with_the_one_sided_quantile():
    # Mean +-0.01 with SE 0.004: t = 2.5 beyond t_{0.95,5} = 2.015 on either side; 0.006 is not.
    base = [-0.004 * x for x in (-2.5, -1.5, -0.5, 0.5, 1.5, 2.5)]
    se = stats.paired_test(base).se
    shift = lambda m: [m + b * 0.004 / se for b in base]  # noqa: E731  (SE scaled to exactly 0.004)
    assert stats.paired_test(shift(-0.01)).se == pytest.approx(0.004)
    assert stats.paired_test(shift(-0.01)).verdict == "works"
    assert stats.paired_test(shift(+0.01)).verdict == "worse"
    assert stats.paired_test(shift(-0.006)).verdict == "inconclusive"  # 1.5 SE < 2.015 SE


def test_tost_is_the_90_percent_interval_inside_the_margin():
    d = [0.001, -0.002, 0.003, 0.0, -0.001, 0.002]  # mean 0.0005, SE 0.00076376
    t = stats.tost(d, 0.01)
    assert t.decision == "equivalent"
    assert t.p_low == pytest.approx(1.8272982e-05, rel=1e-6) and t.p_high == pytest.approx(2.9773701e-05, rel=1e-6)
    # The 90% interval is [-0.00104, 0.00204]: inside +-0.002 fails on the upper side.
    assert stats.tost(d, 0.002).decision == "not shown"
    assert stats.tost(d, 0.0021).decision == "equivalent"
    with pytest.raises(ValueError, match="margin > 0"):
        stats.tost(d, 0.0)


def test_cluster_se_by_hand():
    # Residuals -1.5, -0.5 | 0.5, 1.5: cluster sums -2, 2; G/(G-1) = 2; V = 2 x 8 / 16 = 1.
    assert stats.cluster_se([1, 2, 3, 4], ["a", "a", "b", "b"]) == pytest.approx(1.0, abs=1e-12)
    # One value per cluster: the ordinary sd / sqrt(n).
    assert stats.cluster_se([1, 2, 3, 4], [1, 2, 3, 4]) == pytest.approx(math.sqrt(5 / 3) / 2, abs=1e-12)
    with pytest.raises(ValueError, match="2 clusters"):
        stats.cluster_se([1.0, 2.0], ["a", "a"])


def test_two_way_cluster_se_by_hand():
    # By document: V = 1 (above). By seed: sums -1, 1 -> 2 x 2 / 16 = 0.25. Cells (singletons):
    # 4/3 x 5 / 16. V = 1 + 0.25 - 5/12.
    se = stats.two_way_cluster_se([1, 2, 3, 4], ["a", "a", "b", "b"], [1, 2, 1, 2])
    assert se == pytest.approx(math.sqrt(1 + 0.25 - 5 / 12), abs=1e-12)


def test_power_pairs_by_iteration():
    # sigma_D 0.015 at 6 pairs: (2.015048 + 0.919544) x 0.015 / sqrt(6) = 0.017971 <= 0.02; 5 pairs: 0.0206.
    assert stats.detectable_effect(0.015, 6) == pytest.approx(0.0179706334, abs=1e-9)
    assert stats.detectable_effect(0.015, 5) > 0.02
    assert stats.pairs_needed(0.015, 0.02) == 6
    assert stats.pairs_needed(0.02, 0.02) == 8
    assert stats.pairs_needed(0.025, 0.02) == 12
    assert stats.pairs_needed(1.0, 0.02, n_max=50) is None
    # TOST at +-0.01 needs many more pairs than the 0.02 effect: 21 at sigma_D 0.015.
    assert stats.equivalence_pairs_needed(0.015, 0.01) == 21


def test_pairs_for_a_standard_error():
    # (0.0507 / 0.008)^2 = 40.2 -> 41; exactly (0.024 / 0.008)^2 = 9 (a square that rounds up to
    # 9.000000000000002 must still give 9); never fewer than 2.
    assert stats.pairs_for_se(0.0507, 0.008) == 41
    assert stats.pairs_for_se(0.024, 0.008) == 9 and 0.024 / math.sqrt(9) <= 0.008
    assert stats.pairs_for_se(0.0241, 0.008) == 10
    assert stats.pairs_for_se(0.0, 0.008) == 2
    with pytest.raises(ValueError, match="max_se > 0"):
        stats.pairs_for_se(0.01, 0.0)


def test_sigma_run_pools_within_arm_spread():
    # SS = 2 (1, 2, 3) + 2 (2, 4); df = 2 + 1.
    assert stats.sigma_run({"uniform": [1, 2, 3], "fixed": [2, 4]}) == pytest.approx(math.sqrt(4 / 3), abs=1e-12)
    assert stats.sigma_d([0.01, 0.03]) == pytest.approx(math.sqrt(2) * 0.01, abs=1e-12)
    with pytest.raises(ValueError, match="at least 2 runs"):
        stats.sigma_run({"uniform": [1.0]})


def test_sd_upper_bound_and_pairing_correlation():
    # chi2_{0.2,3} = 1.005174: sqrt(3 / 1.005174) = 1.727587.
    assert stats.sd_upper_bound(1.0, 4, 0.8) == pytest.approx(1.7275873, abs=1e-6)
    assert stats.pairing_correlation(0.02, 0.02) == pytest.approx(0.5)
    assert stats.pairing_correlation(0.0, 0.02) is None


def test_holm_step_down_by_hand():
    # Sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04; running max 0.02,
    # 0.03, 0.06, 0.06. The step-down stops at 0.03 (> 0.05 / 2), so 0.04 < 0.05 is not rejected.
    h = stats.holm([0.01, 0.04, 0.03, 0.005], alpha=0.05)
    assert h.adjusted == pytest.approx((0.03, 0.06, 0.06, 0.02), abs=1e-15)
    assert h.rejected == (True, False, False, True)
    # Capped at 1; ties share their adjusted value; the boundary is strict (2 x 0.025 = 0.05).
    assert stats.holm([0.6, 0.5]).adjusted == (1.0, 1.0)
    assert stats.holm([0.02, 0.02]).rejected == (True, True)
    assert stats.holm([0.025, 0.5]).rejected == (False, False)
    assert stats.holm([]).adjusted == ()
    with pytest.raises(ValueError, match="p-values in"):
        stats.holm([1.5])


def test_paired_test_p_is_the_one_sided_p_of_the_verdicts_direction():
    better, worse = stats.paired_test([-0.03, -0.01, -0.02, -0.04]), stats.paired_test([0.03, 0.01, 0.02, 0.04])
    assert better.p == better.p_lower == pytest.approx(0.0152331458, abs=1e-6)
    assert worse.p == worse.p_upper == pytest.approx(0.0152331458, abs=1e-6)
