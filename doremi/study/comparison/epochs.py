"""The 2-epoch rule as arithmetic on a plan, before any run: how many epochs of each domain a
mixture reads, what token cap keeps a sweep within the rule, and how far a mixture can be
trained before it breaks it (docs/design.md section 4f; the rule: section 4e's guardrails).

A run draws whole sequences from each domain's pool (its packed train sequences less the
holdout; data/sampling/sampler.py), so epochs are sequences over the pool, and the exact sampler's count
stays within one sequence of the nominal one (data/sampling/mixtures.py `sequence_capped`: the cap keeps
one sequence of slack). A sweep's `sweep.max_epochs` caps weights in tokens instead
(doremi/offline/fit/design.py `epoch_caps`, over the domains' train tokens), and a pool holds
fewer tokens than its domain (each document's tail shorter than a window is dropped): a token
cap of 2 lets a small domain read more than 2 epochs. `sweep_token_cap` is the token cap under
which no domain can.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def epochs_read(weights: Sequence[float] | np.ndarray, pools: Sequence[int], run_sequences: int) -> np.ndarray:
    """Nominal epochs per domain ([..., k]) of a run drawing `run_sequences` sequences on `weights`."""
    return np.asarray(weights, dtype=np.float64) * run_sequences / np.asarray(pools, dtype=np.float64)


def over_the_rule(
    weights: Sequence[Sequence[float]] | np.ndarray,
    domains: Sequence[str],
    pools: Sequence[int],
    run_sequences: int,
    max_epochs: float,
    slack: float = 1.0,
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


def sweep_token_cap(
    tokens: Sequence[int], pools: Sequence[int], seq_len: int, max_epochs: float, slack: float = 1.0
) -> float:
    """The largest `sweep.max_epochs` (a cap in train tokens over the run's token budget, as the
    sweep counts it) under which every domain stays within `max_epochs` epochs of its pool
    counted in sequences with `slack`: w_i <= E n_i / (N seq_len) implies w_i N + slack <=
    max_epochs pool_i when E <= (max_epochs pool_i - slack) seq_len / n_i, for every i. Rounded
    down to 4 decimals (it is written into a config)."""
    n, p = np.asarray(tokens, dtype=np.float64), np.asarray(pools, dtype=np.float64)
    exact = float(np.min((max_epochs * p - slack) * seq_len / n))
    return math.floor(exact * 1e4) / 1e4


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
