"""Data mixing laws (Ye et al. 2025, "Data Mixing Laws: Optimizing Data Mixtures by Predicting
Language Modeling Performance", ICLR; released code yegcjs/mixinglaws): per-domain exponential
laws of a mixture fitted to the sweep's losses, extrapolated to the main run by the nested step
and size laws, and minimised over the simplex.

An offline fit of the shared sweep of small runs: its code is here (`fit.py`: the law and its
minimiser; `nested.py`: the step and size laws' extrapolation; `power_law.py`: their fit;
`propose.py`: the fit of a sweep and the line describing it), run by doremi/offline/propose.py
(`doremi fit --method mixing_law`), its options `fit.mixing_law`. It builds on the generic fit machinery of doremi/offline/fit/ (input checks, epoch caps, the
held-out evaluation), a room below the methods' (docs/architecture.md)."""

from __future__ import annotations

from doremi.methods.spec import OFFLINE, MethodSpec, Reads, lazy

SPEC = MethodSpec(
    name="mixing_law",
    cite="Ye et al. 2025, Data Mixing Laws (ICLR); github yegcjs/mixinglaws",
    # the sweep runs' (dev) validation losses
    reads=Reads(sweep_losses=True, validation=("sweep_run",)),
    roles=(OFFLINE,),
    fit_reads_main_size=True,
    fit=lazy("doremi.methods.mixing_law.propose", "fit_sweep"),
    describe_fit=lazy("doremi.methods.mixing_law.propose", "describe"),
)
