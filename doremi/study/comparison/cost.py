"""The comparison's two views of cost, as pure functions (docs/design.md section 4f).

- **Equal main-run tokens**: an arm's main run against the baseline's main run of the same
  tokens (the study's table).
- **Equal total compute**: the baseline given the arm's search compute as extra main-run
  tokens. Its compute multiple is (plain main run + the arm's search) / plain main run, where
  the search is every FLOP the arm spent to choose its mixture: its search stages (a reference,
  a proxy, a sweep with its evaluations) and, for a method run on the main model, what its main
  run spent beyond a plain one (a target batch, validation passes). The baseline's loss at that
  multiple comes from its runs at a few measured multiples of one seed (protocol.py
  `EqualCompute`), interpolated per domain in log-log (a power law between each two measured
  points), extrapolated beyond the largest from its last two points, and flagged either way.

FLOPs come from the ledger after the runs (doremi/reports/ledger.py `study_run_cost`,
`train_flops_total`) or from the formulas before them (doremi/study/comparison/plan.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

EQUAL_TOKENS, EQUAL_COMPUTE = "equal main-run tokens", "equal total compute"
VIEWS = (EQUAL_TOKENS, EQUAL_COMPUTE)

#: How a baseline's loss at a multiple was obtained.
MEASURED, INTERPOLATED, EXTRAPOLATED = "measured", "interpolated", "extrapolated"

_SAME = 1e-9  # relative: a multiple this close to a measured one is that run


class CostError(ValueError):
    """Inputs a cost view cannot be computed from: one line."""


@dataclass(frozen=True)
class Point:
    """One baseline run of one seed: its compute as a multiple of a plain main run's, and its
    per-domain final test losses."""

    multiple: float
    losses: tuple[float, ...]


@dataclass(frozen=True)
class BaselineAt:
    """A baseline's per-domain losses at `multiple`, `how` they were obtained, and whether the
    multiple is beyond the corpus (no run of that length is within the 2-epoch rule)."""

    multiple: float
    losses: tuple[float, ...]
    how: str
    beyond_corpus: bool = False

    @property
    def endpoint(self) -> float:
        """The mean over domains (the study's endpoint)."""
        return sum(self.losses) / len(self.losses)

    def flag(self) -> str:
        """`` for a measured or interpolated point, else what the reader must know."""
        notes = [f"{self.how} beyond the largest measured multiple"] if self.how == EXTRAPOLATED else []
        return "; ".join(notes + (["beyond the corpus's 2-epoch capacity"] if self.beyond_corpus else []))


def search_flops(search_stages: Sequence[float], main: float, plain_main: float) -> float:
    """FLOPs an arm spent to choose its mixture: its search stages plus its main run beyond a
    plain one (an online method's target batches and validation passes)."""
    extra = main - plain_main
    if extra < -_SAME * plain_main:
        raise CostError(f"main run: {main:.6g} FLOPs, fewer than a plain main run's {plain_main:.6g}")
    return float(sum(search_stages)) + max(extra, 0.0)


def compute_multiple(search: float, plain_main: float) -> float:
    """The arm's total compute as a multiple of a plain main run: 1 + search / plain main."""
    if not plain_main > 0 or search < 0:
        raise CostError(f"compute: expected plain main > 0 and search >= 0, got {plain_main!r}, {search!r}")
    return 1.0 + search / plain_main


def _log_interp(a: Point, b: Point, m: float) -> tuple[float, ...]:
    """Per domain, the power law through a and b evaluated at m: log L linear in log multiple."""
    x = (math.log(m) - math.log(a.multiple)) / (math.log(b.multiple) - math.log(a.multiple))
    return tuple(math.exp(math.log(la) + x * (math.log(lb) - math.log(la))) for la, lb in zip(a.losses, b.losses))


def baseline_at(points: Sequence[Point], multiple: float, capacity: float = math.inf) -> BaselineAt:
    """The baseline's losses at `multiple` from its measured `points` (one seed): a measured
    point's own, else interpolated between the two measured points around it, else (beyond the
    largest) extrapolated from the largest two. Below the smallest measured multiple is an
    error: no arm costs less than the run that is the baseline itself."""
    pts = sorted(points, key=lambda p: p.multiple)
    if not pts or any(not p.multiple > 0 or not p.losses or min(p.losses) <= 0 for p in pts):
        raise CostError("baseline: expected points with a multiple > 0 and positive losses")
    if len({len(p.losses) for p in pts}) != 1:
        raise CostError("baseline: points with different numbers of domains")
    if len({p.multiple for p in pts}) != len(pts):
        raise CostError(f"baseline: a multiple measured twice ({[p.multiple for p in pts]})")
    how, beyond = classify(multiple, [p.multiple for p in pts], capacity)
    if how == MEASURED:
        p = next(p for p in pts if abs(multiple - p.multiple) <= _SAME * p.multiple)
        return BaselineAt(p.multiple, p.losses, MEASURED, beyond)
    if how == EXTRAPOLATED:
        if len(pts) < 2:
            raise CostError(f"multiple {multiple:g}: beyond the only measured one ({pts[0].multiple:g})")
        return BaselineAt(multiple, _log_interp(pts[-2], pts[-1], multiple), EXTRAPOLATED, beyond)
    hi = next(i for i, p in enumerate(pts) if p.multiple > multiple)
    return BaselineAt(multiple, _log_interp(pts[hi - 1], pts[hi], multiple), INTERPOLATED, beyond)


def classify(multiple: float, measured: Sequence[float], capacity: float = math.inf) -> tuple[str, bool]:
    """How a baseline at `multiple` is obtained from runs at the `measured` multiples
    (MEASURED, INTERPOLATED or EXTRAPOLATED) and whether it is beyond the corpus's `capacity`;
    below the smallest measured multiple is an error (no arm costs less than the baseline's
    own run)."""
    ms = sorted(measured)
    beyond = multiple > capacity * (1 + _SAME)
    if any(abs(multiple - m) <= _SAME * m for m in ms):
        return MEASURED, beyond
    if not ms or multiple < ms[0]:
        raise CostError(f"multiple {multiple:g}: below the smallest measured ({ms[0] if ms else 'none'})")
    return (EXTRAPOLATED if multiple > ms[-1] else INTERPOLATED), beyond


def cost_views(
    search: float, plain_main: float, points: Sequence[Point], capacity: float = math.inf
) -> dict[str, BaselineAt]:
    """One arm, one seed, one baseline: the baseline under each view (`VIEWS`): at the arm's
    main-run tokens (multiple 1, measured), and at the arm's total compute."""
    return {
        EQUAL_TOKENS: baseline_at(points, 1.0, capacity),
        EQUAL_COMPUTE: baseline_at(points, compute_multiple(search, plain_main), capacity),
    }


def paired_differences(arm_endpoints: Sequence[float], baselines: Sequence[BaselineAt]) -> list[float]:
    """Per seed, the arm's endpoint minus the baseline's under one view (the rule's d_s)."""
    if len(arm_endpoints) != len(baselines):
        raise CostError(f"pairs: {len(arm_endpoints)} arm endpoints, {len(baselines)} baselines")
    return [a - b.endpoint for a, b in zip(arm_endpoints, baselines)]
