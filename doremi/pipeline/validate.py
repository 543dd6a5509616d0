"""Checks that refuse, before any work, an input that would otherwise be read late or not at all.

`validate_pipeline`: the whole `doremi pipeline` config at start-up, so that an unknown key in
`pipeline.main` or a bad baseline file stops the pipeline before hours of reference and proxy
training, not after: every stage's config as the pipeline builds it (a deep merge of
`pipeline.proxy` / `pipeline.main` over the top level), every weights value it will read, and
every key it would silently override.

`check_stage`: the keys a single stage does not read. `train-reference` trains on
`mixing.<method>.reference_weights` and the proxy of a method that needs a reference samples
`mixing.<method>.proxy_sampling` (<method>: the catalog's one that needs a reference,
doremi/methods/registry.py); a `data.domain_weights` given to them would be saved in their
config.yaml yet never used.
"""

from __future__ import annotations

from typing import Any

from data.errors import DataError
from data.sampling.weights import check_spec
from data.sources.sources import known_domains
from doremi.config import METHODS, OFFLINE_METHODS, ExperimentConfig
from doremi.errors import DoReMiError
from doremi.methods.registry import spec
from doremi.outputs.fingerprint import SAMPLING_KEYS
from doremi.outputs.main_runs import REFERENCE_RUN, main_run_name, online_run_name
from trainer.config.tools import ConfigError

#: The options of the catalog's method that needs a reference: the pipeline sets its reference
#: and the weights that reference trains on.
_REF = f"mixing.{REFERENCE_RUN}"

#: Stage -> (the key it takes its mixture from, what it does with it).
STAGE_WEIGHTS = {
    "train-reference": (f"{_REF}.reference_weights", "trains on"),
    "train-proxy": (f"{_REF}.proxy_sampling", "samples its data from"),
}

#: Keys of `pipeline.proxy` / `pipeline.main` that the pipeline sets itself, and why.
PIPELINE_SETS = {
    "pipeline.proxy": {
        "train.run_dir": "each run's directory is under pipeline.run_dir",
        f"{_REF}.reference": "the proxy reads the reference the pipeline just trained",
        f"{_REF}.reference_weights": f"round 1's reference trains on the top-level {_REF}.reference_weights, "
        "later rounds on the previous round's weights",
        "data.domain_weights": f"the reference trains on {_REF}.reference_weights, the proxy samples "
        f"{_REF}.proxy_sampling",
        "mixing.method": "each proxy runs its method of pipeline.methods",
        "mixing.main": "the proxies run no method on a main model",
    },
    "pipeline.main": {
        "train.run_dir": "each run's directory is under pipeline.run_dir",
        "data.domain_weights": "the main runs train on the methods' weights and on pipeline.baselines",
        "mixing.main": "each online run runs its method of pipeline.online, the others none",
    },
}

#: Top-level keys the pipeline replaces for every stage, and where their value belongs instead.
PIPELINE_TOP_LEVEL = {
    "mixing.method": (METHODS[0], "list the method in pipeline.methods"),
    "mixing.main": (None, "list the method in pipeline.online"),
}

DOMAIN_WEIGHTS_IN_PIPELINE = (
    f"the reference trains on {_REF}.reference_weights, the proxy samples "
    f"{_REF}.proxy_sampling, the main runs train on the methods' weights and on "
    "pipeline.baselines"
)


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_stage(cfg: ExperimentConfig, stage: str) -> None:
    """Refuse `data.domain_weights` in a stage that does not read it (unless it equals the key
    the stage does read, as in a reference's own saved config.yaml), and check that key's
    weights against the domains."""
    if stage == "train-proxy" and not spec(cfg.mixing.method).needs_reference:
        if cfg.data.domain_weights != "uniform":
            raise ConfigError(
                f"data.domain_weights: doremi train-proxy with mixing.method={cfg.mixing.method} does "
                f"not read this key (the method chooses the mixture); got {cfg.data.domain_weights!r}"
            )
        return
    key, verb = STAGE_WEIGHTS[stage]
    used, given = _get(cfg, key), cfg.data.domain_weights
    if given != "uniform" and given != used:
        raise ConfigError(
            f"data.domain_weights: doremi {stage} does not read this key, it {verb} {key}; "
            f"got {given!r} (set {key} instead)"
        )
    check_spec(used, known_domains(cfg.data), key)


def check_online(cfg: ExperimentConfig) -> None:
    """A method online on the main model chooses the data itself: refuse a
    `data.domain_weights` it would record and never read."""
    if cfg.data.domain_weights != "uniform":
        raise ConfigError(
            f"data.domain_weights: doremi train with mixing.main={cfg.mixing.main} does not read "
            f"this key (the method chooses the mixture); got {cfg.data.domain_weights!r}"
        )


