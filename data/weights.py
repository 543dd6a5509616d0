"""Domain weights from the `data.domain_weights` forms, checked and normalised to sum 1."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from data.errors import DataError
from data.store import Manifest

WHERE = "data.domain_weights"


def check_weights(values: Any, domains: list[str], where: str = WHERE) -> np.ndarray:
    """One finite, non-negative value per domain, not all zero -> normalised float64 array."""
    try:
        w = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise DataError(f"{where}: expected numbers, got {values!r}") from None
    if w.ndim != 1 or len(w) != len(domains):
        raise DataError(f"{where}: expected {len(domains)} weights (domains {', '.join(domains)}), got "
                        f"{w.size if w.ndim else 'a scalar'}")
    bad = [f"{d}={v}" for d, v in zip(domains, w) if not math.isfinite(v) or v < 0]
    if bad:
        raise DataError(f"{where}: weights must be finite and >= 0, got {', '.join(bad)}")
    total = w.sum()
    if total <= 0:
        raise DataError(f"{where}: weights are all zero")
    return w / total


def _by_name(mapping: dict[str, Any], domains: list[str], where: str) -> list[Any]:
    unknown = sorted(set(mapping) - set(domains))
    missing = [d for d in domains if d not in mapping]
    if unknown or missing:
        raise DataError(f"{where}: domains must match the stores' ({', '.join(domains)}); "
                        f"unknown: {', '.join(unknown) or '-'}; missing: {', '.join(missing) or '-'}")
    return [mapping[d] for d in domains]


def read_weights_file(path: str | Path, domains: list[str]) -> np.ndarray:
    """A weights JSON `{"domains": [...], "weights": [...], ...}`, matched to `domains` by name."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{WHERE}: weights file {p} not found")
    try:
        raw = json.loads(p.read_text())
        names, values = raw["domains"], raw["weights"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{p}: expected JSON with 'domains' and 'weights' lists ({type(e).__name__}: {e})") from None
    if not isinstance(names, list) or not isinstance(values, list) or len(names) != len(values):
        raise DataError(f"{p}: 'domains' and 'weights' must be lists of equal length")
    if len(set(names)) != len(names):
        raise DataError(f"{p}: a domain is named twice in 'domains'")
    return check_weights(_by_name(dict(zip(names, values)), domains, str(p)), domains, str(p))


def resolve_weights(spec: str | list[float] | dict[str, float], manifest: Manifest) -> np.ndarray:
    """`uniform`, `tokens` (proportional to train tokens), a weights-JSON path, a list in domain
    order, or a mapping name -> value; normalised to sum 1."""
    domains = manifest.domain_names
    if isinstance(spec, str):
        if spec == "uniform":
            return check_weights(np.ones(len(domains)), domains)
        if spec == "tokens":
            return check_weights([d.train.tokens for d in manifest.domains], domains)
        return read_weights_file(spec, domains)
    if isinstance(spec, dict):
        return check_weights(_by_name(spec, domains, WHERE), domains)
    return check_weights(spec, domains)
