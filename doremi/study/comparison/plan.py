"""The comparison's stages, each with its price and its FLOPs, before any run
(docs/design.md section 4f; the commands: experiments/launch/comparison.py).

Per seed and arm: the search stages (a reference and a proxy for a method that reads one, a
proxy and its average for the other transferred methods, the seed's sweep and a fit for a swept
one) and the main run; per seed and equal-compute baseline, its runs at the larger multiples.
Stage groups run in the protocol's `order`, each over every seed. A reused arm's stages are
listed (they are the study's) but priced outside the comparison's total: they are not rerun.

FLOPs are the ledger's (doremi/reports/ledger.py `train_flops`, `forward_flops`: training, a
reference's forward, a target batch, validation passes; a sweep's evaluations, which its fit
reads), planned from the stages' shapes; the equal-compute multiple of an arm is
1 + its search FLOPs / a plain main run's (doremi/study/comparison/cost.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from doremi.study.comparison.cost import classify, compute_multiple
from doremi.study.comparison.price import Price, run_price
from doremi.study.comparison.protocol import (
    ONLINE,
    STATIC,
    SWEPT,
    TRANSFERRED,
    Arm,
    Protocol,
    arm_stage,
    corpus_capacity,
    multiple_stage,
)
from doremi.study.design import Stage

SEARCH, MAIN = "search", "main"

#: Why the plan trains main runs one by one, although the arms of one seed share initialisation
#: and data streams and could in principle be stacked in one process (trainer/stacked/, read for
#: this; nothing measured): what the stacked trainer lacks for it, and what is known of its speed.
STACKED_MAIN_RUNS = (
    "The stacked trainer (trainer/stacked/) lacks, for main runs:",
    "(1) evaluation: it evaluates the dev half only (consumer sweep_run), not the verdict's test half, logs no "
    "per-sequence losses for clustered standard errors and no memorisation holdout, and writes no run directory "
    "(metrics.jsonl, config.yaml, run.json, pairing.json) for doremi study summarize to read;",
    "(2) checkpoint and resume: none, a stopped chunk starts again, while M stacked main runs of 240 s each "
    "outlast a 600-s device call unless stacking is about M times faster;",
    "(3) per-model mixtures: static ones only (one sampler per mixture), not capped ahead of the run by "
    "data.max_epochs (its samplers stop a domain at the cap, but spread the rest otherwise than an ordinary run's "
    "sequence_capped mixture) and without any method's hook, so online arms cannot stack;",
    "(4) determinism and equality: deterministic kernels are honoured, but a stacked model equals its ordinary run "
    "to fp32 rounding (tests/test_stacked.py, 1e-5 relative) with fp32 parameters where the study's main runs keep "
    "bf16 parameters with fp32 master weights, so a stacked arm would not be bitwise the run the reused uniform, "
    "natural and DoReMi runs are paired with.",
    "Its speed is measured only at 5.26M parameters and 16 x 256 tokens a step (9.77x on an H200, 7.27x on an H100, "
    "experiments/results/gpu_session7/README.md), where one run is launch-bound; at the main shape, 53M parameters "
    "and 32 x 1024 tokens a step, two or three main runs side by side were no faster than one after another "
    "(experiments/results/doremi_study.md, sessions 3 and 6): one run already keeps the GPU busy, so no saving "
    "is assumed.",
)
EQUAL_COMPUTE = "equal_compute"


@dataclass(frozen=True)
class Step:
    """One stage of the plan. `name`: its run directory under the work folder (`<arm>-seed<k>`
    for a main run). `verb`: the `doremi` command (train, train-reference, train-proxy, average,
    sweep, fit). `arms`: the arms it serves (a sweep serves every swept arm). `role`: SEARCH or
    MAIN. `multiple`: a main run's tokens as a multiple of the study's."""

    name: str
    verb: str
    arms: tuple[str, ...]
    seed: int
    group: str
    role: str
    price: Price
    flops: float = 0.0
    multiple: int = 1
    reused: bool = False


def flops_per_token(stage: Stage, vocab_size: int) -> int:
    """Training FLOPs per token of `stage`'s model (trainer/model/flops.py)."""
    from trainer.config.schema import ModelConfig
    from trainer.model.flops import flops_per_token as per_token

    s, m = stage.schedule, stage.shape
    model = ModelConfig(
        vocab_size=vocab_size,
        d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_heads,
        ffn_dim=m.ffn_dim,
        max_seq_len=s.seq_len,
    )
    return per_token(model, s.seq_len)


