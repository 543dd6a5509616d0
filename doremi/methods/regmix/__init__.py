"""RegMix (Liu et al. 2025, "RegMix: Data Mixture as Regression for Language Model
Pre-training", ICLR; released code sail-sg/regmix): a regressor from a sweep run's mixture to its
loss, and the top-k average of simulated mixtures it ranks best.

An offline fit of the shared sweep of small runs: its regressors and proposer are `fit.py` here,
`propose.py` the fit of a sweep, run by doremi/offline/propose.py (`doremi fit --method regmix`),
its options `fit` (`regressor`, `simulations`, `top_k`). It builds on the generic fit machinery of doremi/offline/fit/ (input
checks, the Dirichlet design, the held-out evaluation), a room below the methods'
(docs/architecture.md)."""

from __future__ import annotations

from doremi.methods.spec import OFFLINE, MethodSpec, Reads, lazy

SPEC = MethodSpec(
    name="regmix",
    cite="Liu et al. 2025, RegMix (ICLR); github sail-sg/regmix",
    # the sweep runs' (dev) validation losses
    reads=Reads(sweep_losses=True, validation=("sweep_run",)),
    roles=(OFFLINE,),
    fit=lazy("doremi.methods.regmix.propose", "fit_sweep"),
    fit_reads_prior=True,
)
