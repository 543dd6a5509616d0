"""The catalog of mixing methods: `CATALOG`, one line per method, each a package under
doremi/methods/ exporting a `MethodSpec` as `SPEC` (doremi/methods/spec.py; docs/design.md
section 2). Adding a method is its folder and its line here; everything that names methods is
derived from the specs: `mixing`'s sections and choices (doremi/config.py), the pipeline's
stages, the reads the report lists, the config docs.

| name       | roles           | signals it reads (trainer/run/hooks.py Needs)          | weights it logs        |
|------------|-----------------|--------------------------------------------------------|------------------------|
| doremi     | proxy           | reference losses; this step's excess before backward   | alpha_t (loss weights) |
| doge       | proxy, online   | per-domain gradient alignment with a held-out target   | alpha_t (grad weights) |
| odm        | proxy, online   | random draws; per-domain training loss                 | EXP3 sampling probs    |
| aioli      | proxy, online   | per-domain validation loss on its probe schedule       | the exploited mixture  |
| ado        | proxy, online   | per-domain training loss against data seen             | the sampling policy    |
| regmix     | offline         | a sweep's validation losses (doremi/offline/)          | its proposal           |
| mixing_law | offline         | a sweep's validation losses (doremi/offline/)          | its proposal           |

A proxy runs under `train-proxy` (`mixing.method`; its logged weights averaged by `doremi
average`), an online method on the main model under `train` (`mixing.main`). A method that needs
a reference (its spec's `needs_reference`) runs as a proxy only, after its reference.

Each spec's `reads` declares the data the method reads to choose a mixture (issue 35 point 3;
the report lists it): its training batches' losses, validation losses (and through which
`data.store.validation_split.CONSUMERS` entry, each of which must be a dev reader: `check_reads`),
per-domain gradients, a sweep's losses, a reference model's losses. A built method whose `Needs`
ask for more than its declaration is refused (`check_needs`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from doremi.methods.spec import OFFLINE, ONLINE, PROXY, Builder, MethodSpec, Reads
from trainer.run.hooks import MethodContext, MethodFactory, MixingHook, Needs

__all__ = ["CATALOG", "MethodSpec", "Reads", "check_needs", "check_reads", "method_factory", "preflight", "reads"]

CATALOG: tuple[str, ...] = (
    "doremi.methods.doremi",
    "doremi.methods.doge",
    "doremi.methods.odm",
    "doremi.methods.aioli",
    "doremi.methods.ado",
    "doremi.methods.regmix",
    "doremi.methods.mixing_law",
)


@functools.cache
def _load(catalog: tuple[str, ...]) -> dict[str, MethodSpec]:
    out: dict[str, MethodSpec] = {}
    for path in catalog:
        spec = getattr(importlib.import_module(path), "SPEC", None)
        if not isinstance(spec, MethodSpec):
            raise TypeError(f"{path}: a catalog package exports a MethodSpec as SPEC")
        if spec.name in out:
            raise ValueError(f"{path}: method {spec.name!r} is in the catalog twice")
        if spec.needs_reference and any(s.needs_reference for s in out.values()):
            raise ValueError(
                f"{path}: the pipeline's layout (round<r>/, weights at its root) holds one method that needs a reference"
            )
        out[spec.name] = spec
    return out


def specs() -> dict[str, MethodSpec]:
    """Every method of `CATALOG` by name, in catalog order."""
    return _load(CATALOG)


def spec(name: str) -> MethodSpec:
    found = specs().get(name)
    if found is None:
        raise KeyError(f"method {name!r} is not in the catalog (doremi/methods/registry.py CATALOG)")
    return found


def names(role: str) -> tuple[str, ...]:
    """The methods that can play `role` (spec.PROXY, ONLINE or OFFLINE), in catalog order."""
    return tuple(n for n, s in specs().items() if role in s.roles)


def trained() -> tuple[str, ...]:
    """The methods that train (as a proxy or online): those with a `mixing.<name>` section."""
    return tuple(n for n, s in specs().items() if PROXY in s.roles or ONLINE in s.roles)


def with_reference() -> tuple[str, ...]:
    """The proxies that need a reference model (the pipeline trains it first)."""
    return tuple(n for n, s in specs().items() if s.needs_reference)


def moved_sections() -> dict[str, str]:
    """Old top-level section -> its key under `mixing` (`MethodSpec.moved_from`)."""
    return {s.moved_from: f"mixing.{n}" for n, s in specs().items() if s.moved_from}


def record_path(name: str, option: str = "") -> str:
    """Where run records name method `name`'s option (its section when `option` is empty): under
    the section the method moved from, if any (trainer.records.run_dir.record_keys), else
    `mixing.<name>`."""
    section = spec(name).moved_from or f"mixing.{name}"
    return f"{section}.{option}" if option else section


def record_keys(kind: str) -> tuple[str, ...]:
    """Every method's `path_options` (`kind` "path") or `bookkeeping_options` ("bookkeeping"),
    by their record paths."""
    attr = {"path": "path_options", "bookkeeping": "bookkeeping_options"}[kind]
    return tuple(record_path(n, o) for n, s in specs().items() for o in getattr(s, attr))


def reference_method(cfg: Any) -> str:
    """The method whose reference a reference stage (`train-reference`, `score`) serves:
    `mixing.method` when it needs one, else the catalog's method that does."""
    if cfg.mixing.method in with_reference():
        return cfg.mixing.method
    if not with_reference():
        raise KeyError("no method of the catalog needs a reference (doremi/methods/registry.py CATALOG)")
    return with_reference()[0]


