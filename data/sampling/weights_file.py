"""The weights JSON file, `{"domains": [...], "weights": [...], ...provenance}`: every read and
write of the format goes through here, so that its fields and checks live in one place.

It is read two ways because it serves two purposes. `doremi average` writes the tuned weights in
it, a distribution with where it came from (`read_weights_file` reads that back and holds it to
a distribution). A config key that takes a mixture (`data.domain_weights`, `pipeline.baselines`,
...) may name one too, possibly written by hand: `read_mixture_file` checks only the file's
form, and `data.sampling.weights` checks its numbers as it checks a mixture given in any other form.

A file this code writes carries an artifact header (`data.artifact`; docs/design.md section 6b)
under `artifact`: kind `weights` (`doremi average`) or `fit` (`doremi fit`), the hash of its
domains and weights as its fingerprint, the run it was made from, and what its writer was told
to accept. Reading it back (`check_provenance`), a file whose domains or weights no longer hash
to the header's is "edited" and refused unless it says `"accept_edited": true`; one whose
source run is still there but holds another run is refused. A file without a header (written
by hand) is read as it is.
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

from data import artifact
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


def _content(doc: Mapping[str, Any]) -> str:
    return artifact.content_hash({"domains": doc.get("domains"), "weights": doc.get("weights")})


def is_weights_doc(path: Path) -> bool:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("domains"), list) and isinstance(doc.get("weights"), list)


def write_weights_file(
    path: str | os.PathLike,
    domains: Sequence[str],
    weights: Any,
    provenance: Mapping[str, Any],
    kind: str = "weights",
    sources: Sequence[artifact.Source] = (),
    notes: Sequence[str] = (),
) -> Path:
    """Write `{"domains": [...], "weights": [...], **provenance}` atomically, with its artifact
    header (`kind`, made from `sources`, `notes`: what its writer was told to accept); `weights`
    (a list, array or tensor) must be a distribution over `domains`. An existing file is
    replaced only if it is a weights file.

    `provenance` records where the weights come from (e.g. `source`, `steps`, `eta`,
    `smoothing`); `created` (UTC, ISO 8601) is added when absent.
    """
    path = Path(path)
    domains = list(domains)
    w = [float(v) for v in per_domain_list(weights, len(domains))]
    _check_distribution(path, w)
    clash = {"domains", "weights", artifact.HEADER_KEY} & set(provenance)
    if clash:
        raise DataError(f"{path}: provenance must not set {sorted(clash)}")
    if path.exists() and not is_weights_doc(path):
        raise artifact.ArtifactError(f"{path}: exists and is not a weights file; choose another path")
    doc: dict[str, Any] = {"domains": domains, "weights": w, **provenance}
    doc.setdefault("created", datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    header = artifact.Header(kind, fingerprint=_content(doc), sources=list(sources), notes=list(notes))
    atomic_write_text(path, json.dumps(artifact.embed(doc, header), indent=2) + "\n")
    return path


def check_provenance(path: Path, doc: Mapping[str, Any]) -> None:
    """A weights file with a header: not edited by hand since written (unless it says
    `"accept_edited": true`), and made from the run that is still at its source path, if any."""
    raw = doc.get(artifact.HEADER_KEY)
    if not isinstance(raw, dict):
        return
    header = artifact.Header.from_json(raw, str(path))
    now = _content(doc)
    if now != header.fingerprint and doc.get("accept_edited") is not True:
        raise artifact.ArtifactError(
            f"{path}: edited: its domains or weights are not those written by the {header.kind} step "
            f'(content {now}, the header records {header.fingerprint}); add "accept_edited": true to the '
            f"file to use it as edited, or write it again"
        )
    for src in header.sources:
        if src.kind != "run" or not Path(src.path).is_dir():
            continue
        run = artifact.read(src.path)
        have = None if run is None else run.fingerprint
        if have is not None and have != src.fingerprint:
            raise artifact.ArtifactError(
                f"{path}: made from run {src.path} ({src.fingerprint}), which now holds another run ({have}); "
                f"average that run again"
            )


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
    check_provenance(path, doc)
    return doc


def copy_weights_file(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy a weights file byte for byte, atomically (the pipeline's last round's weights
    becoming its result): a copy, not a rewrite, keeps its `created`."""
    atomic_write_text(dst, Path(src).read_text())
    return Path(dst)


#: The field of a hand-written weights file whose numbers are relative: `"normalize": true` asks
#: for them to be rescaled to sum 1 (data.sampling.weights.check_sum); without it they must sum to 1.
NORMALIZE = "normalize"


def asks_to_normalize(path: str | Path) -> bool:
    """Whether the weights file at `path` says `"normalize": true` (False when it cannot be read:
    `read_mixture_file` names that problem)."""
    try:
        return json.loads(Path(path).read_text()).get(NORMALIZE) is True
    except (OSError, ValueError, AttributeError):
        return False


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
    check_provenance(p, raw)
    return names, values
