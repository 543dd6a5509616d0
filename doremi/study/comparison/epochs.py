"""The 2-epoch rule as arithmetic on a plan, before any run: how many epochs of each domain a
mixture reads, whether a mixture breaks the rule, and how far a mixture can be trained before it
does (docs/design.md section 4f; the rule: section 4e's guardrails).

A run draws whole sequences from each domain's pool (its packed train sequences less the
holdout; data/sampling/pools.py `pool_sizes`), so epochs are sequences over the pool, and the
exact sampler's count stays within one sequence of the nominal one (data/sampling/mixtures.py
`sequence_capped`: the cap keeps one sequence of slack). A sweep caps its design in the same unit
(doremi/offline/sweep.py `sequence_caps`), so `sweep.max_epochs` is the rule's own number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from data.sampling.mixtures import SEQUENCE_SLACK


def epochs_read(weights: Sequence[float] | np.ndarray, pools: Sequence[int], run_sequences: int) -> np.ndarray:
    """Nominal epochs per domain ([..., k]) of a run drawing `run_sequences` sequences on `weights`."""
    return np.asarray(weights, dtype=np.float64) * run_sequences / np.asarray(pools, dtype=np.float64)


def over_the_rule(
    weights: Sequence[Sequence[float]] | np.ndarray,
    domains: Sequence[str],
    pools: Sequence[int],
    run_sequences: int,
    max_epochs: float,
    slack: float = SEQUENCE_SLACK,
) -> list[str]:
    """`row r: <domain> <epochs>` for each mixture (rows of `weights`) and domain whose draw,
    `slack` sequences past the nominal count, would read more than `max_epochs` epochs."""
    w = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    p = np.asarray(pools, dtype=np.float64)
    worst = (w * run_sequences + slack) / p
    return [
        f"row {r}: {domains[i]} {worst[r, i]:.4f} epochs"
        for r, i in zip(*np.nonzero(worst > max_epochs * (1 + 1e-12)))
        if w[r, i] > 0
    ]


def capacity_multiple(
    weights: Sequence[float] | np.ndarray, pools: Sequence[int], run_sequences: int, max_epochs: float
) -> float:
    """How many times `run_sequences` a run on `weights` can draw before some domain passes
    `max_epochs` epochs (inf when no domain has weight)."""
    e = epochs_read(weights, pools, run_sequences)
    return float(max_epochs / e.max()) if e.max() > 0 else math.inf


def corpus_multiple(pools: Sequence[int], run_sequences: int, max_epochs: float) -> float:
    """How many times `run_sequences` any mixture can draw within `max_epochs` epochs of every
    domain: beyond it no run is within the rule (data/sampling/mixtures.py `epoch_capped` refuses)."""
    return float(max_epochs * sum(pools) / run_sequences)