def _method_options(arm: Arm) -> dict[str, object]:
    prefix = f"mixing.{arm.method}."
    return {o.key[len(prefix) :]: o.value for o in arm.options if o.key.startswith(prefix)}


def run_flops(protocol: Protocol, stage: Stage, arm: Arm | None = None, reference: bool = False) -> float:
    """A run of `stage`'s training FLOPs, with `arm`'s method's overheads: a reference's forward
    (`reference`), its extra trained sequences (the spec's `extra_sequences`: DoGE's target
    batch), its validation passes (`validation_share` of training, a bound)."""
    from doremi.methods import registry
    from doremi.reports.ledger import forward_flops, train_flops

    s = stage.schedule
    fpt = flops_per_token(stage, protocol.corpus.vocab_size)
    flops = train_flops(fpt, s.tokens)
    if reference:
        flops += forward_flops(fpt, s.tokens)
    if arm is not None and arm.method is not None:
        extra = registry.spec(arm.method).extra_sequences
        if extra is not None:
            flops += train_flops(fpt, extra(_method_options(arm), s.global_batch_size) * s.seq_len * s.steps)
        flops += arm.validation_share * train_flops(fpt, s.tokens)
    return flops


def sweep_flops(protocol: Protocol) -> float:
    """The sweep's runs' training and their evaluations on the dev half (about `dev_fraction`
    of the validation tokens: the split is by document)."""
    from doremi.reports.ledger import forward_flops

    sw, c = protocol.sweep, protocol.corpus
    dev = sum(c.validation_tokens) * c.dev_fraction
    per_run = run_flops(protocol, sw.stage) + forward_flops(
        flops_per_token(sw.stage, c.vocab_size), sw.eval_points * dev
    )
    return sw.runs * per_run


def arm_steps(protocol: Protocol, arm: Arm, seed: int) -> list[Step]:
    """The arm's stages for one seed, search first."""
    from doremi.methods import registry

    d = protocol.design
    main = run_flops(protocol, d.main, arm if arm.kind == ONLINE else None)
    ratio = arm.step_ratio if arm.kind == ONLINE else None
    main_step = Step(
        f"{arm.name}-seed{seed}",
        "train",
        (arm.name,),
        seed,
        arm.kind,
        MAIN,
        run_price("main_run", step_ratio=ratio, validation_share=arm.validation_share if arm.kind == ONLINE else 0.0),
        main,
        reused=arm.reused,
    )
    if arm.kind in (STATIC, ONLINE):
        return [main_step]
    if arm.kind == SWEPT:
        fit = Price(arm.fit_seconds.value if arm.fit_seconds else 0.0, arm.fit_seconds.where if arm.fit_seconds else "")
        return [Step(f"sweep-seed{seed}", "fit", (arm.name,), seed, SWEPT, SEARCH, fit), main_step]
    out = []
    proxy_name = f"{arm.name}_proxy"
    if registry.spec(arm.method).needs_reference:
        reference, proxy_name = (
            protocol.design.arm(arm.name).search_stages if arm.reused else ("reference", f"{arm.name}_proxy")
        )
        out.append(
            Step(
                f"{reference}-seed{seed}",
                "train-reference",
                (arm.name,),
                seed,
                TRANSFERRED,
                SEARCH,
                run_price("small_run"),
                run_flops(protocol, d.reference),
                reused=arm.reused,
            )
        )
        proxy_price = run_price("reference_proxy")
        proxy_flops = run_flops(protocol, d.proxy, arm, reference=True)
    else:
        stage = arm_stage(protocol, arm)
        proxy_price = run_price("small_run", step_ratio=arm.step_ratio, validation_share=arm.validation_share)
        proxy_flops = run_flops(protocol, stage, arm)
    name = f"{proxy_name}-seed{seed}"
    out.append(
        Step(name, "train-proxy", (arm.name,), seed, TRANSFERRED, SEARCH, proxy_price, proxy_flops, reused=arm.reused)
    )
    out.append(Step(name, "average", (arm.name,), seed, TRANSFERRED, SEARCH, run_price("average"), reused=arm.reused))
    return out + [main_step]


