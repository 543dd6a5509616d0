"""The pipeline's main runs: one per mixture, named here so that the pipeline that trains them,
the validation that refuses clashing names and the summary that reads them back agree."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from data.errors import DataError
from data.sampling.mixtures import parse_mixture
from data.sampling.weights import NAMED_MIXTURES
from data.sampling.weights_file import WEIGHTS_FILE
from doremi.methods import registry

#: The catalog's method that needs a reference (doremi/methods/registry.py; DoReMi): its rounds
#: of reference and proxy run at the pipeline's root, its weights are the root's weights.json, and
#: its main run trains on them.
REFERENCE_RUN = (registry.with_reference() or ("",))[0]


def main_run_name(baseline: str) -> str:
    """A baseline's main run: its name (`uniform`, `tokens`, `temperature2`, `temperature1.5`,
    `unimax4`: `data.sampling.mixtures.MixtureSpec.run_name`) or its weights file's stem. A named form
    that does not parse gets its text without colons here; `check_spec` refuses it with its key."""
    if baseline not in NAMED_MIXTURES:
        return Path(baseline).stem
    try:
        return parse_mixture(baseline, "pipeline.baselines").run_name
    except DataError:
        return baseline.replace(":", "")


#: The sweep of small runs the offline methods (RegMix, mixing laws) fit, under a pipeline root.
SWEEP_DIR = "sweep"


def method_dir(root: str | os.PathLike, method: str) -> Path:
    """Where a mixing method other than `REFERENCE_RUN` runs its proxy and writes its weights."""
    return Path(root) / "methods" / method


def search_dir(stage_dir: str | os.PathLike, search: int, searches: int) -> Path:
    """Where search `search` (1 to `searches`, `pipeline.searches`) of a round's or a method's
    directory runs its reference and proxy: the directory itself for one search, its
    `search<i>/` for several."""
    return Path(stage_dir) if searches == 1 else Path(stage_dir) / f"search{search}"


def search_folders(stage_dir: str | os.PathLike) -> list[Path]:
    """The `search<i>/` folders of a round's or a method's directory, by i (none for one search)."""
    found = [p for p in Path(stage_dir).glob("search*") if p.is_dir() and p.name[6:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[6:]))


def search_dirs(stage_dir: str | os.PathLike) -> list[Path]:
    """The searches a round's or a method's directory holds, in order: its `search<i>/` folders
    where there are (`search_dir`), else the directory itself."""
    return search_folders(stage_dir) or [Path(stage_dir)]


def online_run_name(method: str) -> str:
    """The main run of a method run online on the main model."""
    return f"{method}-online"


def mixtures(
    weights_path: str | os.PathLike, baselines: list[str], methods: Sequence[str] = (REFERENCE_RUN,)
) -> dict[str, str]:
    """Main-run name -> `data.domain_weights` value: each method's weights file (`REFERENCE_RUN`'s is
    `weights_path`, beside which the others' `methods/<name>/weights.json` lie), then the
    baselines."""
    root = Path(weights_path).parent
    mix = {m: str(weights_path if m == REFERENCE_RUN else method_dir(root, m) / WEIGHTS_FILE) for m in methods}
    for b in baselines:
        mix[main_run_name(b)] = b
    return mix
