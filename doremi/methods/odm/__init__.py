"""ODM: online data mixing with the EXP3 bandit over domains (Albalak, Pan, Raffel and Wang
2023, arXiv 2312.02406, Algorithm 1; released code alon-albalak/online-data-mixing). Options
`mixing.odm` (config.py); the method is method.py, whose docstring names each difference from the
paper and the released code."""

from __future__ import annotations

from typing import Any

from doremi.methods.odm.config import ODMConfig
from doremi.methods.spec import ONLINE, PROXY, MethodSpec, Reads, hook_of
from trainer.run.hooks import MethodContext, MixingHook


def check_caps(cfg: Any) -> None:
    """`draw_unit: batch` pulls one arm per step (Algorithm 1) and divides its reward by that
    arm's probability. An epoch cap (`data.max_epochs`, data/sampling/sampler.py) that exhausts
    the arm hands the batch to other domains, whose rewards would then be divided by a probability
    they were not drawn with: the two are refused together. Per-sequence draws (the default) read
    the capped mixture as drawn."""
    from trainer.config.tools import ConfigError

    if cfg.mixing.odm.draw_unit == "batch" and cfg.data.max_epochs is not None:
        raise ConfigError(
            f"mixing.odm.draw_unit: batch pulls one domain per step and cannot keep data.max_epochs "
            f"{cfg.data.max_epochs:g}: use draw_unit: sequence, or set data.max_epochs: null"
        )


def build(cfg: Any, ctx: MethodContext) -> MixingHook:
    check_caps(cfg)
    return hook_of("odm", "doremi.methods.odm.method", "ODM")(cfg, ctx)


SPEC = MethodSpec(
    name="odm",
    cite="Albalak, Pan, Raffel and Wang 2023, ODM (arXiv 2312.02406), Algorithm 1; github alon-albalak/online-data-mixing",
    # training batches' losses (its rewards)
    reads=Reads(training_batches=True),
    roles=(PROXY, ONLINE),
    config=ODMConfig,
    build=build,
    check=check_caps,
)
