"""Every mixing method by name: what it reads from the trainer, where it may run, and how it is
built from an experiment config (docs/design.md section 2).

| name   | file      | signals it reads (trainer/hooks.py Needs)              | weights it logs        |
|--------|-----------|--------------------------------------------------------|------------------------|
| doremi | doremi.py | reference losses; this step's excess before backward   | alpha_t (loss weights) |
| doge   | doge.py   | per-domain gradient alignment with a held-out target   | alpha_t (grad weights) |
| odm    | odm.py    | random draws; per-domain training loss                 | EXP3 sampling probs    |
| aioli  | aioli.py  | per-domain validation loss on its probe schedule       | the exploited mixture  |
| ado    | ado.py    | per-domain training loss against data seen             | the sampling policy    |

Any of them runs as a proxy (`train-proxy`, `mixing.method`; its logged weights averaged by
`doremi average`) or online on the main model (`train`, `mixing.main`). DoReMi needs a
reference, so it runs as a proxy only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from data.store import read_manifest
from data.weights import resolve_weights
from doremi.config import ExperimentConfig
from trainer.hooks import MethodContext, MethodFactory, MixingHook


def _doremi(cfg: ExperimentConfig, ctx: MethodContext) -> MixingHook:
    from doremi.methods.doremi import DoReMi
    from doremi.reference import CachedReference, OnlineReference, load_frozen, reference_config, require_reference
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
    from trainer.configtools import ConfigError

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
    return lambda ctx: build(cfg, ctx)


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