def reference_options(cfg: Any) -> Any:
    """The options (`mixing.<name>`) of `reference_method(cfg)`: its reference, the weights the
    reference trains on, the proxy's sampling, the cache, the rounds."""
    return getattr(cfg.mixing, reference_method(cfg))


def options(saved: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Method `name`'s options in a run's saved config (a plain mapping, config.yaml): under
    `mixing.<name>`, or under the section a run written before the catalog kept them in."""
    found = (saved.get("mixing") or {}).get(name)
    moved = spec(name).moved_from if name in specs() else None
    if found is None and moved:
        found = saved.get(moved)
    return dict(found or {})


def __getattr__(attr: str) -> Any:
    """`READS` and `BUILDERS`, derived from the catalog when read (a test may extend CATALOG)."""
    if attr == "READS":
        return {n: s.reads for n, s in specs().items()}
    if attr == "BUILDERS":
        return {n: s.build for n, s in specs().items() if s.build is not None}
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def reads(name: str) -> Reads:
    """Method `name`'s declaration, its validation reads checked (`check_reads`)."""
    if name not in specs():
        raise KeyError(f"method {name!r} declares no reads: it is not in doremi/methods/registry.py CATALOG")
    declared = specs()[name].reads
    check_reads(name, declared)
    return declared


def check_reads(name: str, declared: Reads) -> None:
    """Refuse (MethodSplitError) a declaration that reads validation data other than the dev
    half: a consumer that would read the verdict's test sequences under `dev_test`."""
    from data.store.validation_split import DEV, MethodSplitError, split_for

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
    """Refuse (MethodSplitError) a built method whose `Needs` read more than its spec's `reads`
    declares: validation passes or target batches not declared, or any split other than dev."""
    from data.store.validation_split import MethodSplitError, check_method_split

    declared = reads(name)
    check_method_split(needs.validation_split, name)
    asked = [
        *(["method_probe"] if needs.validation else []),
        *(["method_target"] if needs.alignment is not None else []),
    ]
    extra = [c for c in asked if c not in declared.validation]
    if extra or (needs.alignment is not None and not declared.gradients):
        raise MethodSplitError(
            f"method {name}: reads {', '.join(extra) or 'gradients'} beyond its declaration in its "
            f"spec's reads ({declared.describe()})"
        )


def builder(name: str) -> Builder:
    build = spec(name).build
    if build is None:
        raise KeyError(f"method {name!r} is an offline fit: it does not train (doremi/offline/propose.py runs it)")
    return build


def method_factory(name: str, cfg: Any) -> MethodFactory:
    """The factory the trainer calls with its `MethodContext`."""
    build = builder(name)

    def factory(ctx: MethodContext) -> MixingHook:
        hook = build(cfg, ctx)
        check_needs(name, getattr(hook, "needs", Needs()))
        return hook

    return factory


def preflight(name: str, cfg: Any, domains: list[str]) -> None:
    """Build method `name` for a run of `cfg` over `domains`, without the run, so that what the
    method refuses (a probe schedule longer than the run's rounds, a floor above 1/k) stops a
    pipeline before its first stage rather than after hours of others. A method that needs a
    reference is checked by its stages; one whose builder reads the stores (`preflight_builds`
    off) by its `check` alone."""
    import torch

    from trainer.parallel.context import ParallelContext

    s = specs().get(name)
    if s is None or s.build is None or s.needs_reference:
        return
    if s.check is not None:
        s.check(cfg)
    if not s.preflight_builds:
        return
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
    s.build(cfg, ctx)


__all__ += [
    "OFFLINE",
    "ONLINE",
    "PROXY",
    "moved_sections",
    "names",
    "options",
    "record_keys",
    "record_path",
    "spec",
    "specs",
    "trained",
    "with_reference",
]
