"""The comparison's stages, each with its price and its FLOPs, before any run
(docs/design.md section 4f; the commands: experiments/launch/comparison.py).

Per seed and arm: the search stages (a reference and a proxy for a method that reads one, a
proxy for the other transferred methods, the seed's sweep for a swept one) and the main run;
per pooled arm (protocol.py `Arm.pooled`) one stage over every seed's searches (`doremi average`
of the proxies, `doremi fit` of the sweeps), which every seed's main run reads; the per-seed
doremi arm keeps its proxy's own average. Per seed and equal-compute baseline, its runs at the
larger multiples. Stage groups run in the protocol's `order`, each over every seed: a group's
searches, then its pools, then its main runs. A reused arm's stages are listed (they are the
study's) but priced outside the comparison's total: they are not rerun.

FLOPs are the ledger's (doremi/reports/ledger.py `train_flops`, `forward_flops`: training, a
reference's forward, a target batch, validation passes; a sweep's evaluations, which its fit
reads), planned from the stages' shapes; the equal-compute multiple of an arm is
1 + its search FLOPs / a plain main run's (doremi/study/comparison/cost.py).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from doremi.study.comparison.cost import classify, compute_multiple
from doremi.study.comparison.price import Price, run_price
from doremi.study.comparison.protocol import (
    ONLINE,
    STATIC,
    SWEPT,
    TRANSFERRED,
    Arm,
    Protocol,
    ProtocolError,
    arm_stage,
    corpus_capacity,
    multiple_stage,
)
from doremi.study.design import Stage

SEARCH, MAIN = "search", "main"
RUN_SEED = re.compile(r"-seed\d+$")

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


#: The study's pooled DoReMi directory (experiments/launch/doremi_study.py `POOLED`, held equal
#: by tests/test_comparison_protocol.py): the reused doremi_pooled arm's pool.
STUDY_POOL = "pooled"


@dataclass(frozen=True)
class Step:
    """One stage of the plan. `name`: its run directory under the work folder (`<arm>-seed<k>`
    for a main run). `verb`: the `doremi` command (train, train-reference, train-proxy, average,
    sweep, fit). `arms`: the arms it serves (a sweep serves every swept arm, DoReMi's reference
    and proxy both DoReMi arms). `seed`: 0 for a pool, which belongs to every seed. `role`:
    SEARCH or MAIN. `multiple`: a main run's tokens as a multiple of the study's. `pool`: a
    pool's inputs, the search runs of every seed (`<stage>-seed<k>`). `reads`: the pool a pooled
    arm's main run trains on."""

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
    pool: tuple[str, ...] = ()
    reads: str = ""


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


def pool_name(arm: Arm) -> str:
    """A pooled arm's pool directory: the study's for the reused doremi_pooled, else `<arm>_pooled`."""
    return STUDY_POOL if arm.reused else f"{arm.name}_pooled"


def pool_file(arm: Arm) -> str:
    """The mixture in the pool directory: `doremi average`'s weights.json, `doremi fit`'s <method>.json."""
    return f"{arm.method}.json" if arm.kind == SWEPT else "weights.json"


def sweep_step(protocol: Protocol, seed: int) -> Step:
    """Seed `seed`'s sweep, which every swept arm fits."""
    swept = tuple(a.name for a in protocol.arms if a.kind == SWEPT)
    price = run_price("small_run", runs=protocol.sweep.runs)
    return Step(f"sweep-seed{seed}", "sweep", swept, seed, SWEPT, SEARCH, price, sweep_flops(protocol))


def arm_steps(protocol: Protocol, arm: Arm, seed: int) -> list[Step]:
    """The arm's stages for one seed, search first (a pooled arm's pool is `pool_step`'s)."""
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
        reads=pool_name(arm) if arm.pooled else "",
    )
    if arm.kind in (STATIC, ONLINE):
        return [main_step]
    if arm.kind == SWEPT:
        sweep = sweep_step(protocol, seed)
        if arm.pooled:
            return [sweep, main_step]
        fit = Price(arm.fit_seconds.value if arm.fit_seconds else 0.0, arm.fit_seconds.where if arm.fit_seconds else "")
        return [sweep, Step(sweep.name, "fit", (arm.name,), seed, SWEPT, SEARCH, fit), main_step]
    return transferred_search(protocol, arm, seed) + [main_step]


def transferred_search(protocol: Protocol, arm: Arm, seed: int) -> list[Step]:
    """A TRANSFERRED arm's search stages for one seed: its reference (a method that needs one),
    its proxy, and (unless pooled) the average of that proxy's weights."""
    from doremi.methods import registry

    d = protocol.design
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
    if not arm.pooled:
        out.append(
            Step(name, "average", (arm.name,), seed, TRANSFERRED, SEARCH, run_price("average"), reused=arm.reused)
        )
    return out


def pool_step(protocol: Protocol, arm: Arm, seeds: Sequence[int]) -> Step:
    """A pooled arm's one stage over every seed's searches: `doremi average` of its proxies (the
    study's mechanism) or `doremi fit` of the sweeps (384 runs for 6 seeds), priced as one
    average or as the fit of one 64-run sweep (host time: RegMix's fit measured 0.93 s at 64
    runs and 2.04 s at 384 on the development CPU, experiments/notes/COMPARISON.md)."""
    last = [s for s in arm_steps(protocol, arm, seeds[0]) if s.role == SEARCH][-1]
    stage = RUN_SEED.sub("", last.name)
    if arm.kind == SWEPT:
        m = arm.fit_seconds
        price = Price(m.value if m else 0.0, f"{m.where if m else ''}; a 64-run sweep's (RegMix's: 2.04 s at 384 runs)")
        verb = "fit"
    else:
        price, verb = run_price("average"), "average"
    return Step(
        pool_name(arm),
        verb,
        (arm.name,),
        0,
        arm.kind,
        SEARCH,
        price,
        reused=arm.reused,
        pool=tuple(f"{stage}-seed{k}" for k in seeds),
    )


