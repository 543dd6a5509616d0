"""RegMix (Liu et al. 2025, "RegMix: Data Mixture as Regression for Language Model
Pre-training", ICLR; released code sail-sg/regmix): a regressor from a sweep run's mixture to its
loss, and the top-k average of simulated mixtures it ranks best.

An offline fit of the shared sweep of small runs: its code is doremi/offline/fit/regmix.py, run
by doremi/offline/propose.py (`doremi fit --method regmix`), its options `fit` (`regressor`,
`simulations`, `top_k`). It stays there because it builds on the sweep's design and the fits'
held-out evaluation, which the room order puts above the methods (docs/architecture.md)."""

from __future__ import annotations

from doremi.methods.spec import OFFLINE, MethodSpec, Reads

SPEC = MethodSpec(
    name="regmix",
    cite="Liu et al. 2025, RegMix (ICLR); github sail-sg/regmix",
    # the sweep runs' (dev) validation losses
    reads=Reads(sweep_losses=True, validation=("sweep_run",)),
    roles=(OFFLINE,),
)
