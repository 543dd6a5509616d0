"""Data mixing laws (Ye et al. 2025, "Data Mixing Laws: Optimizing Data Mixtures by Predicting
Language Modeling Performance", ICLR; released code yegcjs/mixinglaws): per-domain exponential
laws of a mixture fitted to the sweep's losses, extrapolated to the main run by the nested step
and size laws, and minimised over the simplex.

An offline fit of the shared sweep of small runs: its code is doremi/offline/fit/mixing_law.py,
nested.py and power_law.py, run by doremi/offline/propose.py (`doremi fit --method mixing_law`),
its options `fit.mixing_law`. It stays there because it builds on the sweep's design and the
fits' held-out evaluation, which the room order puts above the methods (docs/architecture.md)."""

from __future__ import annotations

from doremi.methods.spec import OFFLINE, MethodSpec, Reads

SPEC = MethodSpec(
    name="mixing_law",
    cite="Ye et al. 2025, Data Mixing Laws (ICLR); github yegcjs/mixinglaws",
    # the sweep runs' (dev) validation losses
    reads=Reads(sweep_losses=True, validation=("sweep_run",)),
    roles=(OFFLINE,),
    fit_reads_main_size=True,
)
