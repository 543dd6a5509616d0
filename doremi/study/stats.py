"""The statistics of a paired study, as pure functions of arrays (docs/design.md section 4e).

A study's unit is the seed: each seed trains every arm from the same initialisation on the same
per-domain data streams, so an arm's effect is measured by the per-seed *paired differences*
arm - baseline of the endpoint. Everything here is a textbook method, named in its docstring;
the t and chi-square quantiles are scipy's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats as _st

Verdict = Literal["works", "worse", "inconclusive"]
Equivalence = Literal["equivalent", "not shown"]


def t_quantile(q: float, df: int) -> float:
    """The q quantile of Student's t with `df` degrees of freedom (t_{q,df} in the tables)."""
    if df < 1:
        raise ValueError(f"t_quantile: expected at least 1 degree of freedom, got {df}")
    return float(_st.t.ppf(q, df))


def _as_array(xs: Sequence[float], what: str, at_least: int = 2) -> np.ndarray:
    a = np.asarray(xs, dtype=np.float64).ravel()
    if a.size < at_least:
        raise ValueError(f"{what}: expected at least {at_least} values, got {a.size}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what}: expected finite values, got {a.tolist()}")
    return a


@dataclass(frozen=True)
class PairedTest:
    """The paired t analysis of per-seed differences arm - baseline (negative: the arm's loss
    is lower). `ci` is the two-sided t-based interval at `level`; `threshold` is
    t_{1-alpha,n-1} x SE, the one-sided critical value the verdict compares the mean with."""

    n: int
    mean: float
    sd: float
    se: float
    ci: tuple[float, float]
    level: float
    alpha: float
    threshold: float
    t: float
    p_lower: float  # one-sided p-value of H0 "mean >= 0" (small: the arm is better)
    p_upper: float  # one-sided p-value of H0 "mean <= 0" (small: the arm is worse)
    verdict: Verdict

    @property
    def p(self) -> float:
        """The one-sided p-value in the direction of the mean, the one the verdict reads
        ("works" iff p_lower < alpha, "worse" iff p_upper < alpha): the p-value Holm's
        adjustment over the arms takes."""
        return self.p_lower if self.mean < 0 else self.p_upper


def paired_test(diffs: Sequence[float], alpha: float = 0.05, level: float = 0.95) -> PairedTest:
    """Paired t-test (Student 1908) of the differences d_s = arm - baseline over n seeds:
    mean, SE = sd / sqrt(n) (sd with n - 1), the `level` interval mean -+ t_{(1+level)/2,n-1} SE,
    and the pre-registered one-sided verdict: "works" if mean < -t_{1-alpha,n-1} SE, "worse" if
    mean > +t_{1-alpha,n-1} SE, else "inconclusive" (../shared/study-design.md, "Seeds and rule").
    A zero spread (identical differences) gives SE 0: any non-zero mean is then decided."""
    d = _as_array(diffs, "paired differences")
    n = d.size
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    se = sd / math.sqrt(n)
    half = t_quantile((1 + level) / 2, n - 1) * se
    threshold = t_quantile(1 - alpha, n - 1) * se
    if se > 0:
        t = mean / se
        p_lower, p_upper = float(_st.t.cdf(t, n - 1)), float(_st.t.sf(t, n - 1))
    else:
        t = math.copysign(math.inf, mean) if mean else 0.0
        p_lower = 0.0 if mean < 0 else 1.0
        p_upper = 0.0 if mean > 0 else 1.0
    verdict: Verdict = "works" if mean < -threshold else "worse" if mean > threshold else "inconclusive"
    if se == 0 and mean == 0:
        verdict = "inconclusive"
    return PairedTest(
        n, mean, sd, se, (mean - half, mean + half), level, alpha, threshold, t, p_lower, p_upper, verdict
    )


@dataclass(frozen=True)
class Holm:
    """Holm's step-down adjustment of m p-values (in their input order): `adjusted` p-values and
    whether each hypothesis is rejected at `alpha` over the family."""

    alpha: float
    adjusted: tuple[float, ...]
    rejected: tuple[bool, ...]


def holm(p_values: Sequence[float], alpha: float = 0.05) -> Holm:
    """Holm-Bonferroni step-down (Holm 1979, "A simple sequentially rejective multiple test
    procedure"): with p_(1) <= ... <= p_(m), the adjusted p_(i) is max_{j <= i} min(1, (m - j + 1)
    p_(j)), and H_(i) is rejected when its adjusted p-value is below `alpha` (strictly, as the
    rule's verdict reads p < alpha). It controls the family-wise error rate at alpha under any
    dependence between the tests (here: the arms share the baseline's runs)."""
    if not 0 < alpha < 1:
        raise ValueError(f"holm: expected 0 < alpha < 1, got {alpha}")
    p = np.asarray(p_values, dtype=np.float64).ravel()
    if p.size and not np.all((p >= 0) & (p <= 1)):
        raise ValueError(f"holm: expected p-values in [0, 1], got {p.tolist()}")
    m = p.size
    order = np.argsort(p, kind="stable")
    steps = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(steps) if m else steps
    return Holm(alpha, tuple(float(a) for a in adjusted), tuple(bool(a < alpha) for a in adjusted))


