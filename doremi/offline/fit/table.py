"""What an offline method's fit reads of a sweep, and what it gives back: the interface between
`doremi fit` (doremi/offline/propose.py, which reads the sweep and writes the proposal) and each
offline method's own fit in its catalog folder (its spec's `fit`), as trainer/run/hooks.py is
between the trainer and the online methods (docs/design.md section 2a).

The table is plain numbers read once from the sweep's files, so that a fit is a function of it
and the config, and a method's folder imports nothing above this room (tests/test_owners.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from doremi.offline.fit.checks import FitError
from doremi.offline.fit.evaluate import HeldOut


@dataclass(frozen=True)
class SweepTable:
    """The sweep as a fit reads it: its directory, the runs' mixtures [n, k] and final per-domain
    losses [n, m], the target's weights [m], the epoch caps [k] (None: none), the held-out folds
    (or why there are none: `skipped`), the token budget of the run the mixture is for, and the
    fit's seed. What only some fits read is filled when their spec asks for it (None otherwise):
    `prior`, the config's `sweep.prior` checked to be the sweep's (`fit_reads_prior`);
    `main_params`, `proxy_params`, `proxy_tokens`, `tokens_per_step`, the main run's and the
    sweep runs' sizes and tokens (`fit_reads_main_size`); `curves()`, the losses along each run
    (steps [p], losses [n, p, m], from `losses.csv`), read when called."""

    root: Path
    weights: np.ndarray
    per_domain: np.ndarray
    target: np.ndarray
    caps: Any
    folds: int
    skipped: str | None
    budget: int
    seed: int
    prior: np.ndarray | None = None
    main_params: float | None = None
    proxy_params: float | None = None
    proxy_tokens: int | None = None
    tokens_per_step: int | None = None
    curves: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None


@dataclass(frozen=True)
class FitResult:
    """A fit's proposal: its weights [k], the loss it predicts for them (None: not predicted),
    its held-out check (None, with `skipped` saying why, when the folds leave too few runs),
    `provenance`, the method's options the weights JSON records by their common names
    (`doremi/offline/provenance.py` `proposal_provenance`: `regressor`, `prior`, `top_k`,
    `n_simulations`), and `record`, the method's own entries added to the JSON (under keys of its
    choosing, none of the common ones)."""

    weights: np.ndarray
    predicted: float | None
    held: HeldOut | None
    skipped: str | None
    provenance: Mapping[str, Any] = field(default_factory=dict)
    record: Mapping[str, Any] = field(default_factory=dict)


def checked(evaluate: Callable[[], HeldOut]) -> tuple[HeldOut | None, str | None]:
    """(the held-out evaluation, None), or (None, why not) when the folds leave too few runs to
    fit: the proposal is still made from all runs, and says it was not checked."""
    try:
        return evaluate(), None
    except FitError as e:
        return None, str(e)
