"""The study's table and verdict: each arm against the baseline, paired by seed, by the rule of
doremi/study/design.py (issue 34; docs/design.md section 4e).

Per arm: the mean endpoint over seeds and its SE; the paired difference with its t interval,
the one-sided verdict and TOST (doremi/study/stats.py); the worst-case difference (the paper's
max over domains) and the domain the arm loses most on; the domains better, with standard
errors clustered by document where per-sequence losses were logged (two-way, by document and by
seed), else the per-seed spread; the arm's compute per seed from the ledger (its search stages
and its main run); and a flag when the SE of the primary difference is above the rule's
`max_se`. Functions here take runs already read; `doremi study summarize` (doremi/study/summarize.py)
reads them and writes the files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from doremi.study import stats
from doremi.study.design import Design
from doremi.study.runs import Pairs

#: Per domain: (per-sequence mean losses, per-sequence document ids) of one run.
SequenceLosses = Mapping[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class DomainDiff:
    """An arm minus the baseline on one domain, mean over seeds, and its SE (`se_kind`:
    `clustered` by document and seed, or `per-seed`; None with one seed and no sequences)."""

    domain: str
    mean: float
    se: float | None
    se_kind: str


@dataclass(frozen=True)
class ArmResult:
    arm: str
    seeds: tuple[int, ...]
    mean_loss: float
    mean_loss_se: float | None
    paired: stats.PairedTest | None
    tost: stats.Tost | None
    worst_case: tuple[float, float | None] | None  # mean and SE of max_i arm - max_i baseline
    domains: tuple[DomainDiff, ...] = ()
    se_ok: bool | None = None
    compute: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    #: The guardrail findings that void this arm (the comparison's `guardrail_scope`: an arm,
    #: not the whole study); None when it stands.
    void: str | None = None
    #: The per-seed differences arm - baseline, in `seeds` order (what sigma_D is the spread of).
    diffs: tuple[float, ...] = ()

    @property
    def verdict(self) -> str:
        """The table's verdict: the rule's, or that a guardrail voids it ("baseline" unpaired)."""
        if self.paired is None:
            return "baseline"
        return f"void (guardrail: {self.void})" if self.void else self.paired.verdict

    @property
    def worst_domain(self) -> DomainDiff | None:
        """The domain with the largest (least favourable) mean difference."""
        return max(self.domains, key=lambda d: d.mean) if self.domains else None

    @property
    def better(self) -> int:
        return sum(d.mean < 0 for d in self.domains)

    def beyond(self, sign: int, multiple: float = 2.0) -> int:
        """Domains whose difference is beyond `multiple` SEs below (sign -1) or above (+1) 0."""
        return sum(d.se is not None and sign * d.mean > multiple * d.se for d in self.domains)


def domain_diff(
    domain: str,
    per_seed: Sequence[float],
    sequences: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
) -> DomainDiff:
    """A domain's mean difference over seeds (of the logged per-domain losses) and its SE: from
    the per-sequence paired differences of each seed (`sequences`: per seed, the differences
    and their document ids), clustered by document and, over several seeds, by seed too
    (stats.two_way_cluster_se); else the per-seed spread sd / sqrt(n). Each sequence's mean
    loss weighs equally in the SE (all but a domain's last sequence are full length), while
    the mean is the token-weighted logged loss."""
    mean = float(np.mean(per_seed))
    if sequences:
        values = np.concatenate([v for v, _ in sequences])
        docs = np.concatenate([d for _, d in sequences])
        if len(sequences) > 1:
            seeds = np.concatenate([np.full(len(v), i) for i, (v, _) in enumerate(sequences)])
            return DomainDiff(domain, mean, stats.two_way_cluster_se(values, docs, seeds), "clustered")
        return DomainDiff(domain, mean, stats.cluster_se(values, docs), "clustered")
    se = float(np.std(per_seed, ddof=1) / math.sqrt(len(per_seed))) if len(per_seed) > 1 else None
    return DomainDiff(domain, mean, se, "per-seed")


def paired_sequences(
    a: SequenceLosses | None, b: SequenceLosses | None, domain: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-sequence differences a - b on one domain and their document ids, when both runs
    logged the same sequences (same count and documents); None otherwise."""
    if a is None or b is None or domain not in a or domain not in b:
        return None
    (la, da), (lb, db) = a[domain], b[domain]
    if len(la) != len(lb) or not np.array_equal(da, db):
        return None
    return np.asarray(la, dtype=np.float64) - np.asarray(lb, dtype=np.float64), np.asarray(da)


def arm_result(
    pairs: Pairs,
    design: Design,
    sequences: Mapping[tuple[str, int], SequenceLosses] | None = None,
    compute: Mapping[str, Any] | None = None,
) -> ArmResult:
    """The row of one arm against the baseline (`pairs`, paired by seed)."""
    rule = design.rule
    runs, bases = pairs.runs, pairs.bases
    endpoints = [r.endpoint for r in runs]
    mean_loss, mean_loss_se = _mean_se(endpoints)
    diffs = pairs.diffs
    paired = stats.paired_test(diffs, rule.alpha, rule.ci_level) if len(diffs) > 1 else None
    tost = stats.tost(diffs, rule.margin, rule.alpha) if len(diffs) > 1 else None
    worst = [max(a.final) - max(b.final) for a, b in zip(runs, bases)]
    notes = list(pairs.notes)
    domains = []
    for i, d in enumerate(runs[0].domains):
        per_seed = [a.final[i] - b.final[i] for a, b in zip(runs, bases)]
        seqs = None
        if sequences is not None:
            got = [
                paired_sequences(sequences.get((a.arm, a.seed)), sequences.get((b.arm, b.seed)), d)
                for a, b in zip(runs, bases)
            ]
            seqs = [g for g in got if g is not None] if all(g is not None for g in got) else None
        domains.append(domain_diff(d, per_seed, seqs))
    if paired is None:
        notes.append(f"{pairs.arm}: one pair; no standard error, no verdict")
    return ArmResult(
        arm=pairs.arm,
        seeds=pairs.seeds,
        mean_loss=mean_loss,
        mean_loss_se=mean_loss_se,
        paired=paired,
        tost=tost,
        worst_case=_mean_se(worst),
        domains=tuple(domains),
        se_ok=None if paired is None else paired.se <= rule.max_se,
        compute=dict(compute or {}),
        notes=tuple(notes),
        diffs=tuple(diffs),
    )


def baseline_result(bases: Sequence[Any], compute: Mapping[str, Any] | None = None) -> ArmResult:
    """The baseline's own row: its mean endpoint and SE, its compute."""
    m, se = _mean_se([r.endpoint for r in bases])
    return ArmResult(bases[0].arm, tuple(r.seed for r in bases), m, se, None, None, None, compute=dict(compute or {}))


def _mean_se(xs: Sequence[float]) -> tuple[float, float | None]:
    m = float(np.mean(xs))
    return m, (float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None)


def verdict_line(r: ArmResult, design: Design) -> str:
    """One line: the verdict, the mean difference with its interval, TOST, and the SE flag."""
    if r.paired is None:
        return f"{r.arm}: no verdict ({len(r.seeds)} pair)"
    p, t, rule = r.paired, r.tost, design.rule
    flag = ""
    if not r.se_ok:
        need = stats.pairs_for_se(p.sd, rule.max_se)
        detect = stats.pairs_needed(p.sd, rule.mde, rule.alpha, rule.power)
        flag = (
            f"; SE {p.se:.4f} > {rule.max_se:g}: the study is under-powered (the pairs' own spread, "
            f"sigma_D {p.sd:.4f}, asks for {need} pairs for SE <= {rule.max_se:g} and "
            f"{detect if detect is not None else 'more than 100000'} to detect {rule.mde:g} nats)"
        )
    return (
        f"{r.arm} vs {rule.baseline}: {r.verdict} ({p.mean:+.4f} nats, {rule.ci_level:.0%} CI "
        f"[{p.ci[0]:+.4f}, {p.ci[1]:+.4f}], {p.n} pairs); TOST +-{rule.margin:g}: {t.decision if t else 'n/a'}{flag}"
    )