def pool_seeds(step: Step) -> list[int]:
    """The seeds whose searches a pool step reads (its `pool`: `<stage>-seed<k>`)."""
    return [int(name.rsplit("-seed", 1)[1]) for name in step.pool]


def _merged(steps: Sequence[Step]) -> list[Step]:
    """One step per (name, verb, seed), serving every arm that lists it (a sweep, DoReMi's
    reference and proxy), in first-seen order."""
    out: dict[tuple[str, str, int], Step] = {}
    for st in steps:
        key = (st.name, st.verb, st.seed)
        have = out.get(key)
        out[key] = st if have is None else replace(have, arms=tuple(dict.fromkeys(have.arms + st.arms)))
    return list(out.values())


def plan(protocol: Protocol, seeds: Sequence[int]) -> list[Step]:
    """Every stage of the comparison, group by group (`protocol.order`): in each, the searches
    seed by seed, then the pools over every seed, then the main runs seed by seed; refused
    (`check_pools`) where a pooled arm's stages would not train on its one pool."""
    parts: dict[str, dict[str, list[Step]]] = defaultdict(lambda: {"search": [], "pool": [], "main": []})
    for seed in seeds:
        for arm in protocol.arms:
            for st in arm_steps(protocol, arm, seed):
                parts[arm.kind]["main" if st.role == MAIN else "search"].append(st)
        eq = protocol.equal_compute
        for baseline in eq.baselines:
            for m in eq.multiples[1:]:
                parts[EQUAL_COMPUTE]["main"].append(
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
    for arm in protocol.arms:
        if arm.pooled and seeds:
            parts[arm.kind]["pool"].append(pool_step(protocol, arm, seeds))
    steps = [
        st for group in protocol.order for part in ("search", "pool", "main") for st in _merged(parts[group][part])
    ]
    if seeds:
        check_pools(protocol, steps, seeds)
    return steps


def check_pools(protocol: Protocol, steps: Sequence[Step], seeds: Sequence[int]) -> None:
    """Refuse (ProtocolError, one line) a pooled arm whose plan has not exactly one pool, of the
    search runs of exactly the gate's `seeds`, or whose main runs do not all read it: the
    mixture its verdict is about would then not be the pooled one it pre-registered (after the
    runs, doremi/study/summarize.py `check_pooled` holds the runs to the same)."""
    for arm in (a for a in protocol.arms if a.pooled):
        pools = [s for s in steps if arm.name in s.arms and s.pool]
        if len(pools) != 1:
            raise ProtocolError(f"arm {arm.name}: pooled, so one pool over every seed's search, got {len(pools)}")
        pool = pools[0]
        stage = RUN_SEED.sub("", pool.pool[0]) if pool.pool else ""
        want = tuple(f"{stage}-seed{k}" for k in seeds)
        if sorted(pool.pool) != sorted(want):
            raise ProtocolError(
                f"arm {arm.name}: its pool {pool.name} averages {', '.join(pool.pool) or 'nothing'}; "
                f"the gate's seeds are {', '.join(want)}"
            )
        mains = [s for s in steps if s.arms == (arm.name,) and s.role == MAIN]
        wrong = [f"{s.name} reads {s.reads or 'its own search'}" for s in mains if s.reads != pool.name]
        if wrong or sorted(s.seed for s in mains) != sorted(seeds):
            why = wrong[0] if wrong else f"main runs of seeds {sorted(s.seed for s in mains)}"
            raise ProtocolError(f"arm {arm.name}: every seed's main run trains on its pool {pool.name}, but {why}")


@dataclass(frozen=True)
class ArmCost:
    """One arm's planned cost per seed: search and main GPU-seconds (a shared stage counted in
    each arm it serves; a pooled arm's search is every seed's and its pool, as the study charges
    doremi_pooled), search FLOPs, the equal-compute multiple and how its baseline is got; and
    `total_seconds`, the arm's stages over every seed, each once."""

    arm: str
    reused: bool
    search_seconds: float
    main_seconds: float
    search_flops: float
    multiple: float
    how: str
    beyond_corpus: bool
    shared: bool
    total_seconds: float = 0.0


def arm_costs(protocol: Protocol, steps: Sequence[Step], seed: int) -> list[ArmCost]:
    """Per arm of the protocol, its cost in seed `seed`'s stages."""
    plain = run_flops(protocol, protocol.design.main)
    out = []
    for arm in protocol.arms:
        every = [s for s in steps if arm.name in s.arms]
        search = [s for s in every if s.role == SEARCH and (arm.pooled or s.seed == seed)]
        main = [s for s in every if s.role == MAIN and s.seed == seed]
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
                sum(s.price.seconds for s in every),
            )
        )
    return out


def total_seconds(steps: Sequence[Step]) -> float:
    """GPU-seconds of the stages the comparison runs (reused ones are the study's)."""
    return sum(s.price.seconds for s in steps if not s.reused)
