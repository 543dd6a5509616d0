"""What `doremi plan` plans: every training stage an experiment file runs, each with the
config it will run with (`doremi.pipeline.pipeline.Pipeline.stage_config`'s merge), grouped by the
layout they share, for `trainer.plan.layout_search`."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass

from doremi.config import ExperimentConfig
from doremi.outputs.main_runs import REFERENCE_RUN, main_run_name
from doremi.pipeline.pipeline import Pipeline, deep_merge
from trainer.config.tools import apply_overrides, read_yaml


@dataclass(frozen=True)
class StageGroup:
    """Stages that run one layout, and the `--set` prefix where that layout is written."""

    prefix: str
    stages: list[tuple[str, ExperimentConfig, bool]]  # name, config, holds a frozen reference


def plan_groups(path: str | os.PathLike, overrides: list[str] | None = None) -> list[StageGroup]:
    """A plain config (no `pipeline` section, no options of the method that needs a reference,
    `mixing.<REFERENCE_RUN>`): its one training run. An experiment:
    the reference and the proxy (all-forward-all-backward in exact reweight mode, as
    `doremi.pipeline.stages.proxy_trainer` runs it, holding the frozen reference unless cached), then the
    main runs with `pipeline.main` merged in (one plan: they differ only in their mixture)."""
    raw = apply_overrides(read_yaml(path), list(overrides or []))
    if REFERENCE_RUN not in (raw.get("mixing") or {}) and "pipeline" not in raw:
        return [StageGroup("", [("train", Pipeline._load(raw), False)])]
    base = Pipeline._load(copy.deepcopy(raw))
    p = base.pipeline
    tuned = Pipeline._load(deep_merge(raw, p.proxy))
    proxy = tuned
    opts = getattr(tuned.mixing, REFERENCE_RUN)
    if opts.update == "exact" and opts.mode == "reweight":
        proxy = dataclasses.replace(tuned, parallelism=dataclasses.replace(tuned.parallelism, pp_schedule="afab"))
    groups = [StageGroup("", [("reference", tuned, False), ("proxy", proxy, not opts.reference_cache)])]
    if not p.skip_main:
        names = [REFERENCE_RUN] + [main_run_name(b) for b in p.baselines]
        groups.append(
            StageGroup(
                "pipeline.main.", [(f"main ({', '.join(names)})", Pipeline._load(deep_merge(raw, p.main)), False)]
            )
        )
    return groups
