"""The static mixtures named by a word: `uniform`, `tokens`, `temperature:T`, `unimax:E`.

A string in one of these forms is a name, never a weights file: `temperature:x` is refused as a
bad form rather than looked up as a path. `tokens`, `temperature` and `unimax` are computed from
the domains' train token counts n_i (the manifest's); `unimax` also needs the run's token budget
(steps x global batch x seq_len), which only the run knows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from data.errors import DataError

#: The words of the named forms, in the order the error message lists them.
WORDS = ("uniform", "tokens", "temperature", "unimax")
#: The forms that take a number after a colon.
PARAMETRIC = ("temperature", "unimax")

EXPECTED = "expected uniform, tokens, temperature:T (T > 0), unimax:E (E > 0), a weights file or values"

_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def is_mixture_name(value: Any) -> bool:
    """Whether a value is meant as a named mixture (well formed or not), not a weights file:
    `uniform`, `tokens`, or a string whose part before the first colon is `temperature` or
    `unimax` (the bare words included, so that a missing number is a form error)."""
    if not isinstance(value, str):
        return False
    return value in ("uniform", "tokens") or value.split(":", 1)[0] in PARAMETRIC


class MixtureNames:
    """`NAMED_MIXTURES`: `value in NAMED_MIXTURES` says whether a value is a name rather than a
    file (`is_mixture_name`); iterating gives the forms' words."""

    def __contains__(self, value: object) -> bool:
        return is_mixture_name(value)

    def __iter__(self) -> Iterator[str]:
        return iter(WORDS)

    def __repr__(self) -> str:
        return "NAMED_MIXTURES(uniform, tokens, temperature:T, unimax:E)"


NAMED_MIXTURES = MixtureNames()


def _number_text(value: float) -> str:
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


@dataclass(frozen=True)
class MixtureSpec:
    """A parsed named mixture: `kind` one of WORDS, `value` T or E (None for uniform, tokens)."""

    kind: str
    value: float | None = None

    @property
    def name(self) -> str:
        """The canonical form: `temperature:2` for `temperature:2.0`."""
        return self.kind if self.value is None else f"{self.kind}:{_number_text(self.value)}"

    @property
    def run_name(self) -> str:
        """A directory name for a main run on this mixture: `uniform`, `temperature2`,
        `temperature1.5`, `unimax4`."""
        return self.kind if self.value is None else f"{self.kind}{_number_text(self.value)}"

    @property
    def needs_budget(self) -> bool:
        return self.kind == "unimax"


def parse_mixture(value: str, where: str) -> MixtureSpec:
    """A named mixture's string -> its spec; any other string (or a bad number) is one DataError
    naming `where`. T and E must be finite numbers > 0, written as plain decimals (`2`, `1.5`, `1e3`)."""
    if value in ("uniform", "tokens"):
        return MixtureSpec(value)
    kind, sep, number = value.partition(":") if isinstance(value, str) else ("", "", "")
    if kind in PARAMETRIC and sep and _NUMBER.fullmatch(number):
        x = float(number)
        if 0 < x < math.inf:
            return MixtureSpec(kind, x)
    raise DataError(f"{where}: {EXPECTED}; got {value!r}")


def _counts(tokens: Sequence[float] | np.ndarray) -> np.ndarray:
    n = np.asarray(tokens, dtype=np.float64)
    if n.ndim != 1 or n.size == 0 or not np.all(np.isfinite(n)) or np.any(n < 0):
        raise DataError(f"token counts: expected finite numbers >= 0, one per domain, got {n.tolist()}")
    if n.sum() <= 0:
        raise DataError("token counts: every domain has 0 train tokens")
    return n


def temperature_weights(tokens: Sequence[float] | np.ndarray, temperature: float) -> np.ndarray:
    """Temperature sampling: w_i = n_i^(1/T) / sum_j n_j^(1/T), n_i the domain's train tokens.

    XLM (Conneau & Lample 2019, "Cross-lingual Language Model Pretraining", sec. 3.1, 3.3: q_i ∝ p_i^α
    with α = 1/T) and mT5 (Xue et al. 2021, "mT5: A Massively Multilingual Pre-trained Text-to-Text
    Transformer", sec. 2: p(L) ∝ |L|^α). T = 1 is the natural (token-proportional) mixture and
    T -> inf tends to uniform over the domains with tokens; a domain with none gets 0. Computed
    as (n_i / max n)^(1/T) so that a small T does not overflow.
    """
    if not 0 < temperature < math.inf:
        raise DataError(f"temperature: expected a finite number > 0, got {temperature!r}")
    n = _counts(tokens)
    w = (n / n.max()) ** (1.0 / temperature)
    return w / w.sum()


def unimax_allocation(tokens: Sequence[float] | np.ndarray, budget: float, max_epochs: float) -> np.ndarray:
    """UniMax's per-domain token allocation U (Chung et al. 2023, "UniMax: Fairer and more
    Effective Language Sampling for Large-Scale Multilingual Pretraining", ICLR 2023, Algorithm 1).

    Domains are visited in increasing n_i (ties keep domain order; equal sizes get equal shares
    either way); with B_rem the budget not yet given and m the domains not yet visited,
    U_i = min(B_rem / m, E * n_i), then B_rem -= U_i. sum(U) = B unless every cap binds
    (B > E * sum(n)), when U = E * n.
    """
    if not 0 < budget < math.inf:
        raise DataError(f"unimax: expected a token budget > 0, got {budget!r}")
    if not 0 < max_epochs < math.inf:
        raise DataError(f"unimax: expected max epochs > 0, got {max_epochs!r}")
    n = _counts(tokens)
    alloc = np.zeros_like(n)
    remaining = float(budget)
    for i, d in enumerate(np.argsort(n, kind="stable")):
        alloc[d] = min(remaining / (len(n) - i), max_epochs * n[d])
        remaining -= alloc[d]
    return alloc


