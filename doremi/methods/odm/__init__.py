"""ODM: online data mixing with the EXP3 bandit over domains (Albalak, Pan, Raffel and Wang
2023, arXiv 2312.02406, Algorithm 1; released code alon-albalak/online-data-mixing). Options
`mixing.odm` (config.py); the method is method.py, whose docstring names each difference from the
paper and the released code."""

from __future__ import annotations

from doremi.methods.odm.config import ODMConfig
from doremi.methods.spec import ONLINE, PROXY, MethodSpec, Reads, hook_of

SPEC = MethodSpec(
    name="odm",
    cite="Albalak, Pan, Raffel and Wang 2023, ODM (arXiv 2312.02406), Algorithm 1; github alon-albalak/online-data-mixing",
    # training batches' losses (its rewards)
    reads=Reads(training_batches=True),
    roles=(PROXY, ONLINE),
    config=ODMConfig,
    build=hook_of("odm", "doremi.methods.odm.method", "ODM"),
)
