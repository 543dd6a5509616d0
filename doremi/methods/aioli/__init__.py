"""Aioli: online estimation of a linear mixing law (Chen, Hu, Lourie, Cho and Re 2025, ICLR,
Algorithms 1 and 2; released code HazyResearch/aioli). Options `mixing.aioli` (config.py); the
method is method.py, whose docstring names each difference from the paper and the released code."""

from __future__ import annotations

from doremi.methods.aioli.config import AioliConfig
from doremi.methods.spec import ONLINE, PROXY, MethodSpec, Reads, hook_of

SPEC = MethodSpec(
    name="aioli",
    cite="Chen, Hu, Lourie, Cho and Re 2025, Aioli (ICLR), Algorithms 1 and 2; github HazyResearch/aioli",
    # per-domain validation losses on its probe schedule
    reads=Reads(validation=("method_probe",)),
    roles=(PROXY, ONLINE),
    config=AioliConfig,
    build=hook_of("aioli", "doremi.methods.aioli.method", "Aioli"),
)
