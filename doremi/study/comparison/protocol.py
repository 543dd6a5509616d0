"""The comparison of every mixing method (issue 39), pre-registered in code before any of its
runs: which arms, what each arm's search reads and runs, how many pairs, the rule, the sweep,
and how the equal-compute baseline is made (docs/design.md section 4f; the prose and the price:
experiments/notes/COMPARISON.md).

It is the powered DoReMi study (doremi/study/design.py) widened, not a second design: the same
stages' shapes and schedules, the same endpoint, test, TOST margin and guardrails (`Rule` and
`GuardrailRule` imported, not restated), the same corpus, stores, dev/test split and seeds, and
the study's uniform, natural, DoReMi and doremi_pooled runs are this comparison's arms of those
names (reused, never rerun). What it adds, each with its reason beside it:

- arms: the static baselines UniMax and temperature; DoGE, ODM, Aioli and ADO twice, as a proxy
  whose averaged weights train the main run and online on the main run itself (as their authors
  use them); RegMix and data mixing laws, each a fit of a sweep;
- pooled searches (`Arm.pooled`): every transferred arm is pooled as the study's doremi_pooled
  (one average over all the seeds' proxies, every seed's main run on it) and every swept arm
  fits all the seeds' sweeps at once; the study's per-seed doremi is a secondary row outside the
  Holm family. The reason is measured: a mixture searched anew on every seed spread the study's
  pairs to sigma_D 0.0507 (6 pairs detect 0.06 nats, 42 are needed for 0.02), one pooled mixture
  to 0.0056, a fixed mixture's spread (experiments/results/doremi_study.md, sessions 11 and 12).
  Online arms cannot be pooled (the search is the main run); their own pairs go through the
  calibration gate in the table (summary.py `own_gate`), and a NO-GO is flagged, never given seeds;
- each method as its authors run it (`variant: authors` where a method has variants, issue 35),
  except where the study's proxy schedule cannot hold the authors' default: each such option
  is an `Option` naming its reason, and the same default on the main run is kept;
- the sweep's design, capped so that no run reads a domain beyond 2 epochs (`epochs.py`);
- the equal-compute baseline: uniform and natural at 1x (the study's runs) and 2x main-run
  tokens, interpolated per seed (`cost.py`);
- the scope of a guardrail (an arm, not the whole comparison) and a secondary reading for the
  many arms compared with one baseline.

`check` refuses a protocol that breaks its rules (an arm reading the verdict's test half, a
schedule a method cannot run, a reused arm that is not the study's, a sweep beyond 2 epochs):
one line, `ProtocolError`; the plan (plan.py `check_pools`) refuses a pooled arm whose main runs
do not all read its one pool or whose pool is not the gate's seeds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from doremi.study.calibration import GateDecision, decide
from doremi.study.comparison.epochs import capacity_multiple, corpus_multiple, over_the_rule
from doremi.study.comparison.price import Measured
from doremi.study.design import DESIGN, Design, Endpoint, GuardrailRule, Rule, Stage
from doremi.study.runs import StudyError

#: Kinds of arm: a named mixture; a proxy's averaged weights; a method on the main run itself;
#: a fit of a sweep of small runs.
STATIC, TRANSFERRED, ONLINE, SWEPT = "static", "transferred", "online", "swept"
KINDS = (STATIC, TRANSFERRED, ONLINE, SWEPT)


class ProtocolError(StudyError):
    """A protocol that breaks its own rules: one line naming the arm and the rule."""


@dataclass(frozen=True)
class Option:
    """A config key an arm sets, its value and why (`variant: authors` pinned, or a schedule
    the study's proxy cannot run at the default)."""

    key: str
    value: Any
    reason: str

    def set(self) -> str:
        """`key=value` for `doremi ... --set` (the value as JSON, which YAML reads)."""
        return f"{self.key}={json.dumps(self.value)}"


@dataclass(frozen=True)
class Arm:
    """One arm: its main runs are `<name>-seed<k>`. `mixture`: a STATIC arm's named mixture.
    `method`: the catalog's method (doremi/methods/registry.py) of a TRANSFERRED, ONLINE or
    SWEPT arm. `options`: keys set on its proxy (TRANSFERRED), its main run (ONLINE) or its
    sweep's fit (SWEPT). `reused`: the study's arm of this name (its runs are read, not rerun).
    `step_ratio`: the method's measured step time relative to a plain step. `validation_share`:
    its validation passes' FLOPs as a share of its training FLOPs (a bound). `fit_seconds`: the
    host time of a SWEPT arm's fit. `reads`: validation consumers (data/store/validation_split.py
    CONSUMERS) the arm reads beyond those derived from its kind and method. `pooled`: its
    searches of every seed make one mixture (one average of the proxies, one fit of the sweeps),
    on which every seed's main run trains, and each seed is charged all of them (the study's
    doremi_pooled, `Arm(pooled=True)` of doremi/study/design.py). `secondary`: why the arm is
    reported but outside the Holm family and the comparison's question (empty: a primary arm)."""

    name: str
    kind: str
    mixture: str = ""
    method: str | None = None
    options: tuple[Option, ...] = ()
    reused: bool = False
    step_ratio: Measured | None = None
    validation_share: float = 0.0
    fit_seconds: Measured | None = None
    reads: tuple[str, ...] = ()
    pooled: bool = False
    secondary: str = ""

    def sets(self) -> tuple[str, ...]:
        return tuple(o.set() for o in self.options)


@dataclass(frozen=True)
class Corpus:
    """The study's stores (measured, not chosen): per domain the train tokens, the sampler's pool
    of train sequences (less the holdout) and the validation tokens; the tokenizer's vocabulary;
    the share of each domain's validation documents in the dev half (`data.dev_fraction`)."""

    domains: tuple[str, ...]
    train_tokens: tuple[int, ...]
    pools: tuple[int, ...]
    validation_tokens: tuple[int, ...]
    vocab_size: int
    dev_fraction: float
    where: str

    @property
    def natural(self) -> tuple[float, ...]:
        """Token shares (`tokens`, data/sampling/mixtures.py)."""
        total = sum(self.train_tokens)
        return tuple(n / total for n in self.train_tokens)

    @property
    def uniform(self) -> tuple[float, ...]:
        return tuple(1.0 / len(self.domains) for _ in self.domains)


#: The stores every arm trains on: built from `experiments/tools/real_corpus.py --max-bytes
#: 30000000 --cap c=80000000 --cap java=40000000`, BPE 2048, 5% validation (the study's; its
#: manifest is byte-identical in sessions 5 to 7). Pools: a main run's last logged `realised`
#: sequences over its `epochs` (exact integers, the same in every run of the study). Per domain:
#: train tokens, pool sequences, validation tokens (tests/test_comparison_protocol.py reads them
#: back from the archive).
_STORES = (
    ("c", 40612233, 39148, 2113350),
    ("java", 14682680, 13826, 789209),
    ("go", 14376682, 13527, 521264),
    ("elisp", 11882377, 11091, 579831),
    ("tex", 13556433, 12726, 546020),
    ("devicetree", 14041192, 13200, 805974),
    ("hol", 11898301, 11107, 516434),
    ("docs", 11957789, 11165, 570577),
    ("dictionary", 11754061, 10966, 614370),
    ("email", 13373088, 12547, 669759),
    ("handbook", 13220444, 12398, 765633),
    ("prose", 7146528, 6467, 298096),
)
CORPUS = Corpus(
    domains=tuple(r[0] for r in _STORES),
    train_tokens=tuple(r[1] for r in _STORES),
    pools=tuple(r[2] for r in _STORES),
    validation_tokens=tuple(r[3] for r in _STORES),
    vocab_size=2048,
    dev_fraction=0.5,
    where=(
        "experiments/results/doremi_study/study.tar.xz: study/session-7/stores-manifest.json (tokens); "
        "study/uniform-seed1/metrics.jsonl, last row, realised sequences / epochs (pools)"
    ),
)


# -- the methods' measured step cost (issue 35: method_bench.py, 1B, 8 x 2048 tokens a step) ----------
# A ratio measured at 1B is applied at 13M and 53M: not measured at these shapes, where a method's
# host-side work per step weighs more.

_BENCH = "issue 35, method_bench.py 1b, every method in one run on one H100 (experiments/results/gpu_session15)"
STEP_RATIOS: dict[str, Measured] = {
    "doge": Measured(0.784, _BENCH + ": the one pass (`doge_one_pass`)"),
    "odm": Measured(0.984, _BENCH),
    "aioli": Measured(1.002, _BENCH + ": the training step, its validation passes apart"),
    "ado": Measured(0.999, _BENCH),
}

#: A fit's host time: `doremi fit` is a process like `average` (price.STAGE_TIMES, 6 s) plus the fit,
#: measured on the development machine's CPU (2 cores) on a synthetic 64-run, 12-domain sweep: RegMix
#: 6 LightGBM fits (5 held-out folds and the final one) and the top-128 of 100,000 simulations
#: 4.0 s, the mixing law 6 fits of 12 domains 2.2 s (the nested step-law fits not included).
_FIT_WHERE = "6 s of a doremi process (the average stage's) + the fit on the development CPU, synthetic sweep"
FIT_SECONDS: dict[str, Measured] = {
    "regmix": Measured(10.0, _FIT_WHERE),
    "mixing_law": Measured(8.2, _FIT_WHERE),
}


def _authors(method: str) -> Option:
    return Option(
        f"mixing.{method}.variant",
        "authors",
        "the released code's algorithm and defaults (issue 35); the default, pinned so a later default cannot "
        "change this protocol",
    )


def doge_one_pass() -> Option:
    """DoGE's step as one forward and backward (trainer/run/group_grads.py), pinned: the default
    (`one_pass: null`) takes it at these layouts, and a later default must not change the
    protocol's cost. The same update as the k passes to fp32 rounding (tests/test_doge_one_pass.py)."""
    return Option(
        "mixing.doge.one_pass",
        True,
        "every domain's gradient and the target's from one forward and backward: the k-pass step's update, "
        "0.784 of a plain step at 1B against its 0.484 (experiments/results/gpu_session15)",
    )


def aioli_proxy_rounds(design: Design = DESIGN) -> Option:
    """Aioli's rounds for a proxy of `design.proxy`'s schedule. Its default, 20 rounds with 4 sweeps
    of 4-step probes per domain (their 2-domain script's), probes 12 x 4 x 4 = 192 steps a round:
    on the main run's 4400 steps the rounds are 220 steps long, on the proxy's 1000 they would be
    50 and the method refuses (rounds shorter than their probes). The proxy keeps the main run's
    round length instead: the most rounds whose rounds are at least that long."""
    from doremi.methods.aioli.config import AioliConfig
    from doremi.methods.aioli.method import round_length

    d = AioliConfig()
    main_round = round_length(design.main.schedule.steps, d.rounds, d.round_steps)
    rounds = max(1, design.proxy.schedule.steps // main_round)
    return Option(
        "mixing.aioli.rounds",
        rounds,
        f"the default {d.rounds} rounds give {design.proxy.schedule.steps // d.rounds}-step rounds on the proxy's "
        f"{design.proxy.schedule.steps} steps, shorter than their {len(CORPUS.domains) * d.sweeps * d.delta} probe "
        f"steps (refused); {rounds} keeps the main run's {main_round}-step rounds",
    )


def ado_proxy_schedule(design: Design = DESIGN) -> tuple[Option, Option]:
    """ADO's warm-up and refit interval for a proxy of `design.proxy`'s schedule. The authors'
    1000 and 1000 steps fit four times in the main run's 4400 steps (after steps 1001, 2001, 3001
    and 4001), but never in the proxy's 1000 (the warm-up is the whole run: the proxy would log
    the natural mixture throughout). Both are scaled by proxy steps / main steps, to a multiple of
    `record_every`, so the proxy refits as often, at the same fractions of its run."""
    from doremi.methods.ado.config import ADOConfig

    d = ADOConfig()
    ratio = Fraction(design.proxy.schedule.steps, design.main.schedule.steps)

    def scaled(value: int) -> int:
        return max(d.record_every, round(value * ratio / d.record_every) * d.record_every)

    why = (
        f"the authors' {{}} of {{}} steps leave the proxy's {design.proxy.schedule.steps} steps unfitted; "
        f"scaled by {design.proxy.schedule.steps}/{design.main.schedule.steps} to a multiple of record_every "
        f"({d.record_every})"
    )
    return (
        Option("mixing.ado.warmup", scaled(d.warmup), why.format("warm-up", d.warmup)),
        Option("mixing.ado.refit_every", scaled(d.refit_every), why.format("refit interval", d.refit_every)),
    )


def ado_refits(steps: int, warmup: int, refit_every: int) -> int:
    """Refits of ADO's `authors` variant in a run of `steps` steps: after every step t with
    t - 1 >= warmup and (t - 1) a multiple of refit_every (doremi/methods/ado/method.py)."""
    return sum(1 for t in range(1, steps + 1) if t - 1 >= warmup and (t - 1) % refit_every == 0)


#: Why the study's per-seed DoReMi arm is reported but not judged for the comparison's question.
PER_SEED_DOREMI = (
    "per-seed search, underpowered by design: sigma_D 0.0507 (6 pairs detect 0.06 nats; 42 needed for 0.02); "
    "the comparison's DoReMi is doremi_pooled"
)


def _arms(design: Design) -> tuple[Arm, ...]:
    from doremi.methods.aioli.config import AioliConfig

    aioli_share = AioliConfig().eval_budget
    study = {a.name: a for a in design.arms}
    out = [
        # The study's arms, reused: the same runs, stores and configs (tests/test_comparison_protocol.py).
        Arm("uniform", STATIC, mixture=study["uniform"].mixture, reused=True),
        Arm("natural", STATIC, mixture=study["natural"].mixture, reused=True),
        # DoReMi as the study judged it after session 11: its six proxies pooled into one mixture
        # (sigma_D 0.0056). The per-seed arm stays as a secondary row (sigma_D 0.0507).
        Arm("doremi_pooled", TRANSFERRED, method="doremi", reused=True, pooled=True),
        Arm("doremi", TRANSFERRED, method="doremi", reused=True, secondary=PER_SEED_DOREMI),
        # UniMax (Chung et al. 2023) at 1 epoch: at the main run's budget every domain's uniform
        # share is within 2 epochs, so `unimax:2` would be uniform itself.
        Arm("unimax", STATIC, mixture="unimax:1"),
        # Temperature sampling at mT5's alpha = 0.3 (Xue et al. 2021), T = 1 / alpha.
        Arm("temperature", STATIC, mixture=f"temperature:{1 / 0.3:.4g}"),
    ]
    for method in ("doge", "odm", "aioli", "ado"):
        variant = (_authors(method),) if method != "odm" else ()  # ODM has one form, the paper's
        variant += (doge_one_pass(),) if method == "doge" else ()
        proxy = {"aioli": (aioli_proxy_rounds(design),), "ado": ado_proxy_schedule(design)}.get(method, ())
        share = aioli_share if method == "aioli" else 0.0
        ratio = STEP_RATIOS[method]
        out.append(
            Arm(
                method,
                TRANSFERRED,
                method=method,
                options=variant + proxy,
                step_ratio=ratio,
                validation_share=share,
                pooled=True,
            )
        )
        out.append(
            Arm(f"{method}_online", ONLINE, method=method, options=variant, step_ratio=ratio, validation_share=share)
        )
    fit_variant = Option(
        "fit.mixing_law.variant",
        "authors",
        "the released nested step-law extrapolation (issue 35; docs/design.md 4d-i)",
    )
    regressor = Option("fit.regressor", "lightgbm", "RegMix's regressor with the authors' settings")
    for method, option in (("regmix", regressor), ("mixing_law", fit_variant)):
        out.append(Arm(method, SWEPT, method=method, options=(option,), fit_seconds=FIT_SECONDS[method], pooled=True))
    return tuple(out)


@dataclass(frozen=True)
class SweepPlan:
    """The sweep of small runs the SWEPT arms fit, one per seed (as DoReMi's reference and proxy
    are), all the seeds' sweeps fitted at once (`Arm.pooled`): 6 x 64 = 384 runs, nearer RegMix's
    own 512 than one seed's 64, and one mixture for every seed's main run, so that its pairs
    spread as a fixed mixture's (the study's pooled DoReMi: sigma_D 0.0056 against 0.0507 per seed).

    Its runs have the study's proxy shape and schedule (`stage`), like every other method's
    search. `runs`: LightGBM's two leaves of 20 need 40 runs, and the 5-fold held-out check fits
    on 4/5 of them, so at least 50; 64 is the framework's default. The design is Dirichlet around
    the natural mixture (RegMix's), capped at the rule's `max_epochs` in the unit a run reads
    (sequences over the sampler's pools, one of slack: doremi/offline/sweep.py `sequence_caps`),
    so no run reads a domain beyond 2 epochs. No one-hot run: at 96,000 sequences a run, no
    domain holds two epochs of them (c, the largest pool, 39,148 sequences, could take 0.82), so
    no exemption is needed.
    One run after another with the ordinary trainer, not stacked: at this shape a stacked chunk of
    4 runs took 129.15 ms a step against 27.82 ms for one run, 4.64 runs' time for 4 (0.86x; one
    H100, `bash experiments/tools/bench/gpu_queue.sh 8`, experiments/results/gpu_session11), and a
    stacked chunk stopped at a deadline starts again where a single run resumes from its
    checkpoint. Stacking is not a result key (doremi/offline/sweep.py NOT_RESULT_KEYS). Every
    fit reads the sweep's dev losses only. A fit whose held-out Spearman is below the pipeline's
    guardrail still trains its main run, and its quality is reported beside it: refusing it would
    drop the method's bad seeds from its own verdict."""

    stage: Stage = DESIGN.proxy
    runs: int = 64
    designs: tuple[str, ...] = ("dirichlet",)
    prior: str = "tokens"
    max_epochs: float = DESIGN.guardrails.max_epochs
    stacked: bool = False
    chunk_size: int = 4
    eval_points: int = 10
    fit_max_epochs: float = DESIGN.guardrails.max_epochs
    fit_target: str = "uniform"

    @property
    def run_sequences(self) -> int:
        return self.stage.schedule.steps * self.stage.schedule.global_batch_size

    def sets(self, seed: int) -> tuple[str, ...]:
        """The sweep's keys for seed `seed` (`sweep.seed`: each seed's sweep draws its own mixtures)."""
        return (
            f"sweep.runs={self.runs}",
            f"sweep.designs={json.dumps(list(self.designs))}",
            f"sweep.prior={self.prior}",
            f"sweep.max_epochs={self.max_epochs}",
            f"sweep.seed={seed}",
            f"sweep.stacked={json.dumps(self.stacked)}",
            f"sweep.chunk_size={self.chunk_size}",
            f"sweep.eval_points={self.eval_points}",
        )

    def fit_sets(self) -> tuple[str, ...]:
        return (f"fit.max_epochs={self.fit_max_epochs}", f"fit.target={self.fit_target}")


@dataclass(frozen=True)
class EqualCompute:
    """The equal-compute view: uniform and natural given an arm's search compute as extra
    main-run tokens. Training a baseline as long as each arm's total compute would take a run per
    arm and seed (a sweep's is about 12 main runs): instead each baseline is trained at
    `multiples` of the main run's tokens per seed (1: the study's run; the others `<name>_x<m>`,
    the same schedule with that many times the steps, warm-up unchanged, evaluated as often
    relatively), and its per-domain final test loss is interpolated per seed in log-log between
    the measured multiples (doremi/study/comparison/cost.py). A multiple beyond the largest
    measured is extrapolated from the last two points and flagged so; one beyond the corpus (no
    mixture can train that long within the 2-epoch rule) is flagged too. The largest multiple is
    the most whole main runs the natural mixture can read within 2 epochs (2.29 on this corpus:
    prose reads 0.87 epochs a main run). Uniform reads prose 1.81 epochs a main run, so its 2x run
    is capped at 2 epochs (data.max_epochs, the excess spread over the other domains) and is
    uniform only up to 1.10x: the view says so. Compute is model FLOPs (trainer/model/flops.py,
    doremi/reports/ledger.py `train_flops_total`: training, a reference's forward, a target
    batch, a method's validation passes; not the periodic evaluations every arm makes alike);
    GPU-seconds are reported beside it, not used."""

    baselines: tuple[str, ...] = ("uniform", "natural")
    multiples: tuple[int, ...] = (1, 2)
    interpolation: str = "log-log linear between the two bracketing measured multiples, per domain, per seed"

    def name(self, baseline: str, multiple: int) -> str:
        """The arm name of a baseline's run at `multiple` (1: the baseline itself)."""
        return baseline if multiple == 1 else f"{baseline}_x{multiple}"


def multiple_stage(stage: Stage, multiple: int) -> Stage:
    """`stage` with `multiple` times its steps (warm-up unchanged)."""
    return replace(
        stage, name=f"{stage.name}_x{multiple}", schedule=replace(stage.schedule, steps=stage.schedule.steps * multiple)
    )


@dataclass(frozen=True)
class Protocol:
    """The comparison. `pairs` comes from the calibration's gate (`pairs_from_calibration`);
    every arm has the same seeds, 1 to pairs, the study's. `guardrail_scope`: a guardrail that
    fails on an arm's own runs (its search or main run) voids that arm; one that fails on a
    baseline's runs voids every arm compared with it. `multiplicity`: with this many arms
    against one baseline, about one in twenty arms with no effect is called "works" or "worse"
    at the rule's one-sided alpha; the table adds Holm's adjustment over the arms as a second
    column (the rule's verdict stays the primary one, as in the study), over the primary arms
    only (`holm_family`: one row per method and form, the secondary per-seed doremi outside it).
    `order`: the stage
    groups in the order they run, each over every seed, so that a budget spent part-way leaves
    whole arms rather than every arm short of pairs."""

    design: Design = DESIGN
    arms: tuple[Arm, ...] = field(default_factory=lambda: _arms(DESIGN))
    corpus: Corpus = CORPUS
    sweep: SweepPlan = field(default_factory=SweepPlan)
    equal_compute: EqualCompute = field(default_factory=EqualCompute)
    validation_split: str = DESIGN.validation_split
    guardrail_scope: str = "arm"
    multiplicity: str = "holm (secondary column)"
    order: tuple[str, ...] = (STATIC, TRANSFERRED, ONLINE, "equal_compute", SWEPT)

    @property
    def rule(self) -> Rule:
        return self.design.rule

    @property
    def guardrails(self) -> GuardrailRule:
        return self.design.guardrails

    @property
    def endpoint(self) -> Endpoint:
        return self.design.endpoint

    def holm_family(self, baseline: str | None = None) -> tuple[str, ...]:
        """The arms Holm's column adjusts over against `baseline` (default the rule's): every
        primary arm but the baseline and the rule's baseline, fixed before the runs (14 at
        equal tokens: natural, unimax, temperature; doremi_pooled, doge, odm, aioli, ado; the
        four online; regmix, mixing_law)."""
        skip = {self.rule.baseline, baseline or self.rule.baseline}
        return tuple(a.name for a in self.arms if not a.secondary and a.name not in skip)

    def arm(self, name: str) -> Arm:
        found = {a.name: a for a in self.arms}
        if name not in found:
            raise KeyError(f"comparison: no arm {name!r} (arms: {', '.join(found)})")
        return found[name]

    def main_sequences(self, multiple: int = 1) -> int:
        s = self.design.main.schedule
        return s.steps * s.global_batch_size * multiple


PROTOCOL = Protocol()


# -- the checks ---------------------------------------------------------------------------------------


def arm_reads(arm: Arm) -> tuple[str, ...]:
    """The validation consumers whose data the arm's choice of mixture reads: its search runs'
    own evaluations (`search_run`) and a sweep's (`sweep_run`), its method's declared reads
    (doremi/methods/registry.py `reads`), and any it declares itself. The main run's evaluation
    (`verdict`) is what the arm is judged on, not what it chooses by."""
    from doremi.methods import registry

    derived: tuple[str, ...] = ()
    if arm.kind == TRANSFERRED:
        derived = ("search_run", *registry.reads(arm.method).validation)
    elif arm.kind == ONLINE:
        derived = registry.reads(arm.method).validation
    elif arm.kind == SWEPT:
        derived = ("sweep_run", *registry.reads(arm.method).validation)
    return tuple(dict.fromkeys((*derived, *arm.reads)))


def check_reads(protocol: Protocol) -> None:
    """Refuse an arm that reads anything but the dev half of the validation documents under the
    protocol's split: the verdict is computed on the test half (docs/design.md 3b)."""
    from data.store.validation_split import DEV, split_for

    for arm in protocol.arms:
        for consumer in arm_reads(arm):
            try:
                half = split_for(consumer, protocol.validation_split)
            except ValueError as e:
                raise ProtocolError(f"arm {arm.name}: {e}") from None
            if half != DEV:
                raise ProtocolError(
                    f"arm {arm.name}: reads validation as {consumer!r}, the {half!r} half under "
                    f"data.validation_split {protocol.validation_split!r}; an arm reads only 'dev' (the verdict is 'test')"
                )


def _option(arm: Arm, key: str, default: Any) -> Any:
    return next((o.value for o in arm.options if o.key == key), default)


def arm_stage(protocol: Protocol, arm: Arm) -> Stage:
    """The stage the arm's method runs in: its proxy's (TRANSFERRED) or the main run (ONLINE)."""
    return protocol.design.proxy if arm.kind == TRANSFERRED else protocol.design.main


def check_schedules(protocol: Protocol) -> None:
    """Refuse a method whose schedule cannot do its work in its stage's steps: Aioli's rounds
    shorter than their probes (the method refuses them itself), ADO never refitting (it would
    run on the natural mixture throughout and log nothing of its own)."""
    from doremi.methods.ado.config import ADOConfig
    from doremi.methods.aioli.config import AioliConfig
    from doremi.methods.aioli.method import round_length

    k = len(protocol.corpus.domains)
    for arm in protocol.arms:
        if arm.kind not in (TRANSFERRED, ONLINE):
            continue
        steps = arm_stage(protocol, arm).schedule.steps
        if arm.method == "aioli":
            d = AioliConfig()
            rounds = _option(arm, "mixing.aioli.rounds", d.rounds)
            rl = round_length(steps, rounds, None)
            if k * d.sweeps * d.delta >= rl:
                raise ProtocolError(
                    f"arm {arm.name}: Aioli's {rounds} rounds of {rl} steps over {steps} cannot hold their "
                    f"{k * d.sweeps * d.delta} probe steps (mixing.aioli.rounds)"
                )
        if arm.method == "ado":
            d = ADOConfig()
            warmup = _option(arm, "mixing.ado.warmup", d.warmup)
            refit = _option(arm, "mixing.ado.refit_every", d.refit_every)
            if ado_refits(steps, warmup, refit) == 0:
                raise ProtocolError(
                    f"arm {arm.name}: ADO's warm-up of {warmup} steps and refits every {refit} never fit in "
                    f"{steps} steps (mixing.ado.warmup, mixing.ado.refit_every)"
                )


def check_reused(protocol: Protocol) -> None:
    """A reused arm is the study's arm of that name, on its mixture, in the same design."""
    if protocol.design is not DESIGN:
        raise ProtocolError("the comparison reuses the study's runs, so its design is the study's (DESIGN)")
    study = {a.name: a for a in DESIGN.arms}
    for arm in protocol.arms:
        if not arm.reused:
            continue
        if arm.name not in study:
            raise ProtocolError(f"arm {arm.name}: reused, but the study has no arm of that name")
        if arm.kind == STATIC and arm.mixture != study[arm.name].mixture:
            raise ProtocolError(
                f"arm {arm.name}: reused with mixture {arm.mixture!r}, the study's is {study[arm.name].mixture!r}"
            )
        if arm.pooled != study[arm.name].pooled:
            raise ProtocolError(
                f"arm {arm.name}: reused with pooled={arm.pooled}, the study's is {study[arm.name].pooled}"
            )
        if arm.options:
            raise ProtocolError(
                f"arm {arm.name}: reused, so it sets nothing the study's did not ({arm.options[0].key})"
            )
    missing = sorted({a.name for a in DESIGN.arms} - {a.name for a in protocol.arms if a.reused})
    if missing:
        raise ProtocolError(f"the study's arms {', '.join(missing)} are not reused (every arm of the study is one)")


def sweep_mixtures(protocol: Protocol, seed: int) -> np.ndarray:
    """The mixtures seed `seed`'s sweep will train ([runs, k]), as `doremi sweep` draws them
    from the sweep's keys and the stores (doremi/offline/sweep.py `design`, its caps
    `sequence_caps` over the corpus's pools)."""
    from doremi.offline.fit.design import dirichlet_design
    from doremi.offline.sweep import sequence_caps

    s, c = protocol.sweep, protocol.corpus
    caps = sequence_caps(c.pools, s.run_sequences, s.max_epochs, c.domains, "sweep.max_epochs")
    return dirichlet_design(c.natural, s.runs, seed=seed, caps=caps).weights


def check_sweep(protocol: Protocol, seeds: tuple[int, ...]) -> None:
    """Every run of every seed's sweep reads each domain at most the rule's epochs (in sequences
    over its pool, one sequence of slack); the design is Dirichlet only (no one-hot run fits)."""
    s, c = protocol.sweep, protocol.corpus
    if s.designs != ("dirichlet",) or s.prior != "tokens":
        raise ProtocolError(
            f"sweep: the design checked here is Dirichlet around tokens, got {s.designs} around {s.prior}"
        )
    for seed in seeds:
        over = over_the_rule(
            sweep_mixtures(protocol, seed), c.domains, c.pools, s.run_sequences, protocol.guardrails.max_epochs
        )
        if over:
            raise ProtocolError(
                f"sweep of seed {seed}: {over[0]} (beyond {protocol.guardrails.max_epochs:g}; sweep.max_epochs)"
            )


def check_equal_compute(protocol: Protocol) -> None:
    """The equal-compute baselines are the reused uniform and natural, measured at 1x (their own
    runs) and at multiples that natural can train unchanged within the 2-epoch rule."""
    eq = protocol.equal_compute
    for b in eq.baselines:
        if not any(a.name == b and a.reused for a in protocol.arms):
            raise ProtocolError(f"equal compute: baseline {b} is not a reused arm of the study")
    if eq.multiples[0] != 1 or list(eq.multiples) != sorted(set(eq.multiples)):
        raise ProtocolError(f"equal compute: multiples {eq.multiples}, expected 1 (the study's runs) and larger ones")
    natural = baseline_capacity(protocol, "natural")
    if max(eq.multiples) > natural:
        raise ProtocolError(
            f"equal compute: {max(eq.multiples)}x main-run tokens reads a domain beyond "
            f"{protocol.guardrails.max_epochs:g} epochs on the natural mixture (at most {natural:.3f}x)"
        )


def check(protocol: Protocol, seeds: tuple[int, ...] = ()) -> None:
    """Every rule of the protocol, before any run (ProtocolError at the first broken one)."""
    if protocol.rule is not DESIGN.rule or protocol.guardrails is not DESIGN.guardrails:
        raise ProtocolError("the comparison judges by the study's rule and guardrails (doremi/study/design.py)")
    unknown = [a.name for a in protocol.arms if a.kind not in KINDS]
    if unknown:
        raise ProtocolError(f"arm {unknown[0]}: kind not one of {', '.join(KINDS)}")
    names = [a.name for a in protocol.arms]
    if len(set(names)) != len(names):
        raise ProtocolError(f"arms named twice: {sorted({n for n in names if names.count(n) > 1})}")
    check_reused(protocol)
    check_reads(protocol)
    check_schedules(protocol)
    check_equal_compute(protocol)
    check_sweep(protocol, seeds)


# -- pairs, from the calibration's gate ------------------------------------------------------------------


def pairs_from_calibration(path: str | Path, design: Design = DESIGN) -> GateDecision:
    """The gate's decision (doremi/study/calibration.py `decide`) recomputed from the committed
    calibration's sigma_D; refused unless it is a final GO equal to the one recorded. Every arm
    then runs seeds 1 to `decision.pairs`, the study's seeds."""
    try:
        doc = json.loads(Path(path).read_text())
        sigma_d, recorded = float(doc["sigma_d"]), doc["decision"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"{path}: not a calibration.json ({e})") from None
    decision = decide(sigma_d, design.gate, design.rule)
    if not decision.go:
        raise ProtocolError(f"{path}: the gate says {decision.line()}")
    if recorded.get("provisional") or not recorded.get("go"):
        why = f"provisional: {recorded['provisional']}" if recorded.get("provisional") else recorded.get("line")
        raise ProtocolError(f"{path}: the recorded decision is not a final GO ({why})")
    if recorded.get("pairs") != decision.pairs:
        raise ProtocolError(
            f"{path}: records {recorded.get('pairs')} pairs, the gate recomputed from sigma_D {sigma_d:.4f} gives {decision.pairs}"
        )
    return decision


def baseline_capacity(protocol: Protocol, baseline: str) -> float:
    """Main runs' worth of sequences `baseline`'s mixture can draw before a domain passes the
    rule's epochs (uncapped: its mixture unchanged)."""
    c = protocol.corpus
    weights = {"uniform": c.uniform, "natural": c.natural}[baseline]
    return capacity_multiple(weights, c.pools, protocol.main_sequences(), protocol.guardrails.max_epochs)


def corpus_capacity(protocol: Protocol) -> float:
    """Main runs' worth of sequences beyond which no mixture is within the rule."""
    return corpus_multiple(protocol.corpus.pools, protocol.main_sequences(), protocol.guardrails.max_epochs)


def largest_multiple(protocol: Protocol) -> int:
    """The largest whole multiple of the main run natural can train unchanged within the rule."""
    return math.floor(baseline_capacity(protocol, "natural"))
