"""The comparison's secondary reading: Holm's adjustment over the arms (protocol.py
`Protocol.multiplicity`; experiments/notes/COMPARISON.md "Multiplicity"; docs/design.md 4f).

Fourteen arms against one baseline at the rule's one-sided alpha call about one arm in twenty
with no effect. The rule's verdict stays the primary one (the study's); beside it, each table
gives the verdict of the same one-sided paired t-tests with the family-wise error held at alpha
by Holm's step-down (doremi/study/stats.py `holm`). The family is fixed before the runs: the
protocol's primary arms in that table (`Protocol.holm_family`: 14 against uniform at equal
tokens, one row per method and form; the study's per-seed doremi, underpowered by design at
sigma_D 0.0507, is reported outside it). An arm withheld
(short of pairs) or voided by a guardrail (guards.py) stays in it with p = 1, so that losing an
arm never makes the others' threshold easier than the pre-registered 0.05/14.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from doremi.study import stats
from doremi.study.verdict import ArmResult


@dataclass(frozen=True)
class HolmReading:
    """One arm's Holm-adjusted one-sided p-value, the verdict it gives at the rule's alpha, and
    the size of the family it was adjusted over."""

    p_adjusted: float
    verdict: str
    family: int

    def cell(self) -> str:
        return f"{self.verdict} (p {self.p_adjusted:.3f}, {self.family} arms)"


def holm_readings(results: Sequence[ArmResult], alpha: float, family: int) -> dict[str, HolmReading]:
    """Per arm with a verdict (paired, not void), Holm over the `family` arms the table judges:
    these arms' one-sided p-values of the rule's paired t-test (`PairedTest.p`, the direction of
    its mean) and p = 1 for the others. "works" or "worse" when rejected, else "inconclusive"."""
    judged = [(r.arm, r.paired) for r in results if r.paired is not None and not r.void]
    if family < len(judged):
        raise ValueError(f"holm: a family of {family} arms cannot hold the {len(judged)} judged")
    h = stats.holm([paired.p for _, paired in judged] + [1.0] * (family - len(judged)), alpha)
    out = {}
    for (arm, paired), p, ok in zip(judged, h.adjusted, h.rejected):
        verdict = ("works" if paired.mean < 0 else "worse") if ok else "inconclusive"
        out[arm] = HolmReading(p, verdict, family)
    return out


def holm_cells(
    results: Sequence[ArmResult], readings: Mapping[str, HolmReading], secondary: Collection[str] = ()
) -> list[list[str]]:
    """The "Holm" column of a table: the reading, `void` for a voided arm, "outside the family"
    for a secondary arm (protocol.py `Arm.secondary`), empty for the baseline."""
    return [
        [
            readings[r.arm].cell()
            if r.arm in readings
            else "void"
            if r.void
            else "outside the family (secondary)"
            if r.arm in secondary
            else ""
        ]
        for r in results
    ]
