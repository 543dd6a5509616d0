"""What a mixing method tells the framework about itself: `MethodSpec`, one per folder of the
catalog (doremi/methods/<name>/__init__.py exports `SPEC`), and `Reads`, the data it reads to
choose a mixture (issue 35 points 1 and 3; docs/design.md section 2).

Everything else that names methods (MixingConfig's sections and choices, the pipeline's stages,
the report's reads, the config docs) is derived from the specs by doremi/methods/registry.py, so
that a method is its folder plus one registry line."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.run.hooks import MethodContext, MixingHook

#: A proxy (`doremi train-proxy`, its logged weights averaged by `doremi average`).
PROXY = "proxy"
#: Online on the main model (`doremi train` with `mixing.main`).
ONLINE = "online"
#: A fit of the shared sweep of small runs (doremi/offline/): `pipeline.methods` only.
OFFLINE = "offline"
ROLES = (PROXY, ONLINE, OFFLINE)


@dataclass(frozen=True)
class Reads:
    """The data a method reads to choose its mixture. `validation`: the validation consumers
    (`data.store.validation_split.CONSUMERS`) whose losses or batches it reads; every one must read the
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


#: `build(cfg, ctx)`: the method's hook for a run of experiment config `cfg` (doremi.config's
#: ExperimentConfig; typed `Any` because the config is made from the specs).
Builder = Callable[[Any, MethodContext], MixingHook]
#: `check(cfg)`: refuse (ConfigError) a run config the method cannot train under, before any stage.
Check = Callable[[Any], None]
#: `fit(cfg, table)`: an offline method's proposal (doremi/offline/fit/table.py `FitResult`) from
#: experiment config `cfg` and the sweep as `doremi fit` read it (`SweepTable`).
SweepFit = Callable[[Any, Any], Any]
#: `describe_fit(doc)`: a line on what a proposal's fit was fitted to, from its weights file's
#: JSON, for `doremi fit` and the report (None: nothing to add).
DescribeFit = Callable[[dict[str, Any]], "str | None"]


@dataclass(frozen=True)
class MethodSpec:
    """One method of the catalog.

    `config`: its options' dataclass, the section `mixing.<name>` (None: no section; the offline
    fits keep theirs under `fit`). `build`: its hook (None for an offline fit). `fit`: an offline
    method's fit of the sweep, which doremi/offline/propose.py runs (`lazy`), and `describe_fit`
    what a proposal's JSON says of it. `needs_reference`: a proxy that reads a trained reference
    model's losses, so the pipeline trains the reference first and iterates rounds; its config
    then has the reference options (`reference`, `reference_weights`, `reference_cache`,
    `proxy_sampling`, `mode`, `update`, `average_from_step`, `rounds`, `rounds_tolerance`).
    `moved_from`: the top-level section its options were written under before the catalog; the
    old keys are refused with a line naming the new ones, and run records name them as before so
    that finished runs keep their fingerprints. `check`: the layout checks a pipeline's preflight
    runs without building (`build` runs too unless `preflight_builds` is off). `average_keys`:
    the options a weights file made by averaging its proxy records (all of them when empty).
    `path_options`: options that may name a file or a run directory, whose content is then part
    of a run's identity (trainer.records.run_dir.path_keys). `bookkeeping_options`: options that
    change no run's results (how many rounds a pipeline iterates, where an average starts).
    `fit_reads_main_size`: an offline fit that extrapolates to the main run's size, so the main
    model's parameter count is one of its stage's keys, and its table has the sizes and curves.
    `fit_reads_prior`: an offline fit that draws around the sweep's prior, so `doremi fit` refuses
    a config whose `sweep.prior` is not the sweep's and gives the fit that prior.
    `extra_sequences(options, global_batch_size)`: the sequences a step trains on besides its
    batch (DoGE's target batch), from its options as a run's saved config has them, for the cost
    ledger (doremi/reports/ledger.py)."""

    name: str
    cite: str
    reads: Reads
    roles: tuple[str, ...]
    config: type | None = None
    build: Builder | None = None
    needs_reference: bool = False
    moved_from: str | None = None
    check: Check | None = None
    preflight_builds: bool = True
    average_keys: tuple[str, ...] = ()
    path_options: tuple[str, ...] = ()
    bookkeeping_options: tuple[str, ...] = ()
    fit_reads_main_size: bool = False
    fit: SweepFit | None = None
    describe_fit: DescribeFit | None = None
    fit_reads_prior: bool = False
    extra_sequences: Callable[[dict[str, Any], int], int] | None = None

    def __post_init__(self) -> None:
        unknown = [r for r in self.roles if r not in ROLES]
        if unknown or not self.roles:
            raise ValueError(f"method {self.name}: roles {self.roles}, expected some of {', '.join(ROLES)}")
        if (PROXY in self.roles or ONLINE in self.roles) and (self.build is None or self.config is None):
            raise ValueError(f"method {self.name}: a proxy or online method needs a config and a builder")
        if OFFLINE in self.roles and self.fit is None:
            raise ValueError(f"method {self.name}: an offline method needs its fit of the sweep")
        if self.needs_reference and ONLINE in self.roles:
            raise ValueError(f"method {self.name}: a method that needs a reference cannot run online on the main model")


def hook_of(name: str, module: str, hook: str) -> Builder:
    """The builder of a method whose hook is `hook(cfg.mixing.<name>, ctx)`, class `hook` of
    `module`, imported when first built (so that the catalog loads without the method's code)."""

    def build(cfg: Any, ctx: MethodContext) -> MixingHook:
        return getattr(importlib.import_module(module), hook)(getattr(cfg.mixing, name), ctx)

    return build


def lazy(module: str, attr: str) -> Callable[..., Any]:
    """Function `attr` of `module`, imported when first called (so that the catalog loads without
    the method's code): an offline method's `fit` and `describe_fit`."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), attr)(*args)

    return call