def _has(raw: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(raw, dict) or part not in raw:
            return False
        raw = raw[part]
    return True


def _refuse_overridden(raw: dict[str, Any]) -> None:
    """Keys of the pipeline sections that the pipeline replaces, and store-building `data` keys
    there (the pipeline builds one set of stores, from the top-level `data`); top-level keys
    the pipeline replaces (a `mixing.main` that would turn every main run into an online one,
    or that the pipeline would silently drop)."""
    for key, (default, instead) in PIPELINE_TOP_LEVEL.items():
        section, name = key.split(".")
        value = raw.get(section, {}).get(name, default) if isinstance(raw.get(section), dict) else default
        if value != default:
            raise ConfigError(
                f"{key}: doremi pipeline sets this key for each of its runs, so {value!r} would be ignored; {instead}"
            )
    pipeline = raw.get("pipeline") if isinstance(raw.get("pipeline"), dict) else {}
    for section, sets in PIPELINE_SETS.items():
        name = section.split(".")[1]
        over = pipeline.get(name)
        if not isinstance(over, dict):
            continue
        if "pipeline" in over:
            raise ConfigError(
                f"{section}.pipeline: the pipeline section applies to the whole pipeline; set it at the top level"
            )
        for key, why in sets.items():
            if _has(over, key):
                raise ConfigError(
                    f"{section}.{key}: set by the pipeline ({why}), so this value would be ignored; remove it"
                )
        data = over.get("data")
        for key in data if isinstance(data, dict) else ():
            if key not in SAMPLING_KEYS:
                raise ConfigError(
                    f"{section}.data.{key}: the pipeline builds one set of stores, from the "
                    f"top-level data section, so this value would not reach them; set data.{key}"
                )


def _stage(pipe: Any, section: str, **sets: Any) -> ExperimentConfig:
    """The config the pipeline builds for a stage (its own function), errors prefixed by the
    section whose merge caused them: the top level alone already loaded."""
    try:
        return pipe.stage_config(_get(pipe.p, section.split(".")[1]), **sets)
    except (ConfigError, DataError) as e:
        raise type(e)(f"{section}: {e}") from None


def _check_sweep(cfg: ExperimentConfig, section: str, domains: list[str]) -> None:
    """The sweep the offline methods share: its design keys and prior (which otherwise fail only
    when the sweep stage starts, after the DoReMi stages); stacked runs need one process per run."""
    from doremi.offline.sweep import check_design_keys

    try:
        check_design_keys(cfg, len(domains))
        if "dirichlet" in cfg.sweep.designs:
            check_spec(cfg.sweep.prior, domains, "sweep.prior")
    except (ConfigError, DataError, DoReMiError) as e:
        raise type(e)(f"{section}: {e}") from None
    p = cfg.parallelism
    if cfg.sweep.stacked and (p.tp, p.pp, p.dp) != (1, 1, 1):
        raise ConfigError(
            f"{section}: sweep.stacked: stacked runs train at tp = pp = dp = 1; got tp={p.tp}, pp={p.pp}, "
            f"dp={p.dp} (or set sweep.stacked: false)"
        )


def _check_methods(pipe: Any, domains: list[str] | None) -> None:
    """Each method of `pipeline.methods` (as a proxy) and `pipeline.online` (on the main model)
    built for the run it will get, its errors prefixed by the section whose run it is."""
    from doremi.methods.registry import preflight

    if domains is None:  # domains known only from the stores, which are not built yet
        return
    for section, key, names in (
        ("pipeline.proxy", "method", pipe.p.methods),
        ("pipeline.main", "main", pipe.p.online),
    ):
        for name in names:
            if name in OFFLINE_METHODS:
                _check_sweep(_stage(pipe, section, sweep__run_dir=str(pipe.root / "sweep")), section, domains)
                continue
            cfg = _stage(pipe, section, train__run_dir=str(pipe.root / "preflight"), **{f"mixing__{key}": name})
            try:
                preflight(name, cfg, domains)
            except (ConfigError, DataError) as e:
                raise type(e)(f"{section}: {e}") from None


def _ref_sets(**options: Any) -> dict[str, Any]:
    """`stage_config` sets of the reference method's options (`mixing__<name>__<option>`)."""
    return {f"mixing__{REFERENCE_RUN}__{k}": v for k, v in options.items()}


def validate_pipeline(pipe: Any) -> None:
    """Everything `doremi pipeline` will read, checked before its first stage (see module doc).
    `pipe` is a `doremi.pipeline.pipeline.Pipeline` with its raw and top-level configs loaded."""
    cfg, p = pipe.cfg, pipe.p
    _refuse_overridden(pipe.raw)
    if cfg.data.domain_weights != "uniform":
        raise ConfigError(
            f"data.domain_weights: doremi pipeline does not read this key "
            f"({DOMAIN_WEIGHTS_IN_PIPELINE}); got {cfg.data.domain_weights!r}: remove it"
        )
    rdir = pipe.root / "round1"
    ref_weights = getattr(cfg.mixing, REFERENCE_RUN).reference_weights
    sets = _ref_sets(reference_weights=ref_weights)
    _stage(pipe, "pipeline.proxy", train__run_dir=str(rdir / "reference"), **sets)
    sets = _ref_sets(reference=str(rdir / "reference"), reference_weights=ref_weights)
    proxy = _stage(pipe, "pipeline.proxy", train__run_dir=str(rdir / "proxy"), **sets)
    _stage(pipe, "pipeline.main", train__run_dir=str(pipe.root / "main" / "uniform"), data__domain_weights="uniform")
    domains = known_domains(cfg.data)
    _check_methods(pipe, domains)
    check_spec(ref_weights, domains, f"{_REF}.reference_weights")
    in_proxy = _has(p.proxy, f"{_REF}.proxy_sampling")
    check_spec(
        getattr(proxy.mixing, REFERENCE_RUN).proxy_sampling,
        domains,
        f"pipeline.proxy.{_REF}.proxy_sampling" if in_proxy else f"{_REF}.proxy_sampling",
    )
    taken: dict[str, str] = {REFERENCE_RUN: f"{REFERENCE_RUN}'s own run"}
    taken.update({m: f"pipeline.methods' {m} run" for m in p.methods if m != REFERENCE_RUN})
    taken.update({online_run_name(m): f"pipeline.online's {m} run" for m in p.online})
    for i, b in enumerate(p.baselines):
        where = f"pipeline.baselines[{i}]"
        name = main_run_name(b)
        if name in taken:
            raise ConfigError(
                f"{where}: main run name {name!r} (the file's stem) is taken by {taken[name]}; got {b!r} (rename the file)"
            )
        taken[name] = where
        check_spec(b, domains, where)
