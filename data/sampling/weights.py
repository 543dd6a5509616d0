"""Domain weights from the `data.domain_weights` forms, checked and normalised to sum 1.

Given numbers (a list, a mapping, a weights file) must already be a distribution, up to the
rounding of published mixtures (`SUM_TOLERANCE`), or be whole-number ratios (`[2, 1, 1]`), or
come from a weights file that says `"normalize": true`; anything else (a file summing to 0.7) is
refused naming its sum (`check_sum`; docs/design.md section 3), since a mixture that silently
became another is a wrong result.

The named forms (`uniform`, `tokens`, `temperature:T`, `unimax:E`) are `data.sampling.mixtures`'. The same
forms are read by `mixing.doremi.reference_weights` and `mixing.doremi.proxy_sampling`; every error
names the key (or file) it came from. A weight is a number: `true` or `"0.5"` is refused, not
read as 1 or 0.5, since a mixture typed wrongly must not train silently on something else.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

import numpy as np

from data.errors import DataError
from data.sampling import mixtures
from data.sampling.weights_file import asks_to_normalize, read_mixture_file
from data.store.store import Manifest

WHERE = "data.domain_weights"

#: How far given fractions may sum from 1 and still be read as a distribution (then rescaled):
#: published mixtures are rounded (the Pile's weights in experiments/configs/pile_280m.yaml, four
#: decimals each, sum to 1.0016).
SUM_TOLERANCE = 0.01

#: The mixtures named by a word rather than given as numbers or a weights file: `value in
#: NAMED_MIXTURES` is true for any string in a named form (`data.sampling.mixtures.is_mixture_name`).
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
    w = _as_weights(values, domains, where)
    return w / w.sum()


def check_sum(values: Any, domains: list[str], where: str = WHERE, normalize: bool = False) -> np.ndarray:
    """`check_weights` for numbers a user gave: they must sum to 1 (within `SUM_TOLERANCE`)
    unless they are whole-number ratios or `normalize` says to rescale them."""
    w = _as_weights(values, domains, where)
    total = float(w.sum())
    if not (normalize or all(float(x).is_integer() for x in w) or abs(total - 1.0) <= SUM_TOLERANCE):
        raise DataError(
            f"{where}: weights sum to {total:.6g}, not 1: give a distribution, whole-number ratios "
            f'(such as [2, 1, 1]), or a weights file with "normalize": true to rescale them'
        )
    return w / total


def _as_weights(values: Any, domains: list[str], where: str) -> np.ndarray:
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
    if w.sum() <= 0:
        raise DataError(f"{where}: weights are all zero")
    return w


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
    check_sum(values, names, str(p), asks_to_normalize(p))
    return dict(zip(names, values))


def weights_from_file(path: str | Path, domains: list[str], where: str = WHERE) -> np.ndarray:
    """A weights file named as a mixture, matched to `domains` by name."""
    p = Path(path)
    return check_sum(_by_name(mixture_from_file(p, where), domains, str(p)), domains, str(p), asks_to_normalize(p))


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
            check_sum(list(spec.values()), list(spec), where)
        else:
            check_sum(_by_name(spec, domains, where), domains, where)
    else:
        check_numbers(spec, where)
        if domains is not None:
            check_sum(spec, domains, where)
        elif isinstance(spec, (list, tuple)):
            check_sum(spec, [str(i) for i in range(len(spec))], where)


def resolve_weights(
    spec: str | list[float] | dict[str, float],
    manifest: Manifest,
    where: str = WHERE,
    budget_tokens: int | None = None,
) -> np.ndarray:
    """A named mixture (`uniform`, `tokens`: proportional to train tokens, `temperature:T`,
    `unimax:E`: see `data.sampling.mixtures`), a weights-JSON path, a list in domain order, or a mapping
    name -> value; normalised to sum 1 (given numbers: `check_sum`'s rule). `where`: the key it was read from. `budget_tokens`: the
    run's token budget (steps x global batch x seq_len), which `unimax` needs (without it,
    `unimax` is a DataError naming `where`); the other forms ignore it. The cap of
    `data.max_epochs` is the run's own (`mixtures.sequence_capped` over its sampler's pools)."""
    domains = manifest.domain_names
    if isinstance(spec, str):
        if spec in NAMED_MIXTURES:
            return mixtures.resolve_named(spec, [d.train.tokens for d in manifest.domains], budget_tokens, where)
        return weights_from_file(spec, domains, where)
    if isinstance(spec, dict):
        check_numbers(spec, where)
        return check_sum(_by_name(spec, domains, where), domains, where)
    return check_sum(spec, domains, where)
