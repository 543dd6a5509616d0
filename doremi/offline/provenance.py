"""What a proposal's weights JSON records about where its weights come from.

The file itself is `data.sampling.weights_file.write_weights_file`'s format, `{"domains", "weights",
...provenance}`; this module only builds the provenance (plain JSON values) and hands both over.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.sampling.weights_file import write_weights_file
from doremi.methods.registry import OFFLINE, names
from doremi.offline.fit.checks import FitError
from doremi.offline.fit.evaluate import HeldOut


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def proposal_provenance(
    *,
    method: str,
    n_runs: int,
    held_out: HeldOut | None,
    seed: int,
    regressor: str | None = None,
    prior: Sequence[float] | np.ndarray | None = None,
    top_k: int | None = None,
    n_simulations: int | None = None,
    caps: Sequence[float] | np.ndarray | None = None,
    max_epochs: float | None = None,
    target_weights: Sequence[float] | np.ndarray | None = None,
    predicted_loss: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The provenance dict of a proposal: `source` ("fit"), `method`, `regressor`, `n_runs`,
    `held_out` (spearman, mae, folds, n, seed), `prior`, `top_k`, `n_simulations`, `caps`,
    `max_epochs`, `target_weights`, `predicted_loss`, `seed`, and `extra` merged in; None values
    are left out, numpy values become plain JSON ones (nan: null)."""
    offline = names(OFFLINE)  # the catalog's offline methods when called (a test may extend it)
    if method not in offline:
        raise FitError(f"method: expected one of {', '.join(offline)}, got {method!r}")
    doc = {
        "source": "fit",
        "method": method,
        "regressor": regressor,
        "n_runs": int(n_runs),
        "held_out": None if held_out is None else held_out.to_dict(),
        "prior": prior,
        "top_k": top_k,
        "n_simulations": n_simulations,
        "caps": caps,
        "max_epochs": max_epochs,
        "target_weights": target_weights,
        "predicted_loss": predicted_loss,
        "seed": int(seed),
    }
    if extra:
        clash = set(extra) & (set(doc) | {"domains", "weights"})
        if clash:
            raise FitError(f"extra: must not set {sorted(clash)}")
        doc.update(extra)
    return {k: _plain(v) for k, v in doc.items() if v is not None}


def write_proposal(
    path: str | os.PathLike,
    domains: Sequence[str],
    weights: Any,
    provenance: Mapping[str, Any],
    sources: Sequence[Any] = (),
    notes: Sequence[str] = (),
) -> Path:
    """Write the proposal's weights JSON through `write_weights_file` (atomic; weights checked as a
    distribution), its header of kind `fit` made from `sources` (the sweep)."""
    w = np.asarray(weights, dtype=np.float64)
    return write_weights_file(
        path, domains, (w / w.sum()).tolist(), provenance, kind="fit", sources=sources, notes=notes
    )
