"""The weights JSON file, `{"domains": [...], "weights": [...], ...provenance}`: every read and
write of the format goes through here, so that its fields and checks live in one place.

It is read two ways because it serves two purposes. `doremi average` writes the tuned weights in
it, a distribution with where it came from (`read_weights_file` reads that back and holds it to
a distribution). A config key that takes a mixture (`data.domain_weights`, `pipeline.baselines`,
...) may name one too, possibly written by hand: `read_mixture_file` checks only the file's
form, and `data.weights` checks its numbers as it checks a mixture given in any other form.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.atomic import atomic_write_text
from data.errors import DataError

#: The tuned weights' file name in a proxy run and in a pipeline's run directory.
WEIGHTS_FILE = "weights.json"


def per_domain_list(values: Any, k: int, what: str = "weights", error: type[Exception] = DataError) -> list:
    """A tensor, array or sequence of one value per domain as a plain list (what JSON holds);
    `error` names `what` when there are not `k` of them."""
    if hasattr(values, "detach"):
        values = values.detach().cpu().tolist()
    elif isinstance(values, np.ndarray):
        values = values.tolist()
    values = list(values)
    if len(values) != k:
        raise error(f"{what}: expected {k} values (one per domain), got {len(values)}")
    return values


def _check_distribution(path: Path, w: Sequence[Any]) -> None:
    ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in w)
    if not ok or abs(sum(w) - 1.0) > 1e-6:
        raise DataError(f"{path}: weights: expected finite non-negative numbers summing to 1, got {list(w)}")


def write_weights_file(
    path: str | os.PathLike, domains: Sequence[str], weights: Any, provenance: Mapping[str, Any]
) -> Path:
    """Write `{"domains": [...], "weights": [...], **provenance}` atomically; `weights` (a list,
    array or tensor) must be a distribution over `domains`.

    `provenance` records where the weights come from (e.g. `source`, `steps`, `eta`,
    `smoothing`); `created` (UTC, ISO 8601) is added when absent.
    """
    path = Path(path)
    domains = list(domains)
    w = [float(v) for v in per_domain_list(weights, len(domains))]
    _check_distribution(path, w)
    clash = {"domains", "weights"} & set(provenance)
    if clash:
        raise DataError(f"{path}: provenance must not set {sorted(clash)}")
    doc: dict[str, Any] = {"domains": domains, "weights": w, **provenance}
    doc.setdefault("created", datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
    return path


def read_weights_file(path: str | os.PathLike) -> dict[str, Any]:
    """The document `write_weights_file` wrote, its domains and weights (a distribution) checked."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: weights file not found") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: expected a JSON object, got invalid JSON ({e.msg})") from None
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("domains"), list)
        or not isinstance(doc.get("weights"), list)
    ):
        raise DataError(f"{path}: expected an object with lists 'domains' and 'weights'")
    if len(doc["domains"]) != len(doc["weights"]):
        raise DataError(
            f"{path}: weights: expected {len(doc['domains'])} values (one per domain), got {len(doc['weights'])}"
        )
    _check_distribution(path, doc["weights"])
    return doc


def copy_weights_file(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy a weights file byte for byte, atomically (the pipeline's last round's weights
    becoming its result): a copy, not a rewrite, keeps its `created`."""
    atomic_write_text(dst, Path(src).read_text())
    return Path(dst)


def read_mixture_file(path: str | Path, where: str) -> tuple[list[str], list[Any]]:
    """A weights file named as a mixture by config key `where` -> its domain names (unique
    strings) and their weights, as written: their numbers are the caller's to check."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{where}: weights file {p} not found")
    try:
        raw = json.loads(p.read_text())
        names, values = raw["domains"], raw["weights"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{p}: expected JSON with 'domains' and 'weights' lists ({type(e).__name__}: {e})") from None
    if not isinstance(names, list) or not isinstance(values, list) or len(names) != len(values):
        raise DataError(f"{p}: 'domains' and 'weights' must be lists of equal length")
    if not all(isinstance(n, str) for n in names):
        raise DataError(f"{p}: domains: expected names (strings), got {names!r}")
    if len(set(names)) != len(names):
        raise DataError(f"{p}: a domain is named twice in 'domains'")
    return names, values
