"""What a pipeline stage's output depends on, hashed: the stage markers record it, and a stage
whose fingerprint changed is redone.

Here rather than in `doremi.pipeline` because `doremi.validate` needs `SAMPLING_KEYS` too, and
the pipeline imports the validation.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from doremi.config import ExperimentConfig
from doremi.stage_markers import dir_marker
from trainer.configtools import to_dict

#: `data` keys that change how batches are drawn from the stores, not the stores' bytes.
SAMPLING_KEYS = ("seed", "domain_weights", "seq_len", "num_proc", "holdout_sequences")


def _dependency(value: Any) -> str | None:
    """The content a config value points at (a weights file, a finished stage), so that a stage
    is redone when what it reads changed even though its config did not."""
    if not isinstance(value, str):
        return None
    p = Path(value)
    if p.is_file():
        return p.read_text()
    if dir_marker(p).is_file():
        return dir_marker(p).read_text()
    return None


def fingerprint(cfg: ExperimentConfig) -> str:
    """A training or averaging stage's: its whole config but for logging and the pipeline's own
    keys, and the content of the weights files and stages it reads."""
    raw = to_dict(cfg)
    raw.pop("logging", None)
    raw.pop("pipeline", None)
    for key in ("rounds", "rounds_tolerance"):  # how many rounds run does not change any one round
        raw["doremi"].pop(key, None)
    deps = [_dependency(v) for v in (cfg.data.domain_weights, cfg.doremi.reference_weights, cfg.doremi.reference)]
    blob = json.dumps([raw, deps], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def store_fingerprint(cfg: ExperimentConfig) -> str:
    """The preprocess stage's fingerprint: the data section without SAMPLING_KEYS."""
    raw = {k: v for k, v in to_dict(cfg.data).items() if k not in SAMPLING_KEYS}
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]
