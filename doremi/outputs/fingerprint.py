"""What a pipeline stage's output depends on: the config keys the stage reads, flattened to
`section.key` paths, with what its path-valued keys and the stores point at; the stage markers
record the keys and their hash, and a stage whose hash changed is redone, naming the keys.

Here rather than in `doremi.pipeline.pipeline` because `doremi.pipeline.validate` needs `SAMPLING_KEYS` too, and
the pipeline imports the validation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from data.store.store import MANIFEST_FILE, read_manifest
from doremi.config import ExperimentConfig
from doremi.methods import registry
from doremi.outputs.main_runs import REFERENCE_RUN
from doremi.outputs.stage_markers import dir_marker
from trainer.config.tools import to_dict
from trainer.records.run_dir import flatten_keys, record_keys

#: `data` keys that change how batches are drawn from the stores, not the stores' bytes.
SAMPLING_KEYS = (
    "seed",
    "domain_weights",
    "max_epochs",
    "seq_len",
    "num_proc",
    "holdout_sequences",
    "validation_split",
    "dev_fraction",
)

#: Where the keys are named: by their record path (`trainer.records.run_dir.record_keys`), so a
#: method's section moved under `mixing` keeps its old name (`ExperimentConfig.MOVED`) and a stage
#: finished before the move keeps its fingerprint. `_REF`: the section of the method that needs a
#: reference (`REFERENCE_RUN`), `_MOVED`: the moved sections, outside `mixing` in the records.
_REF = registry.record_path(REFERENCE_RUN) if REFERENCE_RUN else "mixing"
_MOVED = tuple(ExperimentConfig.MOVED)

#: Keys no stage's output depends on: logging, the pipeline's own section, where a stage writes
#: (the pipeline places it), and how many rounds run (which does not change any one round).
NOT_STAGE_KEYS = ("logging", "pipeline", "train.run_dir", f"{_REF}.rounds", f"{_REF}.rounds_tolerance")

#: Keys that may name a weights file or a finished stage: what they point at is a key too.
DEPENDENCY_KEYS = ("data.domain_weights", f"{_REF}.reference_weights", f"{_REF}.reference")

#: The sections a stage does not read. The reference reads its method's `reference_weights`
#: only (its mixture); a main run and its evaluation no method's options (an online one
#: `mixing.main` and its method's options); the proxy of the method that needs a reference and
#: its average all of that method's options and nothing else of `mixing`; another method's proxy
#: `mixing.method` and its options; none of them the offline methods' `sweep` and `fit`.
#: The offline methods' sections: only the sweep and its fits read them.
OFFLINE_SECTIONS = ("sweep", "fit")
REFERENCE_IGNORES = (*_MOVED, "mixing", *OFFLINE_SECTIONS)
REFERENCE_READS = (f"{_REF}.reference_weights",)
MAIN_IGNORES = (*_MOVED, "mixing", *OFFLINE_SECTIONS)
#: The reference method's proxy reads all of its options; another method's proxy its `mixing` keys.
PROXY_IGNORES = (*(m for m in _MOVED if m != _REF), "mixing", *OFFLINE_SECTIONS)
METHOD_IGNORES = (*_MOVED, "mixing", *OFFLINE_SECTIONS)


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text if isinstance(text, bytes) else text.encode()).hexdigest()[:16]


def _dependency(value: Any) -> str | None:
    """The content a config value points at (a weights file, a finished stage), so that a stage
    is redone when what it reads changed even though its config did not."""
    if not isinstance(value, str):
        return None
    p = Path(value)
    if p.is_file():
        return _digest(p.read_bytes())
    if dir_marker(p).is_file():
        return _digest(dir_marker(p).read_bytes())
    return None


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def stage_keys(cfg: ExperimentConfig, ignore: Iterable[str] = (), reads: Iterable[str] = ()) -> dict[str, Any]:
    """The keys a training or averaging stage reads: the whole config but `NOT_STAGE_KEYS` and
    the sections or keys in `ignore` (save those in `reads`), with `KEY (content)` for what
    `DEPENDENCY_KEYS` point at and `data (stores)` for the stores' fingerprint (stores rebuilt
    in place with `preprocess --force` are other data under the same path)."""
    skip, reads = (*NOT_STAGE_KEYS, *ignore), tuple(reads)
    keys = {k: v for k, v in record_keys(cfg).items() if _under(k, reads) or not _under(k, skip)}
    for k in DEPENDENCY_KEYS:
        if k in keys:
            dep = _dependency(keys[k])
            if dep is not None:
                keys[f"{k} (content)"] = dep
    if (Path(cfg.data.store_dir) / MANIFEST_FILE).is_file():
        keys["data (stores)"] = read_manifest(cfg.data.store_dir).fingerprint[:16]
    return keys


def store_keys(cfg: ExperimentConfig) -> dict[str, Any]:
    """The keys the preprocess stage reads: the data section without SAMPLING_KEYS."""
    return {f"data.{k}": v for k, v in flatten_keys(to_dict(cfg.data)).items() if not _under(k, SAMPLING_KEYS)}


def fingerprint(keys: dict[str, Any]) -> str:
    return _digest(json.dumps(keys, sort_keys=True, default=str))


def store_fingerprint(cfg: ExperimentConfig) -> str:
    """The preprocess stage's fingerprint."""
    return fingerprint(store_keys(cfg))
