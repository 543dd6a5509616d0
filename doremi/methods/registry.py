"""Every mixing method by name: what it reads from the trainer, where it may run, and how it is
built from an experiment config (docs/design.md section 2).

| name   | file      | signals it reads (trainer/run/hooks.py Needs)              | weights it logs        |
|--------|-----------|--------------------------------------------------------|------------------------|
| doremi | doremi.py | reference losses; this step's excess before backward   | alpha_t (loss weights) |
| doge   | doge.py   | per-domain gradient alignment with a held-out target   | alpha_t (grad weights) |
| odm    | odm.py    | random draws; per-domain training loss                 | EXP3 sampling probs    |
| aioli  | aioli.py  | per-domain validation loss on its probe schedule       | the exploited mixture  |
| ado    | ado.py    | per-domain training loss against data seen             | the sampling policy    |

Any of them runs as a proxy (`train-proxy`, `mixing.method`; its logged weights averaged by
`doremi average`) or online on the main model (`train`, `mixing.main`). DoReMi needs a
reference, so it runs as a proxy only.

`READS` declares, for these and the offline fits (`regmix`, `mixing_law`, doremi/offline/propose.py),
the data each reads to choose a mixture (issue 35 point 3; the report lists it): its training
batches' losses, validation losses (and through which `data.validation_split.CONSUMERS` entry,
each of which must be a dev reader: `check_reads`), per-domain gradients, a sweep's losses, a
reference model's losses. A built method whose `Needs` ask for more than its declaration is
refused (`check_needs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from data.store import read_manifest
from data.weights import resolve_weights
from doremi.config import ExperimentConfig
from trainer.run.hooks import MethodContext, MethodFactory, MixingHook, Needs


@dataclass(frozen=True)
class Reads:
    """The data a method reads to choose its mixture. `validation`: the validation consumers
    (`data.validation_split.CONSUMERS`) whose losses or batches it reads; every one must read the
    dev half under `data.validation_split: dev_test`, never the verdict's test half."""

    training_batches: bool = False
    gradients: bool = False
    sweep_losses: bool = False
    reference_losses: bool = False
    validation: tuple[str, ...] = ()

    def describe(self) -> str:
        """`training batches' losses, dev validation (method_probe), ...` (`nothing` when empty)."""
        parts = [
            *(["training batches' losses"] if self.training_batches else []),
            *([f"dev validation ({', '.join(self.validation)})"] if self.validation else []),
            *(["per-domain gradients"] if self.gradients else []),
            *(["a sweep's losses"] if self.sweep_losses else []),
            *(["reference losses"] if self.reference_losses else []),
        ]
        return ", ".join(parts) or "nothing"


#: What each method reads (the module's docstring). DoReMi: the proxy's and the reference's
#: per-token losses on the training batch (excess loss). DoGE: per-domain training gradients and
#: the gradient of target batches drawn from validation. ODM, ADO: per-domain training losses.
#: Aioli: per-domain validation losses on its probe schedule. RegMix, mixing laws: the sweep
#: runs' validation losses.
READS: dict[str, Reads] = {
    "doremi": Reads(training_batches=True, reference_losses=True),
    "doge": Reads(training_batches=True, gradients=True, validation=("method_target",)),
    "odm": Reads(training_batches=True),
    "aioli": Reads(validation=("method_probe",)),
    "ado": Reads(training_batches=True),
    "regmix": Reads(sweep_losses=True, validation=("sweep_run",)),
    "mixing_law": Reads(sweep_losses=True, validation=("sweep_run",)),
}


def reads(name: str) -> Reads:
    """Method `name`'s declaration, its validation reads checked (`check_reads`)."""
    if name not in READS:
        raise KeyError(f"method {name!r} declares no reads in doremi/methods/registry.py READS")
    check_reads(name, READS[name])
    return READS[name]


def check_reads(name: str, declared: Reads) -> None:
    """Refuse (MethodSplitError) a declaration that reads validation data other than the dev
    half: a consumer that would read the verdict's test sequences under `dev_test`."""
    from data.validation_split import DEV, MethodSplitError, split_for

    for consumer in declared.validation:
        try:
            half = split_for(consumer, "dev_test")
        except ValueError:
            raise MethodSplitError(f"method {name}: reads validation as {consumer!r}, not a known consumer") from None
        if half != DEV:
            raise MethodSplitError(
                f"method {name}: reads validation as {consumer!r}, which reads the {half!r} half; a method reads "
                "only 'dev' (the verdict is computed on 'test'; docs/design.md 3b)"
            )


def check_needs(name: str, needs: Needs) -> None:
    """Refuse (MethodSplitError) a built method whose `Needs` read more than `READS` declares:
    validation passes or target batches not declared, or any split other than dev."""
    from data.validation_split import MethodSplitError, check_method_split

    declared = reads(name)
    check_method_split(needs.validation_split, name)
    asked = [
        *(["method_probe"] if needs.validation else []),
        *(["method_target"] if needs.alignment is not None else []),
    ]
    extra = [c for c in asked if c not in declared.validation]
    if extra or (needs.alignment is not None and not declared.gradients):
        raise MethodSplitError(
            f"method {name}: reads {', '.join(extra) or 'gradients'} beyond its declaration in "
            f"doremi/methods/registry.py READS ({declared.describe()})"
        )


