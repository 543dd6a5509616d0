"""Sequences per domain per step, so that the realised mixture follows the weights over time.

Rounding w x B afresh each step draws the same counts at every step under fixed weights: the
realised shares are multiples of 1/B, and a weight below about 1/(2B) is never drawn. Instead
each domain carries its deficit (sequences owed: the sum over steps of B x w_t minus the
sequences drawn) from step to step, and the B sequences of a step are handed out one at a time
as in the chairman assignment problem (Tijdeman 1980, "The chairman assignment problem",
Discrete Math. 32): before each of the B draws every deficit grows by w_i; among the domains
whose deficit is at least delta = 1 / (2k - 2), the draw goes to the one whose deficit would
reach 1 first (smallest (1 - d_i) / w_i; ties: larger deficit, then lower index).

Bounds (tests/test_data_sampler.py checks them): under fixed weights every deficit stays within
1 - 1/(2k - 2) < 1 of zero after every step (Tijdeman's theorem), so each domain's cumulative
count is within one sequence of the sum of B x w_i, and a domain with w > 0 is drawn at least
once in every ceil(2 / (B w)) consecutive steps. Under weights that change every step the
deficits stay within 2 (measured over adversarial schedules; the theorem's online form assumes
the weights persist).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def threshold(k: int) -> float:
    """Tijdeman's eligibility threshold 1 / (2k - 2) (0 for a single domain)."""
    return 1.0 / (2 * k - 2) if k > 1 else 0.0


def apportion(
    deficit: Sequence[float], weights: Sequence[float], total: int, room: Sequence[float] | None = None
) -> tuple[list[int], list[float]]:
    """(counts summing to `total`, deficits after the step) for one step with `weights`
    (non-negative, summing to 1) and the deficits carried in (summing to 0).

    `room`: at most room[i] sequences of domain i this step (the sampler's epoch caps; None: no
    limit, and their sum must reach `total`). A domain at its room is passed over, so each slot
    it would have taken goes by the same rule to the domains still open, whose deficits grow with
    their weights: the freed share is handed out in proportion to the weights; the passed-over
    domain keeps what it is owed in its deficit. Where no open domain is eligible the slot goes
    to the open domain owed most. While no room binds the counts are those of no room at all."""
    d = [float(x) for x in deficit]
    w = [float(x) for x in weights]
    k = len(w)
    delta = threshold(k) - 1e-12
    counts = [0] * k
    full = [room is not None and room[i] <= 0 for i in range(k)]
    for _ in range(total):
        best, key = -1, (math.inf, math.inf, 0)
        for i in range(k):
            d[i] += w[i]
        for i in range(k):
            if d[i] < delta or full[i]:
                continue
            cand = ((1.0 - d[i]) / w[i] if w[i] > 0 else math.inf, -d[i], i)
            if best < 0 or cand < key:
                best, key = i, cand
        if best < 0:  # without room: unreachable while the deficits sum to 0 (one is >= 1/k >= delta)
            open_ = [i for i in range(k) if not full[i]]
            if not open_:
                raise ValueError(f"apportion: room {list(room or [])} holds fewer than {total} sequences")
            best = max(open_, key=lambda i: (d[i], -i))
        d[best] -= 1.0
        counts[best] += 1
        full[best] = room is not None and counts[best] >= room[best]
    return counts, d


def interleave(counts: Sequence[int]) -> list[int]:
    """Domain index at each batch position: draw j of domain d at key (2j + 1) / (2 c_d),
    sorted (ties: lower domain index), so that every contiguous slice of the batch holds each
    domain in proportion, up to one sequence. Equal rationals give equal floats: ties are exact."""
    keys = [((2 * j + 1) / (2 * c), d) for d, c in enumerate(counts) for j in range(c)]
    return [d for _, d in sorted(keys)]