def plan(protocol: Protocol, seeds: Sequence[int]) -> list[Step]:
    """Every stage of the comparison, group by group (`protocol.order`), seed by seed."""
    swept = tuple(a.name for a in protocol.arms if a.kind == SWEPT)
    by_group: dict[str, list[Step]] = defaultdict(list)
    for seed in seeds:
        for arm in protocol.arms:
            if arm.kind == SWEPT and arm.name == swept[0]:
                sweep = Step(
                    f"sweep-seed{seed}",
                    "sweep",
                    swept,
                    seed,
                    SWEPT,
                    SEARCH,
                    run_price("small_run", runs=protocol.sweep.runs),
                    sweep_flops(protocol),
                )
                by_group[SWEPT].append(sweep)
            by_group[arm.kind].extend(arm_steps(protocol, arm, seed))
        eq = protocol.equal_compute
        for baseline in eq.baselines:
            for m in eq.multiples[1:]:
                by_group[EQUAL_COMPUTE].append(
                    Step(
                        f"{eq.name(baseline, m)}-seed{seed}",
                        "train",
                        (eq.name(baseline, m),),
                        seed,
                        EQUAL_COMPUTE,
                        MAIN,
                        run_price("main_run", multiple=m),
                        run_flops(protocol, multiple_stage(protocol.design.main, m)),
                        multiple=m,
                    )
                )
    return [s for group in protocol.order for s in by_group[group]]


@dataclass(frozen=True)
class ArmCost:
    """One arm's planned cost per seed: search and main GPU-seconds (a shared stage counted in
    each arm it serves), search FLOPs, the equal-compute multiple and how its baseline is got."""

    arm: str
    reused: bool
    search_seconds: float
    main_seconds: float
    search_flops: float
    multiple: float
    how: str
    beyond_corpus: bool
    shared: bool


def arm_costs(protocol: Protocol, steps: Sequence[Step], seed: int) -> list[ArmCost]:
    """Per arm of the protocol, its cost in seed `seed`'s stages."""
    plain = run_flops(protocol, protocol.design.main)
    out = []
    for arm in protocol.arms:
        mine = [s for s in steps if s.seed == seed and arm.name in s.arms]
        search = [s for s in mine if s.role == SEARCH]
        main = [s for s in mine if s.role == MAIN]
        flops = sum(s.flops for s in search) + sum(max(s.flops - plain, 0.0) for s in main)
        multiple = compute_multiple(flops, plain)
        how, beyond = classify(multiple, protocol.equal_compute.multiples, corpus_capacity(protocol))
        out.append(
            ArmCost(
                arm.name,
                arm.reused,
                sum(s.price.seconds for s in search),
                sum(s.price.seconds for s in main),
                flops,
                multiple,
                how,
                beyond,
                any(len(s.arms) > 1 for s in search),
            )
        )
    return out


def total_seconds(steps: Sequence[Step]) -> float:
    """GPU-seconds of the stages the comparison runs (reused ones are the study's)."""
    return sum(s.price.seconds for s in steps if not s.reused)