def _doremi(cfg: ExperimentConfig, ctx: MethodContext) -> MixingHook:
    from doremi.methods.doremi import DoReMi
    from doremi.methods.reference import (
        CachedReference,
        OnlineReference,
        load_frozen,
        reference_config,
        require_reference,
    )
    from trainer.build import RunFacts

    manifest = read_manifest(cfg.data.store_dir)
    sampling = resolve_weights(cfg.doremi.proxy_sampling, manifest, "doremi.proxy_sampling", cfg.budget_tokens)
    if cfg.doremi.reference_cache:
        ref = CachedReference(
            cfg.doremi.reference_cache,
            ctx.domains,
            cfg.data.seq_len,
            ctx.device,
            steps=cfg.train.steps,
            global_batch_size=cfg.train.global_batch_size,
            seed=cfg.data.seed,
            sampling=sampling.tolist(),
            reference=cfg.doremi.reference,
        )
    else:
        ck = require_reference(cfg)
        ref_cfg = reference_config(cfg, ck)
        ref_facts = RunFacts.resolve(ref_cfg, ctx.pc)
        ref = OnlineReference(load_frozen(ref_cfg, ck, ctx.pc, ref_facts), ref_facts, ctx.pc)
    return DoReMi(cfg.doremi, ctx, sampling, ref)


def _doge(cfg: ExperimentConfig, ctx: MethodContext) -> MixingHook:
    from doremi.methods.doge import DoGE, target_sequences

    check_doge_layout(cfg)
    manifest = read_manifest(cfg.data.store_dir)
    d = cfg.mixing.doge
    sampling = resolve_weights(d.sampling, manifest, "mixing.doge.sampling", cfg.budget_tokens)
    target = resolve_weights(d.target, manifest, "mixing.doge.target", cfg.budget_tokens)
    return DoGE(d, ctx, sampling, target, target_sequences(d, cfg.train.global_batch_size))


def check_doge_layout(cfg: ExperimentConfig) -> None:
    """DoGE's step runs each domain's sequences of a rank as their own micro-batches, so dp ranks
    run different numbers of forwards; expert parallelism's all-to-all needs every rank of its
    group in every forward, so the two would wait on each other for ever: refused."""
    from trainer.config.tools import ConfigError

    if cfg.parallelism.ep > 1:
        raise ConfigError(
            f"mixing.doge: DoGE's per-domain gradients do not run under expert parallelism "
            f"(parallelism.ep = {cfg.parallelism.ep}); expected parallelism.ep: 1"
        )


def _odm(cfg: ExperimentConfig, ctx: MethodContext) -> MixingHook:
    from doremi.methods.odm import ODM

    return ODM(cfg.mixing.odm, ctx)


def _aioli(cfg: ExperimentConfig, ctx: MethodContext) -> MixingHook:
    from doremi.methods.aioli import Aioli

    return Aioli(cfg.mixing.aioli, ctx)


def _ado(cfg: ExperimentConfig, ctx: MethodContext) -> MixingHook:
    from doremi.methods.ado import ADO

    return ADO(cfg.mixing.ado, ctx)


BUILDERS: dict[str, Callable[[ExperimentConfig, MethodContext], MixingHook]] = {
    "doremi": _doremi,
    "doge": _doge,
    "odm": _odm,
    "aioli": _aioli,
    "ado": _ado,
}


def method_factory(name: str, cfg: ExperimentConfig) -> MethodFactory:
    """The factory the trainer calls with its `MethodContext`."""
    build = BUILDERS[name]

    def factory(ctx: MethodContext) -> MixingHook:
        hook = build(cfg, ctx)
        check_needs(name, getattr(hook, "needs", Needs()))
        return hook

    return factory


def preflight(name: str, cfg: ExperimentConfig, domains: list[str]) -> None:
    """Build method `name` for a run of `cfg` over `domains`, without the run, so that what the
    method refuses (a probe schedule longer than the run's rounds, a floor above 1/k) stops a pipeline before its first stage rather than
    after hours of others. DoReMi is checked by its stages (it needs its reference)."""
    import torch

    from trainer.parallel.context import ParallelContext

    if name not in BUILDERS or name == "doremi":
        return
    if name == "doge":
        check_doge_layout(cfg)
    ctx = MethodContext(
        domains=list(domains),
        run_dir=Path(cfg.train.run_dir or "."),
        is_main=False,
        device=torch.device("cpu"),
        seed=cfg.data.seed,
        steps=cfg.train.steps,
        global_batch_size=cfg.train.global_batch_size,
        seq_len=cfg.data.seq_len,
        train_tokens=[1] * len(domains),
        pc=ParallelContext.single(),
    )
    if name != "doge":  # DoGE's builder reads the stores' manifest; its config checks its keys
        BUILDERS[name](cfg, ctx)