@dataclass(frozen=True)
class Tost:
    """Two one-sided tests against +-margin: p_low for H0 "mean <= -margin", p_high for H0
    "mean >= +margin"; "equivalent" when both are below alpha (equivalently, the 1 - 2 alpha
    interval lies inside (-margin, margin))."""

    margin: float
    alpha: float
    p_low: float
    p_high: float
    decision: Equivalence

    @property
    def p(self) -> float:
        return max(self.p_low, self.p_high)


def tost(diffs: Sequence[float], margin: float, alpha: float = 0.05) -> Tost:
    """TOST for paired differences (Schuirmann 1987): t_low = (mean + margin) / SE with p_low =
    P(T_{n-1} > t_low), t_high = (mean - margin) / SE with p_high = P(T_{n-1} < t_high); the
    difference is shown to be within +-margin ("no practically relevant difference", a positive
    result) when max(p_low, p_high) < alpha."""
    if not margin > 0:
        raise ValueError(f"tost: expected a margin > 0, got {margin}")
    d = _as_array(diffs, "paired differences")
    n = d.size
    mean, se = float(d.mean()), float(d.std(ddof=1)) / math.sqrt(n)
    if se > 0:
        p_low = float(_st.t.sf((mean + margin) / se, n - 1))
        p_high = float(_st.t.cdf((mean - margin) / se, n - 1))
    else:
        p_low = 0.0 if mean > -margin else 1.0
        p_high = 0.0 if mean < margin else 1.0
    decision: Equivalence = "equivalent" if max(p_low, p_high) < alpha else "not shown"
    return Tost(margin, alpha, p_low, p_high, decision)


def cluster_se(values: Sequence[float], clusters: Sequence[object]) -> float:
    """Cluster-robust standard error of the mean of `values` (Liang & Zeger 1986; the CR1
    small-sample factor G/(G-1) of Cameron & Miller 2015, section VI.B, with one regressor):
    V = G/(G-1) x sum_g (sum_{i in g} (x_i - mean))^2 / N^2. Sequences of one document are not
    independent draws, so the document, not the sequence, is the unit of the test sample.
    With one value per cluster this is the ordinary sd / sqrt(N)."""
    x = _as_array(values, "per-sequence values")
    ids = np.asarray(list(clusters), dtype=object)
    if ids.size != x.size:
        raise ValueError(f"cluster_se: {x.size} values but {ids.size} cluster ids")
    return math.sqrt(_cluster_var(x - x.mean(), ids))


def _cluster_var(resid: np.ndarray, ids: np.ndarray) -> float:
    _, inverse = np.unique(ids.astype(str), return_inverse=True)
    g = int(inverse.max()) + 1
    if g < 2:
        raise ValueError("cluster_se: expected at least 2 clusters, got 1")
    sums = np.bincount(inverse, weights=resid, minlength=g)
    return g / (g - 1) * float((sums**2).sum()) / resid.size**2


def two_way_cluster_se(values: Sequence[float], first: Sequence[object], second: Sequence[object]) -> float:
    """Standard error of the mean clustered two ways (Cameron, Gelbach & Miller 2011):
    V = V_first + V_second - V_intersection, each a one-way CR1 variance (`cluster_se`). For a
    per-domain difference over seeds and test documents: clustered by document (a document that
    favours one mixture does so on every seed) and by seed (a seed's run is one draw of
    training noise). When the difference of estimates is negative (possible in small samples),
    the larger one-way variance is used, as the authors suggest."""
    x = _as_array(values, "per-sequence values")
    a = np.asarray(list(first), dtype=object).astype(str)
    b = np.asarray(list(second), dtype=object).astype(str)
    if not a.size == b.size == x.size:
        raise ValueError(f"two_way_cluster_se: {x.size} values, {a.size} and {b.size} cluster ids")
    r = x - x.mean()
    va, vb = _cluster_var(r, a), _cluster_var(r, b)
    cells = np.char.add(np.char.add(a, "\x1f"), b)
    v = va + vb - _cluster_var(r, cells) if np.unique(cells).size > 1 else va + vb
    return math.sqrt(v if v > 0 else max(va, vb))