def unimax_weights(tokens: Sequence[float] | np.ndarray, budget: float, max_epochs: float) -> np.ndarray:
    """UniMax sampling weights p = normalize(U) (Chung et al. 2023, ICLR 2023, Algorithm 1;
    U from `unimax_allocation`): as uniform as the budget allows with no domain repeated more
    than E epochs. When B <= E * sum(n) the allocation spends the whole budget and p_i = U_i / B.

    When the budget exceeds every cap (B > E * sum(n)) no mixture keeps all domains within E
    epochs; the paper's normalize(U) is kept, which gives the natural mixture p_i = n_i / sum(n)
    (every domain then repeats B / sum(n) > E epochs: the caps are exceeded evenly), not an error.
    """
    alloc = unimax_allocation(tokens, budget, max_epochs)
    return alloc / alloc.sum()


def epoch_capped(
    weights: Sequence[float] | np.ndarray,
    counts: Sequence[float] | np.ndarray,
    budget: float,
    max_epochs: float,
    slack: float = 0.0,
) -> np.ndarray:
    """`weights` with no domain read more than `max_epochs` epochs of its `counts` over a run
    that reads `budget` of the same unit: w_i <= (E n_i - slack) / B. A domain over its cap is
    set to it and the excess spread over the domains below theirs in proportion to their weights,
    until none is over (at most k rounds; a domain with weight 0 stays 0). The guardrail of the
    2-epoch rule (docs/design.md 4e) as a constraint on a transferred mixture, which no method's
    search knows about; weights already within their caps come back unchanged. A run caps in
    the unit it reads (`sequence_capped`); `slack` is how far its realised count may run past
    the nominal one."""
    if not 0 < budget < math.inf:
        raise DataError(f"max_epochs: expected a budget > 0, got {budget!r}")
    if not 0 < max_epochs < math.inf:
        raise DataError(f"max_epochs: expected a finite value > 0, got {max_epochs!r}")
    given = np.asarray(weights, dtype=np.float64)
    caps = np.maximum(max_epochs * _counts(counts) - slack, 0.0) / budget
    if caps[given > 0].sum() < 1 - 1e-12:
        raise DataError(
            f"max_epochs {max_epochs:g}: the domains this mixture reads hold "
            f"{(caps[given > 0].sum() * budget + slack * (given > 0).sum()) / max_epochs:.4g} units "
            f"(sequences or tokens), too few for {budget:.4g} at {max_epochs:g} epochs each"
        )
    w, capped = given.copy(), np.zeros(len(given), dtype=bool)
    while (over := ~capped & (w > caps * (1 + 1e-12))).any():
        capped |= over
        w[capped] = caps[capped]
        free = ~capped
        w[free] = given[free] * (1 - caps[capped].sum()) / given[free].sum()
    return w


#: Sequences a domain's realised count may run past its nominal one under the exact sampler
#: (data/sampling/apportion.py: within one sequence under fixed weights): the slack every epoch
#: cap counted in sequences keeps, so that the realised epochs never pass the cap.
SEQUENCE_SLACK = 1.0


def sequence_capped(
    weights: Sequence[float] | np.ndarray, pools: Sequence[int], run_sequences: int, max_epochs: float
) -> np.ndarray:
    """`data.max_epochs` as a run realises it: epochs are sequences drawn over the domain's pool
    (its packed train sequences less the holdout, data/sampling/pools.py `pool_sizes`), not
    tokens: a pool's sequences hold fewer tokens than the domain (the holdout, and the stream's
    tail shorter than a window), and a cap counted in tokens let a study's domain read 2.08
    epochs under `max_epochs: 2`. The exact sampler's count stays within one sequence of the
    nominal one, so the cap keeps `SEQUENCE_SLACK`: the realised epochs never pass `max_epochs`."""
    return epoch_capped(weights, pools, run_sequences, max_epochs, slack=SEQUENCE_SLACK)


def named_weights(
    spec: MixtureSpec, tokens: Sequence[float] | np.ndarray, budget_tokens: int | None, where: str
) -> np.ndarray:
    """A named mixture's weights (float64, sum 1) from the domains' train tokens (manifest
    order) and, for `unimax`, the run's token budget; errors name `where`."""
    try:
        if spec.kind == "uniform":
            return np.ones(len(tokens)) / len(tokens)
        if spec.kind == "tokens":
            n = _counts(tokens)
            return n / n.sum()
        if spec.kind == "temperature":
            return temperature_weights(tokens, spec.value)  # type: ignore[arg-type]
        if budget_tokens is None:
            raise DataError(
                f"{spec.name} needs the run's token budget (steps x global batch x seq_len), and none is known here"
            )
        return unimax_weights(tokens, budget_tokens, spec.value)  # type: ignore[arg-type]
    except DataError as e:
        raise DataError(f"{where}: {e}") from None


def resolve_named(
    value: str, tokens: Sequence[float] | np.ndarray, budget_tokens: int | None, where: str
) -> np.ndarray:
    """`parse_mixture` then `named_weights`."""
    return named_weights(parse_mixture(value, where), tokens, budget_tokens, where)
