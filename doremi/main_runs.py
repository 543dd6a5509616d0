"""The pipeline's main runs: one per mixture, named here so that the pipeline that trains them,
the validation that refuses clashing names and the summary that reads them back agree."""

from __future__ import annotations

import os
from pathlib import Path

from data.weights import NAMED_MIXTURES

#: DoReMi's own main run, trained on the tuned weights.
DOREMI_RUN = "doremi"


def main_run_name(baseline: str) -> str:
    """A baseline's main run: its name (`uniform`, `tokens`) or its weights file's stem."""
    return baseline if baseline in NAMED_MIXTURES else Path(baseline).stem


def mixtures(weights_path: str | os.PathLike, baselines: list[str]) -> dict[str, str]:
    """Main-run name -> `data.domain_weights` value: DoReMi's weights file, then the baselines."""
    mix = {DOREMI_RUN: str(weights_path)}
    for b in baselines:
        mix[main_run_name(b)] = b
    return mix
