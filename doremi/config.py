"""The `mixing`, `sweep`, `fit` and `pipeline` sections, and `ExperimentConfig`: the trainer's
sections plus these. `mixing` has a section per method of the catalog (doremi/methods/registry.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, make_dataclass
from typing import Any, ClassVar, Literal

from data.config import PathOrName, PathStr, Weights
from doremi.methods import registry
from doremi.methods.spec import OFFLINE, ONLINE, PROXY
from trainer.config.schema import TrainerConfig, apply_preset
from trainer.config.tools import ConfigError, apply_overrides, from_dict, read_yaml

#: The catalog's methods by role (doremi/methods/registry.py): proxies (`mixing.method`), online on
#: the main model (`mixing.main`), and the offline fits of a sweep of small runs
#: (doremi/offline/sweep.py, doremi/offline/propose.py; `pipeline.methods` only).
METHODS = registry.names(PROXY)
ONLINE_METHODS = registry.names(ONLINE)
OFFLINE_METHODS = registry.names(OFFLINE)


@dataclass
class MixingChoice:
    """Which data-mixing method a run uses, and each method's options: one section per method of
    the catalog (doremi/methods/registry.py), `mixing.<name>`."""

    # The method `doremi train-proxy` runs; `doremi average` turns its per-step weights into a mixture.
    method: Literal[METHODS] = METHODS[0]  # type: ignore[valid-type]
    # The method `doremi train` runs online on the main model; None: the main model trains on
    # data.domain_weights.
    main: Literal[ONLINE_METHODS] | None = None  # type: ignore[valid-type]


def _mixing_config() -> type:
    """`MixingChoice` with a section per trained method of the catalog, `mixing.<name>` of the
    method's config dataclass (documented by that dataclass's docstring)."""
    sections = [
        (name, spec.config, field(default_factory=spec.config))
        for name, spec in registry.specs().items()
        if spec.config is not None
    ]
    doc = MixingChoice.__doc__
    return make_dataclass(
        "MixingConfig", sections, bases=(MixingChoice,), namespace={"__doc__": doc, "__module__": __name__}
    )


MixingConfig = _mixing_config()


@dataclass
class SweepConfig:
    """`doremi sweep`: a small run on each of many designed mixtures, the data of the offline
    methods (RegMix, Data Mixing Laws; doremi/offline/sweep.py, doremi/offline/fit/)."""

    # The sweep's directory: its tables (mixtures.csv, losses.csv, final.csv) and sweep.json.
    run_dir: PathStr = "runs/sweep"
    # The designs, concatenated in this order: `dirichlet` (around `prior`), `grid` (weights in
    # multiples of 1 / grid_steps), `one_hot`, `smoothed_one_hot`.
    designs: list[Literal["dirichlet", "grid", "one_hot", "smoothed_one_hot"]] = field(
        default_factory=lambda: ["dirichlet"]
    )
    # Mixtures the Dirichlet design draws.
    runs: int = 64
    # The Dirichlet design's centre: a mixture (`tokens`, `uniform`, `temperature:T`, a file, values).
    prior: Weights = "tokens"
    # Range [low, high] of the Dirichlet concentration, drawn log-uniformly per mixture (RegMix: 0.1 to 5).
    concentration: list[float] = field(default_factory=lambda: [0.1, 5.0])
    # The prior raised to this power before the draw (RegMix tempers the token distribution by 0.5).
    temperature: float = 1.0
    # A mixture with a nonzero weight below this is drawn again.
    min_weight: float = 0.0
    # No run reads a domain more than this many epochs, counted as a run reads them: weights
    # capped at (max_epochs x pool - 1) / (steps x batch), the pool being the domain's train
    # sequences less the holdout (doremi/offline/sweep.py sequence_caps); None: no cap.
    max_epochs: float | None = None
    # The grid design's resolution.
    grid_steps: int = 4
    # The smoothed one-hot design: 1 - eps on one domain, eps spread over the others.
    one_hot_eps: float = 0.1
    # Seed of the Dirichlet draws.
    seed: int = 0
    # Train the runs stacked, many small models in one process (tp = pp = dp = 1, trainer/stacked/),
    # or one by one with the ordinary trainer; the losses agree to rounding.
    stacked: bool = True
    # Stacked runs trained at once.
    chunk_size: int = 16
    # Evaluations along each run, every ceil(train.steps / eval_points) steps and at the last
    # (train.eval_every does not apply to sweep runs): the points of the step law that data
    # mixing laws extrapolate each run's losses by (fit.mixing_law, doremi/methods/mixing_law/nested.py).
    eval_points: int = 10

    def validate(self, path: str = "sweep") -> None:
        if self.runs < 1:
            raise ConfigError(f"{path}.runs: expected >= 1, got {self.runs}")
        lo_hi = self.concentration
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1] < float("inf"):
            raise ConfigError(f"{path}.concentration: expected [low, high] with 0 < low <= high, got {lo_hi}")
        if not self.designs:
            raise ConfigError(f"{path}.designs: expected at least one design, got none")
        if self.max_epochs is not None and not 0 < self.max_epochs < float("inf"):
            raise ConfigError(f"{path}.max_epochs: expected a finite value > 0, got {self.max_epochs}")
        if not 0 <= self.min_weight < 1:
            raise ConfigError(f"{path}.min_weight: expected a value in [0, 1), got {self.min_weight}")
        if self.eval_points < 1:
            raise ConfigError(f"{path}.eval_points: expected >= 1, got {self.eval_points}")
        if self.grid_steps < 1 or self.chunk_size < 1:
            raise ConfigError(f"{path}.grid_steps/chunk_size: expected >= 1, got {self.grid_steps}/{self.chunk_size}")
        if not 0 <= self.one_hot_eps < 1:
            raise ConfigError(f"{path}.one_hot_eps: expected a value in [0, 1), got {self.one_hot_eps}")


@dataclass
class MixingLawFitConfig:
    """Data mixing laws (Ye et al. 2025; doremi/methods/mixing_law/): how the sweep's
    losses become the losses the mixing law is fitted to."""

    # `authors`: the released pipeline, each run's losses extrapolated by a step law to the main
    # run's tokens (and by a size law to its size, given 3 or more proxy sizes; a sweep has one)
    # before the law is fitted with the authors' Huber loss. `direct`: the law fitted to the
    # sweep's own final losses by least squares and applied unchanged to the main run.
    variant: Literal["authors", "direct"] = "authors"
    # The step law fits each run's evaluations from this fraction of its last one's tokens on
    # (the authors: steps 10k-30k).
    step_from: float = 0.3
    # The step law's held-out check: the last evaluations of each run it predicts unseen (the
    # authors hold out 5).
    step_holdout: int = 2

    def validate(self, path: str = "fit.mixing_law") -> None:
        if not 0 <= self.step_from < 1:
            raise ConfigError(f"{path}.step_from: expected a value in [0, 1), got {self.step_from}")
        if self.step_holdout < 0:
            raise ConfigError(f"{path}.step_holdout: expected >= 0, got {self.step_holdout}")


@dataclass
class FitConfig:
    """`doremi fit` and the pipeline's offline methods: how a sweep's table becomes a mixture
    (doremi/offline/propose.py; the fits in doremi/methods/regmix/ and doremi/methods/mixing_law/)."""

    # The loss the mixture minimises: sum_i w_i L_i over the domains' validation losses, with w
    # this mixture form (`uniform`: the mean over domains; a mapping of every domain to its
    # weight, e.g. code 1 and the others 0: one domain).
    target: Weights = "uniform"
    # RegMix's regressor: gradient-boosted trees (`lightgbm`, the paper's; needs a sweep of at
    # least 40 runs, two leaves of 20) or `ridge` (linear; at least as many runs as domains).
    regressor: Literal["lightgbm", "ridge"] = "lightgbm"
    # RegMix: mixtures simulated around the sweep's prior ...
    simulations: int = 100_000
    # ... and how many with the best predicted loss are averaged into the proposal.
    top_k: int = 128
    # The proposal reads no domain more than this many epochs in the main run (in `doremi
    # pipeline`, pipeline.main's; with `doremi fit`, this config's), counted as that run reads
    # them: sequences over its pools, as sweep.max_epochs; None: no cap.
    max_epochs: float | None = None
    # Folds of the held-out evaluation (rank correlation and error on runs the fit did not see).
    folds: int = 5
    # Seed of the folds and the simulations.
    seed: int = 42
    # Data mixing laws' pipeline (`--method mixing_law`).
    mixing_law: MixingLawFitConfig = field(default_factory=MixingLawFitConfig)

    def validate(self, path: str = "fit") -> None:
        if self.simulations < 1 or not 1 <= self.top_k <= self.simulations:
            raise ConfigError(
                f"{path}.top_k: expected 1 <= top_k <= simulations = {self.simulations}, got {self.top_k}"
            )
        if self.max_epochs is not None and not 0 < self.max_epochs < float("inf"):
            raise ConfigError(f"{path}.max_epochs: expected a finite value > 0, got {self.max_epochs}")
        if self.folds < 2:
            raise ConfigError(f"{path}.folds: expected >= 2, got {self.folds}")


@dataclass
class GuardrailConfig:
    """Thresholds of the per-domain checks of doremi/reports/guardrails.py (docs/design.md section 4b).

    A run outside them still finishes; its verdict is then about its regime (memorised tiny
    domains, a sampler that skipped a domain, a proxy far behind its reference), not about the
    mixture, so the report says so (or `pipeline.strict` stops before the main runs)."""

    # Epochs of a domain's train split read by one run.
    max_epochs: float = 2.0
    # |realised - nominal| share of the sequences drawn; None: 1 / train.global_batch_size.
    mixture_tolerance: float | None = None
    # Reference: heldout_loss - seen_loss (nats/token) at its final evaluation.
    memorisation_gap: float = 0.1
    # Proxy: its final validation loss minus the reference's (nats/token).
    proxy_lag: float = 0.1
    # Proxy: spread of the domains' mean lambda over the per-step noise of lambda, times
    # sqrt(steps) (the noise of the sum that alpha follows; guardrails.run_level_snr).
    lambda_snr: float = 2.0
    # Proxy: share of steps where one domain's weight is above 0.5.
    concentration: float = 0.5
    # Main runs: final minus best validation loss (nats/token).
    overfit: float = 0.02
    # Offline fits (regmix, mixing_law): the lowest K-fold held-out Spearman rank correlation
    # whose proposal a main run trains on; below it the pipeline stops (-1: any fit, even one
    # too small to check). 0.3: a weak correlation, below which the fit ranks unseen mixtures
    # little better than chance and its optimum is the noise's.
    min_fit_spearman: float = 0.3

    def validate(self, path: str = "pipeline.guardrails") -> None:
        for name in ("max_epochs", "mixture_tolerance", "memorisation_gap", "proxy_lag", "lambda_snr", "overfit"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < float("inf"):
                raise ConfigError(f"{path}.{name}: expected a finite value >= 0, got {v}")
        if not 0 <= self.concentration <= 1:
            raise ConfigError(f"{path}.concentration: expected a value in [0, 1], got {self.concentration}")
        if not -1 <= self.min_fit_spearman <= 1:
            raise ConfigError(f"{path}.min_fit_spearman: expected a value in [-1, 1], got {self.min_fit_spearman}")


@dataclass
class PipelineConfig:
    """`doremi pipeline`: where the stages write, and what the main runs change."""

    # The pipeline's directory: one subdirectory per stage, the report and the weights.
    run_dir: PathStr = "runs/experiment"
    # Overrides (same shape as the experiment file) applied to the reference and proxy runs.
    proxy: dict[str, Any] = field(default_factory=dict)
    # Overrides applied to the main runs (typically a larger model, more steps).
    main: dict[str, Any] = field(default_factory=dict)
    # Mixing methods of the catalog (doremi/methods/registry.py), each giving a mixture for a main
    # run of its name: a proxy (under methods/<name>/; one that needs a reference trains it first,
    # under reference/, proxy/ and rounds), or an offline fit of one shared sweep of small runs
    # (sweep/). Default: the catalog's first proxy.
    methods: list[str] = field(default_factory=lambda: list(METHODS[:1]))
    # Searches per proxy method, each on its own seeds (train.seed and data.seed plus 0, 1, ...),
    # under `search<i>/` of the round's or the method's directory; the method's weights are the
    # mean of the searches' averaged weights (`doremi average RUN ... --out`). One search's
    # weights vary by seed: in the DoReMi study (experiments/results/doremi_study.md) they moved
    # the main model's loss by 0.12 nats from seed to seed, against 0.013 on one mixture pooled
    # over six searches. k searches cost k times one.
    searches: int = 1
    # Mixing methods run online on the main model, each a main run `<name>-online`.
    online: list[str] = field(default_factory=list)
    # Mixtures the main runs train on besides the methods': `uniform`, `tokens`, `temperature:T`,
    # `unimax:E`, or weight JSON paths.
    baselines: list[PathOrName] = field(default_factory=lambda: ["uniform", "tokens"])
    # Skip the main runs (only tune the weights).
    skip_main: bool = False
    # Thresholds of the checks that qualify the verdict (GuardrailConfig).
    guardrails: GuardrailConfig = field(default_factory=GuardrailConfig)
    # Stop with status 2 before the main runs when a guardrail warns about the reference or proxy.
    strict: bool = False

    def validate(self, path: str = "pipeline") -> None:
        for key, allowed in (("methods", METHODS + OFFLINE_METHODS), ("online", ONLINE_METHODS)):
            names = getattr(self, key)
            for i, m in enumerate(names):
                if m not in allowed:
                    raise ConfigError(f"{path}.{key}[{i}]: expected one of {', '.join(allowed)}, got {m!r}")
                if names.index(m) != i:
                    raise ConfigError(f"{path}.{key}[{i}]: {m!r} is listed twice")
        for i, b in enumerate(self.baselines):
            if not isinstance(b, str):
                raise ConfigError(f"{path}.baselines[{i}]: expected a name or a path, got {b!r}")
        if isinstance(self.searches, bool) or not isinstance(self.searches, int) or self.searches < 1:
            raise ConfigError(f"{path}.searches: expected an int >= 1, got {self.searches!r}")


@dataclass
class ExperimentConfig(TrainerConfig):
    """An experiment file: the trainer's sections, `mixing`, `sweep`, `fit` and `pipeline`."""

    #: Sections a method's options were written under before the catalog (`MethodSpec.moved_from`)
    #: -> where they are now: a file that still writes one is refused with the new key
    #: (trainer.config.tools.from_dict), and run records name the keys by their old path so that
    #: a run recorded before the move keeps its fingerprint (trainer.records.run_dir.record_keys).
    MOVED: ClassVar[dict[str, str]] = registry.moved_sections()
    #: The methods' options that may name a file or run directory (trainer.records.run_dir.path_keys)
    #: and those that change no run's results (its record leaves them out), by record path.
    RECORD_PATH_KEYS: ClassVar[tuple[str, ...]] = registry.record_keys("path")
    RECORD_IGNORES: ClassVar[tuple[str, ...]] = registry.record_keys("bookkeeping")

    mixing: MixingConfig = field(default_factory=MixingConfig)  # type: ignore[valid-type]
    sweep: SweepConfig = field(default_factory=SweepConfig)
    fit: FitConfig = field(default_factory=FitConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)


def upgrade_saved(raw: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config.yaml written before the catalog moved a method's options
    (`ExperimentConfig.MOVED`), with those options where they are now: a finished run is read as
    it was written, while a file a user writes with the old section is refused."""
    out = dict(raw)
    for old, new in ExperimentConfig.MOVED.items():
        if old in out:
            section, _, name = new.partition(".")
            out[section] = {**(out.get(section) or {}), name: out.pop(old)}
    return out


def load_saved_config(path: str | os.PathLike, overrides: list[str] | None = None) -> ExperimentConfig:
    """A run's saved config (`upgrade_saved`), `--set` overrides applied, as `load_config` reads a file."""
    raw = apply_overrides(upgrade_saved(read_yaml(path)), overrides or [])
    apply_preset(raw)
    return from_dict(ExperimentConfig, raw)
