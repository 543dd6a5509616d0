"""ADO: adaptive data optimization with per-domain scaling laws (Jiang, Zhou, Feng, Malladi and
Kolter 2024, arXiv 2410.11820, section 3; released code yidingjiang/ado). Options `mixing.ado`
(config.py); the method is method.py, whose docstring names each difference from the paper and
the released code."""

from __future__ import annotations

from doremi.methods.ado.config import ADOConfig
from doremi.methods.spec import ONLINE, PROXY, MethodSpec, Reads, hook_of

SPEC = MethodSpec(
    name="ado",
    cite="Jiang, Zhou, Feng, Malladi and Kolter 2024, ADO (arXiv 2410.11820), section 3; github yidingjiang/ado",
    # per-domain training losses against the data seen
    reads=Reads(training_batches=True),
    roles=(PROXY, ONLINE),
    config=ADOConfig,
    build=hook_of("ado", "doremi.methods.ado.method", "ADO"),
)
