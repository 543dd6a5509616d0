"""The powered DoReMi study, pre-registered in code before any of its runs (issue 34; the costed
design it encodes is ../shared/study-design.md; docs/design.md section 4e).

Everything the verdict depends on is fixed here: the stages' shapes and schedules, the arms,
the endpoint, the rule (alpha, the TOST margin, the minimum detectable effect, power, pairs,
the largest standard error a verdict may have), the guardrail that can void a study, the
calibration plan and the gate that decides, from the calibration's measured noise, how many
pairs the study needs or whether it may start at all. A choice changes only with a measured
reason, written beside it; `experiments/configs/doremi_study.yaml` is checked against this
file by tests/test_study_design.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Shape:
    """A Llama's shape (the `model` keys): width, depth, heads (as many key/value heads) and the
    SwiGLU hidden size."""

    d_model: int
    n_layers: int
    n_heads: int
    ffn_dim: int


@dataclass(frozen=True)
class Schedule:
    """A stage's training: steps of global_batch_size sequences of seq_len tokens, AdamW at peak
    `lr` after `warmup_steps`, decayed by `decay` to min_lr_fraction x lr."""

    steps: int
    global_batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    decay: str = "cosine"
    min_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    @property
    def tokens(self) -> int:
        return self.steps * self.global_batch_size * self.seq_len

    @property
    def min_lr(self) -> float:
        return self.lr * self.min_lr_fraction


@dataclass(frozen=True)
class Stage:
    """One kind of run of the study (reference, proxy or main), its run directories named
    `<arm or stage>-seed<k>`."""

    name: str
    shape: Shape
    schedule: Schedule


#: Reference and proxy: about 13M parameters, 1000 steps x 96 x 1024 = 98M tokens (7.5 tokens
#: per parameter; 8 sequences per domain per step over 12 domains).
SMALL = Shape(d_model=384, n_layers=6, n_heads=6, ffn_dim=1152)
SMALL_SCHEDULE = Schedule(steps=1000, global_batch_size=96, seq_len=1024, lr=1e-3, warmup_steps=100)
#: Main: about 53M parameters, 4400 steps x 32 x 1024 = 144M tokens (about 2.7 tokens per
#: parameter, 14x the first study's optimizer steps), warmup 400 steps (9%).
MAIN = Shape(d_model=640, n_layers=10, n_heads=10, ffn_dim=1792)
MAIN_SCHEDULE = Schedule(steps=4400, global_batch_size=32, seq_len=1024, lr=6e-4, warmup_steps=400)


@dataclass(frozen=True)
class Arm:
    """An arm of the study: its main run's mixture and the stages it needs to find that mixture
    (their compute is the arm's, in the ledger beside its result). A `pooled` arm trains every
    seed on one mixture, the mean of the search stages' weights over all the study's seeds
    (`doremi average PROXY... --out`): its search is every seed's, and so is its compute."""

    name: str
    mixture: str
    search_stages: tuple[str, ...] = ()
    pooled: bool = False


@dataclass(frozen=True)
class Endpoint:
    """The primary endpoint: the mean over domains of the per-domain loss on the test half of
    the validation documents, at the main run's final step (the dev half is all a method may
    read; docs/design.md section 3)."""

    split: str = "test"
    statistic: str = "mean over domains"
    step: str = "final"


@dataclass(frozen=True)
class Rule:
    """The verdict on each arm against `baseline`, paired by seed (doremi/study/stats.py):
    "works" if the mean difference < -t_{1-alpha,n-1} SE, "worse" if > +t_{1-alpha,n-1} SE, else
    "inconclusive"; TOST at +-margin (equivalent: no practically relevant difference); the
    interval reported at `ci_level`. The study is powered for `mde` at `power`; a primary
    difference whose SE exceeds `max_se` is flagged in the table (the issue's acceptance)."""

    baseline: str = "uniform"
    alpha: float = 0.05  # one-sided
    ci_level: float = 0.95
    margin: float = 0.01  # nats, TOST
    mde: float = 0.02  # nats, minimum detectable effect
    power: float = 0.8
    pairs: int = 6  # the design's starting point; the gate sets the study's number
    max_se: float = 0.008  # nats, SE of the primary difference


@dataclass(frozen=True)
class GuardrailRule:
    """A guardrail voids the study only beyond its own noise: the reference's memorisation gap
    (held-out minus seen loss) counts when gap - se_multiple x SE > memorisation_gap
    (doremi/reports/guardrails.py MEMORISATION_SES). Worst domain and domains better are reported with
    their standard errors, not gated."""

    memorisation_gap: float = 0.05
    se_multiple: float = 2.0
    max_epochs: float = 2.0


@dataclass(frozen=True)
class GateStep:
    """Up to this sigma_D, at least `pairs` pairs."""

    max_sigma_d: float
    pairs: int


@dataclass(frozen=True)
class Gate:
    """From the calibration's sigma_D: the design's table (`steps`, at most 0.02 -> 6 pairs, at
    most 0.03 -> 10) gives the fewest pairs; the power rule (pairs for `Rule.mde` at
    `Rule.power`, doremi/study/stats.py pairs_needed) may ask for more; the study goes ahead
    with the larger of the two if it is at most `budget_pairs`, and refuses beyond the last
    step or the budget (then: train longer or shrink the model)."""

    steps: tuple[GateStep, ...] = (GateStep(0.02, 6), GateStep(0.03, 10))
    budget_pairs: int = 10


@dataclass(frozen=True)
class CalibrationPlan:
    """Main runs on the study's exact setting before the study: `arms` x `seeds`, paired by
    seed. `fixed` trains on `fixed_weights` (the first study's published mean DoReMi weights)."""

    arms: tuple[str, ...] = ("uniform", "fixed")
    seeds: tuple[int, ...] = (1, 2, 3, 4)
    fixed_weights: str = "the mean DoReMi weights of experiments/results/doremi_real.md"
    stage: str = "main"


@dataclass(frozen=True)
class Design:
    """The study (issue 34). Arms share train.seed and data.seed within a seed and differ only
    in the mixture; each seed of the DoReMi arm has its own reference and proxy."""

    reference: Stage = Stage("reference", SMALL, SMALL_SCHEDULE)
    proxy: Stage = Stage("proxy", SMALL, SMALL_SCHEDULE)
    main: Stage = Stage("main", MAIN, MAIN_SCHEDULE)
    arms: tuple[Arm, ...] = (
        Arm("uniform", "uniform"),
        Arm("doremi", "the proxy's alpha averaged over all its steps", ("reference", "proxy")),
        Arm("natural", "tokens"),  # token shares of the capped corpus (data/sampling/mixtures.py `tokens`)
        # Added after the study's six pairs were judged (session 11), before any run of it, with
        # a measured reason: the doremi arm's pairs spread sigma_D 0.0507, 6.2x the calibration's
        # fixed-weight pairs, because each seed's search finds other weights (per-seed difference
        # against the weight on c: correlation 0.996). Pooled over the six searches the mixture is
        # one for every seed, so the calibration's fixed-weight gate (GO, 6 pairs) is the one that
        # applies; each seed is charged all six searches (experiments/results/doremi_study.md).
        Arm(
            "doremi_pooled",
            "the doremi arm's averaged alpha, mean over the proxies of all the study's seeds",
            ("reference", "proxy"),
            pooled=True,
        ),
    )
    #: The arm whose difference from the baseline is the study's primary one (the SE the rule's
    #: `max_se` is about). Changed from "doremi" after its six pairs were judged, with the reason
    #: of the doremi_pooled arm above: the gate, fed with the doremi arm's own pairs, said NO-GO
    #: (experiments/results/doremi_study/calibration_doremi/), and the changed setting is the
    #: pooled arm, whose gate is the calibration's fixed-weight one.
    primary: str = "doremi_pooled"
    endpoint: Endpoint = field(default_factory=Endpoint)
    rule: Rule = field(default_factory=Rule)
    guardrails: GuardrailRule = field(default_factory=GuardrailRule)
    calibration: CalibrationPlan = field(default_factory=CalibrationPlan)
    gate: Gate = field(default_factory=Gate)
    #: The reference's mixture: the Pile setting (size-based over the capped corpus), the
    #: paper's for a corpus with natural shares (issue 34: the first study's uniform was not).
    reference_weights: str = "tokens"
    #: DoReMi's hyperparameters, the paper's.
    eta: float = 1.0
    smoothing: float = 1e-3
    #: Pre-registered sensitivity check: alpha averaged over these steps instead of all.
    alpha_sensitivity_steps: tuple[int, int] = (101, 1000)
    validation_fraction: float = 0.05
    #: The verdict's documents: the test half of each domain's validation documents.
    validation_split: str = "dev_test"
    #: Main runs log their final evaluation's per-sequence losses (`train.eval_sequence_losses`),
    #: so that per-domain standard errors can be clustered by document.
    sequence_losses: str = "final"
    deterministic: bool = True

    def stage(self, name: str) -> Stage:
        return {s.name: s for s in (self.reference, self.proxy, self.main)}[name]

    def arm(self, name: str) -> Arm:
        found = {a.name: a for a in self.arms}
        if name not in found:
            raise KeyError(f"design: no arm {name!r} (arms: {', '.join(found)})")
        return found[name]


DESIGN = Design()


def _get(cfg: dict, path: str):
    node = cfg
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def stage_keys(stage: Stage) -> dict[str, object]:
    """The config keys (key path -> value) a run of `stage` must have."""
    s, m = stage.schedule, stage.shape
    return {
        "model.d_model": m.d_model,
        "model.n_layers": m.n_layers,
        "model.n_heads": m.n_heads,
        "model.ffn_dim": m.ffn_dim,
        "train.steps": s.steps,
        "train.global_batch_size": s.global_batch_size,
        "data.seq_len": s.seq_len,
        "train.lr": s.lr,
        "train.min_lr": s.min_lr,
        "train.warmup_steps": s.warmup_steps,
        "train.decay": s.decay,
        "train.weight_decay": s.weight_decay,
        "train.grad_clip": s.grad_clip,
    }


def config_differences(cfg: dict, stage: Stage) -> list[str]:
    """`key got (design want)` for each of `stage_keys` a config (a run's resolved config.yaml,
    or an experiment file's section) does not match; numbers compared to 1e-12 relative."""
    out = []
    for key, want in stage_keys(stage).items():
        got = _get(cfg, key)
        same = (
            isinstance(got, (int, float)) and isinstance(want, (int, float)) and abs(got - want) <= 1e-12 * abs(want)
        ) or got == want
        if not same:
            out.append(f"{key} {got} (design {want})")
    return out


def merged(base: dict, override: dict) -> dict:
    """`base` with `override`'s keys replaced section by section (how pipeline.main applies)."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
