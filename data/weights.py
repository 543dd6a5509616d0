"""Domain weights from the `data.domain_weights` forms, checked and normalised to sum 1.

The named forms (`uniform`, `tokens`, `temperature:T`, `unimax:E`) are `data.mixtures`'. The same
forms are read by `doremi.reference_weights` and `doremi.proxy_sampling`; every error
names the key (or file) it came from. A weight is a number: `true` or `"0.5"` is refused, not
read as 1 or 0.5, since a mixture typed wrongly must not train silently on something else.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

import numpy as np

from data import mixtures
from data.errors import DataError
from data.store import Manifest
from data.weights_file import read_mixture_file

WHERE = "data.domain_weights"

#: The mixtures named by a word rather than given as numbers or a weights file: `value in
#: NAMED_MIXTURES` is true for any string in a named form (`data.mixtures.is_mixture_name`).
NAMED_MIXTURES = mixtures.NAMED_MIXTURES


def is_number(value: Any) -> bool:
    """An int or a float (numpy's too), not a bool and not a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_numbers(values: Any, where: str, keys: list[str] | None = None) -> None:
    """Every item of a list (or value of a mapping) is a number; the error names the first that
    is not by its index (`where[1]`) or its domain (`where.web`)."""
    if isinstance(values, dict):
        items = [(f"{where}.{k}", v) for k, v in values.items()]
    elif isinstance(values, (list, tuple)):
        items = [(f"{where}[{keys[i] if keys else i}]", v) for i, v in enumerate(values)]
    else:
        return
    for at, v in items:
        if not is_number(v):
            raise DataError(f"{at}: expected a number (int or float), got {v!r} ({type(v).__name__})")


def check_weights(values: Any, domains: list[str], where: str = WHERE) -> np.ndarray:
    """One finite, non-negative number per domain, not all zero -> normalised float64 array."""
    check_numbers(values, where)
    try:
        w = np.asarray(values)
        if w.dtype.kind not in "iuf":
            raise TypeError
        w = w.astype(np.float64)
    except (TypeError, ValueError):
        raise DataError(f"{where}: expected numbers, got {values!r}") from None
    if w.ndim != 1 or len(w) != len(domains):
        raise DataError(
            f"{where}: expected {len(domains)} weights (domains {', '.join(domains)}), got "
            f"{w.size if w.ndim else 'a scalar'}"
        )
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
        raise DataError(
            f"{where}: domains must match the stores' ({', '.join(domains)}); "
            f"unknown: {', '.join(unknown) or '-'}; missing: {', '.join(missing) or '-'}"
        )
    return [mapping[d] for d in domains]


def mixture_from_file(path: str | Path, where: str = WHERE) -> dict[str, float]:
    """A weights file named as a mixture -> domain -> weight, checked for form and numbers
    (finite, >= 0, not all zero) but not yet against the stores' domains."""
    names, values = read_mixture_file(path, where)
    p = Path(path)
    check_numbers(values, f"{p}: weights", names)
    check_weights(values, names, str(p))
    return dict(zip(names, values))


def weights_from_file(path: str | Path, domains: list[str], where: str = WHERE) -> np.ndarray:
    """A weights file named as a mixture, matched to `domains` by name."""
    p = Path(path)
    return check_weights(_by_name(mixture_from_file(p, where), domains, str(p)), domains, str(p))


def check_spec(spec: Any, domains: list[str] | None, where: str = WHERE) -> None:
    """Check a weights value before any work: its form always, its domains when known (from
    the config, or the stores). A named mixture needs the stores' counts (and `unimax` the run's
    budget), so only its form is checked."""
    if isinstance(spec, str):
        if spec in NAMED_MIXTURES:
            mixtures.parse_mixture(spec, where)
            return
        if domains is None:
            mixture_from_file(spec, where)
        else:
            weights_from_file(spec, domains, where)
    elif isinstance(spec, dict):
        check_numbers(spec, where)
        if domains is None:
            check_weights(list(spec.values()), list(spec), where)
        else:
            check_weights(_by_name(spec, domains, where), domains, where)
    else:
        check_numbers(spec, where)
        if domains is not None:
            check_weights(spec, domains, where)
        elif isinstance(spec, (list, tuple)):
            check_weights(spec, [str(i) for i in range(len(spec))], where)


def resolve_weights(
    spec: str | list[float] | dict[str, float], manifest: Manifest, where: str = WHERE, budget_tokens: int | None = None
) -> np.ndarray:
    """A named mixture (`uniform`, `tokens`: proportional to train tokens, `temperature:T`,
    `unimax:E`: see `data.mixtures`), a weights-JSON path, a list in domain order, or a mapping
    name -> value; normalised to sum 1. `where`: the key it was read from. `budget_tokens`: the
    run's token budget (steps x global batch x seq_len), which `unimax` needs (without it,
    `unimax` is a DataError naming `where`); the other forms ignore it."""
    domains = manifest.domain_names
    if isinstance(spec, str):
        if spec in NAMED_MIXTURES:
            return mixtures.resolve_named(spec, [d.train.tokens for d in manifest.domains], budget_tokens, where)
        return weights_from_file(spec, domains, where)
    if isinstance(spec, dict):
        check_numbers(spec, where)
        return check_weights(_by_name(spec, domains, where), domains, where)
    return check_weights(spec, domains, where)