def detectable_effect(sigma_d: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable effect of a one-sided paired t-test of n pairs (the noncentral-t
    approximation of Cohen 1988, ch. 2): (t_{1-alpha,n-1} + t_{power,n-1}) x sigma_D / sqrt(n)."""
    if n < 2:
        raise ValueError(f"detectable_effect: expected at least 2 pairs, got {n}")
    return (t_quantile(1 - alpha, n - 1) + t_quantile(power, n - 1)) * sigma_d / math.sqrt(n)


def pairs_needed(
    sigma_d: float, delta: float, alpha: float = 0.05, power: float = 0.8, n_max: int = 100_000
) -> int | None:
    """The smallest n >= 2 whose `detectable_effect` is at most `delta` (iterating n, since the
    t quantiles depend on n); None when even n_max pairs do not reach it."""
    if not delta > 0 or not sigma_d >= 0:
        raise ValueError(f"pairs_needed: expected delta > 0 and sigma_D >= 0, got {delta}, {sigma_d}")
    for n in range(2, n_max + 1):
        if detectable_effect(sigma_d, n, alpha, power) <= delta:
            return n
    return None


def pairs_for_se(sigma_d: float, max_se: float) -> int:
    """The fewest pairs (at least 2) whose paired-difference SE, sigma_D / sqrt(n), is at most
    `max_se`: ceil((sigma_D / max_se)^2). Read with the spread a finished study realised, it says
    how many pairs its own arms would have needed (the calibration's fixed-weight pairs do not see
    the spread a method's per-seed search adds)."""
    if not max_se > 0 or not sigma_d >= 0:
        raise ValueError(f"pairs_for_se: expected max_se > 0 and sigma_D >= 0, got {max_se}, {sigma_d}")
    n = math.ceil((sigma_d / max_se) ** 2)
    if n > 1 and sigma_d / math.sqrt(n - 1) <= max_se:  # the square rounded up past a whole number
        n -= 1
    return max(2, n)


def equivalence_pairs_needed(
    sigma_d: float, margin: float, alpha: float = 0.05, power: float = 0.8, n_max: int = 100_000
) -> int | None:
    """Pairs for TOST to show equivalence with probability `power` when the true difference is 0
    (Chow, Shao & Wang 2008, section 3.2.3 approximation): the smallest n with
    (t_{1-alpha,n-1} + t_{(1+power)/2,n-1}) x sigma_D / sqrt(n) <= margin."""
    if not margin > 0:
        raise ValueError(f"equivalence_pairs_needed: expected a margin > 0, got {margin}")
    for n in range(2, n_max + 1):
        q = t_quantile(1 - alpha, n - 1) + t_quantile((1 + power) / 2, n - 1)
        if q * sigma_d / math.sqrt(n) <= margin:
            return n
    return None


def sigma_run(endpoints: dict[str, Sequence[float]]) -> float:
    """Run-to-run spread of the endpoint within an arm, pooled over arms: the square root of
    sum_arms sum_seeds (x - arm mean)^2 / sum_arms (n_arm - 1) (the pooled variance of a one-way
    layout). Arms with one run add nothing."""
    ss, df = 0.0, 0
    for arm, xs in endpoints.items():
        x = _as_array(xs, f"sigma_run: arm {arm}", at_least=1)
        ss += float(((x - x.mean()) ** 2).sum())
        df += x.size - 1
    if df == 0:
        raise ValueError("sigma_run: expected an arm with at least 2 runs")
    return math.sqrt(ss / df)


def sigma_d(diffs: Sequence[float]) -> float:
    """Spread of the pair differences: their sample standard deviation (n - 1)."""
    return float(_as_array(diffs, "paired differences").std(ddof=1))


def sd_upper_bound(sd: float, n: int, level: float = 0.8) -> float:
    """One-sided upper confidence bound of a standard deviation from n values (the chi-square
    interval for a normal variance): sd x sqrt((n-1) / chi2_{1-level,n-1}). From 4 pairs, sigma_D
    is uncertain by a factor of about 1.5 at 80%; the calibration reports it."""
    if n < 2:
        raise ValueError(f"sd_upper_bound: expected at least 2 values, got {n}")
    return sd * math.sqrt((n - 1) / float(_st.chi2.ppf(1 - level, n - 1)))


def pairing_correlation(sigma_run_: float, sigma_d_: float) -> float | None:
    """The correlation of paired arms implied by sigma_D^2 = 2 sigma_run^2 (1 - rho): positive
    when pairing removes noise, negative when it adds some (the first study's -0.86)."""
    if sigma_run_ <= 0:
        return None
    return 1 - sigma_d_**2 / (2 * sigma_run_**2)
