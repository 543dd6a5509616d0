"""The comparison's pre-registered protocol (doremi/study/comparison/, docs/design.md section 4f):
the study where it must be the study (shapes, rule, seeds, the reused arms' configs and committed
runs), no arm reading the verdict's test half, methods as their authors run them on schedules
they can run, sweeps within the 2-epoch rule, the two cost views on a hand-computed example, and
the launcher's dry run: its stages and its price."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import tarfile
from pathlib import Path

import pytest

from doremi.study.comparison import cost, plan
from doremi.study.comparison.epochs import (
    capacity_multiple,
    corpus_multiple,
    epochs_read,
    over_the_rule,
)
from doremi.study.comparison.protocol import (
    CORPUS,
    PROTOCOL,
    STATIC,
    Arm,
    ProtocolError,
    ado_refits,
    arm_reads,
    arm_stage,
    baseline_capacity,
    check,
    check_reads,
    check_reused,
    check_schedules,
    check_sweep,
    corpus_capacity,
    largest_multiple,
    multiple_stage,
    pairs_from_calibration,
)
from doremi.study.design import DESIGN, config_differences
from doremi.study.runs import seeds_for

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "experiments" / "results" / "doremi_study" / "calibration.json"
ARCHIVE = ROOT / "experiments" / "results" / "doremi_study" / "study.tar.xz"
LAUNCHER = ROOT / "experiments" / "launch" / "comparison.py"


@pytest.fixture(scope="module")
def launcher():
    import importlib.util

    spec = importlib.util.spec_from_file_location("comparison_launcher", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _replace_arm(name: str, **changes) -> tuple[Arm, ...]:
    return tuple(dataclasses.replace(a, **changes) if a.name == name else a for a in PROTOCOL.arms)


# -- the study, where the comparison must be it ------------------------------------------------------


def test_the_protocol_judges_by_the_study_s_rule_on_its_shapes():
    import yaml

    cfg = yaml.safe_load((ROOT / "experiments" / "configs" / "doremi_study.yaml").read_text())
    assert tuple(d["name"] for d in cfg["data"]["domains"]) == CORPUS.domains
    assert (cfg["model"]["vocab_size"], cfg["data"]["dev_fraction"]) == (CORPUS.vocab_size, CORPUS.dev_fraction)
    assert PROTOCOL.design is DESIGN
    assert PROTOCOL.rule is DESIGN.rule and PROTOCOL.guardrails is DESIGN.guardrails
    assert PROTOCOL.endpoint is DESIGN.endpoint and PROTOCOL.validation_split == DESIGN.validation_split == "dev_test"
    assert PROTOCOL.sweep.stage is DESIGN.proxy
    by_kind = {a.kind: arm_stage(PROTOCOL, a) for a in PROTOCOL.arms if a.kind in ("transferred", "online")}
    assert by_kind == {"transferred": DESIGN.proxy, "online": DESIGN.main}
    longer = multiple_stage(DESIGN.main, 2)
    assert longer.shape is DESIGN.main.shape
    assert dataclasses.replace(longer.schedule, steps=DESIGN.main.schedule.steps) == DESIGN.main.schedule
    assert longer.schedule.steps == 8800 and longer.schedule.warmup_steps == 400
    with pytest.raises(ProtocolError, match="the study's rule"):
        check(dataclasses.replace(PROTOCOL, design=dataclasses.replace(DESIGN, rule=dataclasses.replace(DESIGN.rule))))


def test_the_arms_are_pre_registered_and_the_study_s_are_reused():
    names = [a.name for a in PROTOCOL.arms]
    assert names == [
        "uniform",
        "natural",
        "doremi_pooled",
        "doremi",
        "unimax",
        "temperature",
        "doge",
        "doge_online",
        "odm",
        "odm_online",
        "aioli",
        "aioli_online",
        "ado",
        "ado_online",
        "regmix",
        "mixing_law",
    ]
    assert (
        {a.name for a in PROTOCOL.arms if a.reused}
        == {a.name for a in DESIGN.arms}
        == {"uniform", "natural", "doremi", "doremi_pooled"}
    )
    # pooled: every transferred and swept arm but the study's per-seed doremi, a secondary row
    pooled = {a.name for a in PROTOCOL.arms if a.pooled}
    assert pooled == {"doremi_pooled", "doge", "odm", "aioli", "ado", "regmix", "mixing_law"}
    assert {a.name for a in PROTOCOL.arms if a.secondary} == {"doremi"}
    assert not any(a.pooled for a in PROTOCOL.arms if a.kind in ("online", "static"))
    # Holm's family: one row per method and form, the rule's baseline and the secondary row out
    assert PROTOCOL.holm_family() == tuple(n for n in names if n not in ("uniform", "doremi"))
    assert len(PROTOCOL.holm_family()) == 14 and len(PROTOCOL.holm_family("natural")) == 13
    assert PROTOCOL.arm("natural").mixture == DESIGN.arm("natural").mixture == "tokens"
    from doremi.methods import registry

    online = {a.method for a in PROTOCOL.arms if a.kind == "online"}
    assert online == set(registry.names(registry.ONLINE))  # every method that runs online, both ways
    assert {a.method for a in PROTOCOL.arms if a.kind == "transferred"} == set(registry.names(registry.PROXY))
    assert {a.method for a in PROTOCOL.arms if a.kind == "swept"} == set(registry.names(registry.OFFLINE))
    check_reused(PROTOCOL)
    moved = dataclasses.replace(PROTOCOL, arms=_replace_arm("natural", mixture="uniform"))
    with pytest.raises(ProtocolError, match="arm natural: reused with mixture 'uniform', the study's is 'tokens'"):
        check_reused(moved)
    dropped = dataclasses.replace(PROTOCOL, arms=_replace_arm("doremi", reused=False))
    with pytest.raises(ProtocolError, match="the study's arms doremi are not reused"):
        check_reused(dropped)
    unpooled = dataclasses.replace(PROTOCOL, arms=_replace_arm("doremi_pooled", pooled=False))
    with pytest.raises(ProtocolError, match="arm doremi_pooled: reused with pooled=False, the study's is True"):
        check_reused(unpooled)


def test_unimax_at_two_epochs_would_be_uniform_so_the_arm_takes_one():
    from data.sampling.mixtures import unimax_weights

    budget = DESIGN.main.schedule.tokens
    assert unimax_weights(CORPUS.train_tokens, budget, 2.0).tolist() == pytest.approx([1 / 12] * 12, rel=1e-12)
    one = unimax_weights(CORPUS.train_tokens, budget, 1.0)
    assert one[-1] == pytest.approx(CORPUS.train_tokens[-1] / budget)  # prose at one epoch
    assert PROTOCOL.arm("unimax").mixture == "unimax:1" and PROTOCOL.arm("temperature").mixture == "temperature:3.333"


def test_pairs_come_through_the_calibration_gate(tmp_path):
    decision = pairs_from_calibration(CALIBRATION)
    assert decision.pairs == 6 and decision.final
    assert seeds_for(decision.pairs) == (1, 2, 3, 4, 5, 6)
    doc = json.loads(CALIBRATION.read_text())
    cases = {
        "provisional": {**doc, "decision": {**doc["decision"], "provisional": "seeds 3, 4 still to run"}},
        "records 5 pairs": {**doc, "decision": {**doc["decision"], "pairs": 5}},
        "NO-GO": {**doc, "sigma_d": 0.035},  # beyond the gate's table (0.03)
    }
    for needle, bad in cases.items():
        path = tmp_path / "calibration.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ProtocolError, match=needle):
            pairs_from_calibration(path)
    (tmp_path / "junk.json").write_text("[]")
    with pytest.raises(ProtocolError, match="not a calibration.json"):
        pairs_from_calibration(tmp_path / "junk.json")


# -- what each arm reads ------------------------------------------------------------------------------


def test_no_arm_reads_the_verdict_s_test_half():
    reads = {a.name: arm_reads(a) for a in PROTOCOL.arms}
    assert reads["uniform"] == () and reads["doremi"] == ("search_run",)
    assert reads["aioli"] == ("search_run", "method_probe") and reads["aioli_online"] == ("method_probe",)
    assert reads["doge_online"] == ("method_target",) and reads["odm_online"] == ()
    assert reads["regmix"] == reads["mixing_law"] == ("sweep_run",)
    check_reads(PROTOCOL)
    peeking = dataclasses.replace(PROTOCOL, arms=PROTOCOL.arms + (Arm("peek", STATIC, "uniform", reads=("verdict",)),))
    with pytest.raises(ProtocolError, match="arm peek: reads validation as 'verdict', the 'test' half"):
        check(peeking)
    whole = dataclasses.replace(PROTOCOL, validation_split="none")
    with pytest.raises(ProtocolError, match="arm doremi_pooled: reads validation as 'search_run', the 'all' half"):
        check_reads(whole)


# -- the methods as their authors run them, on schedules they can run ---------------------------------


def test_methods_run_as_their_authors_do_and_the_proxy_schedules_are_adapted():
    from doremi.methods import registry

    for arm in PROTOCOL.arms:
        if arm.method is None or arm.kind == "swept":
            continue
        config = registry.spec(arm.method).config
        fields = {f.name: f.default for f in dataclasses.fields(config)}
        if "variant" in fields:
            assert fields["variant"] == "authors"
            assert f'mixing.{arm.method}.variant="authors"' in arm.sets() or arm.reused
    sets = {a.name: a.sets() for a in PROTOCOL.arms}
    assert sets["aioli"] == ('mixing.aioli.variant="authors"', "mixing.aioli.rounds=4")
    assert sets["ado"] == ('mixing.ado.variant="authors"', "mixing.ado.warmup=230", "mixing.ado.refit_every=230")
    assert sets["aioli_online"] == ('mixing.aioli.variant="authors"',) and sets["odm"] == sets["odm_online"] == ()
    # ADO: the authors' 1000/1000 refit four times in a main run, never in a proxy; scaled, four times
    assert ado_refits(4400, 1000, 1000) == ado_refits(1000, 230, 230) == 4 and ado_refits(1000, 1000, 1000) == 0
    check_schedules(PROTOCOL)
    aioli = dataclasses.replace(PROTOCOL, arms=_replace_arm("aioli", options=()))
    with pytest.raises(ProtocolError, match="arm aioli: Aioli's 20 rounds of 50 steps over 1000 cannot hold their 192"):
        check_schedules(aioli)
    ado = dataclasses.replace(PROTOCOL, arms=_replace_arm("ado", options=()))
    with pytest.raises(ProtocolError, match="arm ado: ADO's warm-up of 1000 steps and refits every 1000 never fit"):
        check_schedules(ado)


def _sets(cmd: list[str]) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]


def test_every_planned_config_loads_and_its_method_builds(launcher, tmp_path):
    """Each command of seed 1 is a config `doremi` accepts, on the design's stage, and the
    method of each proxy and online run builds over the 12 domains at its schedule."""
    from doremi.config import ExperimentConfig
    from doremi.methods import registry
    from trainer.config.schema import load_config
    from trainer.config.tools import to_dict

    config = launcher.study_launcher().CONFIG
    steps = [s for s in plan.plan(PROTOCOL, (1,)) if not s.reused and s.verb != "average"]
    assert {s.verb for s in steps} == {"train", "train-proxy", "sweep", "fit"}
    for step in steps:
        cmd = launcher.command_of(step, PROTOCOL, tmp_path, [], [])
        cfg = load_config(config, _sets(cmd), cls=ExperimentConfig)
        stage = DESIGN.proxy if step.verb in ("train-proxy", "sweep") else DESIGN.main
        if step.multiple > 1:
            stage = multiple_stage(DESIGN.main, step.multiple)
        assert config_differences(to_dict(cfg), stage) == [], step.name
        method = cfg.mixing.main if step.verb == "train" else cfg.mixing.method
        if step.verb == "train-proxy" or (step.verb == "train" and method):
            registry.preflight(method, cfg, list(CORPUS.domains))
    assert cfg.train.seed == 1


def test_the_reused_arms_are_the_study_s_configs(launcher, tmp_path):
    """The reused arms' stages, as the comparison would run them, are the study launcher's
    stages of those names for the gate's seeds: the same configs, the same averages (the pooled
    one over all six proxies, `pooled/weights.json`, which every doremi_pooled run reads)."""
    from doremi.config import ExperimentConfig
    from trainer.config.schema import load_config
    from trainer.config.tools import to_dict

    study = launcher.study_launcher()
    assert plan.STUDY_POOL == study.POOLED and PROTOCOL.arm("doremi_pooled").name == study.POOLED_ARM
    seeds = list(seeds_for(6))
    folder = tmp_path / "study"
    theirs = {
        (stage.name, stage.command): study.command(stage, folder, [], study.main_sets(study.CONFIG), [])
        for stage in study.study_stages(seeds, folder)
    }
    ours = {(s.name, s.verb): launcher.command_of(s, PROTOCOL, tmp_path, [], []) for s in plan.plan(PROTOCOL, seeds)}
    reused = {
        k: v
        for k, v in ours.items()
        if k[0].split("-seed")[0] in (*(a.name for a in DESIGN.arms), "reference", "proxy", "pooled")
    }
    assert set(reused) == set(theirs) and len(reused) == 6 * 7 + 1
    for key, cmd in reused.items():
        if key[1] == "average":
            assert cmd == theirs[key]
            continue
        a = to_dict(load_config(study.CONFIG, _sets(cmd), cls=ExperimentConfig))
        b = to_dict(load_config(study.CONFIG, _sets(theirs[key]), cls=ExperimentConfig))
        assert a == b, key


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


#: Keys that name where a run ran, not what it was: paths on the device and the reference's path.
PLACES = (
    "data.domains",
    "data.store_dir",
    "train.run_dir",
    "pipeline.run_dir",
    "sweep.run_dir",
    "mixing.doremi.reference",
    "data.domain_weights",
)
#: Keys no reused run reads: the sections of the methods the study does not run (their defaults
#: changed since seed 1 ran: issue 35's authors' variants), and the pipeline schedule, which the
#: trainer resolves to all-forward-all-backward for DoReMi's exact update (trainer/run/loop.py).
UNREAD = ("mixing.doge.", "mixing.odm.", "mixing.aioli.", "mixing.ado.", "parallelism.pp_schedule")


def test_the_committed_study_runs_are_what_the_comparison_would_run(launcher, tmp_path):
    """Every run the comparison reuses from the committed archive has the config the comparison
    would give it, key for key (every key both know; the places it ran aside)."""
    import yaml

    from doremi.config import ExperimentConfig
    from trainer.config.schema import load_config
    from trainer.config.tools import to_dict

    steps = {s.name: s for s in plan.plan(PROTOCOL, (1, 2, 3, 4)) if s.reused and s.verb != "average"}
    seen = set()
    with tarfile.open(ARCHIVE) as tar:
        for member in tar:
            parts = member.name.split("/")
            if member.name == "study/session-7/stores-manifest.json":
                domains = json.load(tar.extractfile(member))["domains"]
                assert tuple(d["name"] for d in domains) == CORPUS.domains
                assert tuple(d["train"]["tokens"] for d in domains) == CORPUS.train_tokens
                assert tuple(d["validation"]["tokens"] for d in domains) == CORPUS.validation_tokens
                seen.add("manifest")
            if member.name == "study/uniform-seed1/metrics.jsonl":
                last = [json.loads(x) for x in tar.extractfile(member).read().splitlines() if b"epochs" in x][-1]
                drawn, epochs = last["realised"]["sequences"], last["epochs"]
                assert tuple(round(drawn[d] / epochs[d], 6) for d in CORPUS.domains) == CORPUS.pools
                seen.add("pools")
            if len(parts) != 3 or parts[2] != "config.yaml" or parts[1] not in steps:
                continue
            committed = _flat(yaml.safe_load(tar.extractfile(member)))
            cmd = launcher.command_of(steps[parts[1]], PROTOCOL, tmp_path, [], [])
            ours = _flat(to_dict(load_config(launcher.study_launcher().CONFIG, _sets(cmd), cls=ExperimentConfig)))
            differ = {
                k: (committed[k], ours[k])
                for k in set(committed) & set(ours)
                if committed[k] != ours[k] and not k.startswith(PLACES + UNREAD)
            }
            assert differ == {}, parts[1]
            weights, step = committed["data.domain_weights"], steps[parts[1]]
            if step.verb == "train-reference":  # the stage trains on mixing.doremi.reference_weights
                assert weights == ours["mixing.doremi.reference_weights"] == DESIGN.reference_weights
            elif step.arms == ("doremi",) and step.verb == "train":
                assert weights.endswith(f"/proxy-seed{step.seed}/weights.json")
            elif step.arms == ("doremi_pooled",):
                assert weights.endswith("/pooled/weights.json") and step.reads == "pooled"
            else:
                assert weights == ours["data.domain_weights"]
            seen.add(parts[1])
    # 4 seeds x (reference, proxy, uniform, natural, doremi, doremi_pooled)
    assert seen == set(steps) | {"manifest", "pools"} and len(steps) == 4 * 6


# -- the 2-epoch rule ---------------------------------------------------------------------------------

#: A small fixed corpus: train tokens, pools (sequences of 100 tokens), runs of 40 sequences.
TOKENS, POOLS, SEQ, RUN = (1000, 3000, 6000), (9, 28, 58), 100, 40


def test_the_epoch_arithmetic_on_a_small_table():
    from doremi.offline.fit.design import epoch_caps
    from doremi.offline.sweep import sequence_caps

    assert epochs_read((0.5, 0.25, 0.25), POOLS, RUN).tolist() == pytest.approx([20 / 9, 10 / 28, 10 / 58])
    # the sweep's caps: min(1, (2 pool - 1) / 40) = 0.425, 1, 1; in tokens a's would be 2 x 1000 / 4000 = 0.5
    assert sequence_caps(POOLS, RUN, 2.0, "abc", "sweep.max_epochs").tolist() == [0.425, 1.0, 1.0]
    assert epoch_caps(TOKENS, RUN * SEQ, 2.0)[0] == 0.5
    assert over_the_rule([(0.5, 0.25, 0.25), (0.2, 0.4, 0.4)], "abc", POOLS, RUN, 2.0) == ["row 0: a 2.3333 epochs"]
    # a: (0.425 x 40 + 1) / 9 = 2.0 exactly, within; the sequence cap's largest weight for a
    assert over_the_rule([(0.425, 0.3, 0.275)], "abc", POOLS, RUN, 2.0) == []
    assert capacity_multiple((1 / 3, 1 / 3, 1 / 3), POOLS, RUN, 2.0) == pytest.approx(2 * 9 / (40 / 3))
    assert corpus_multiple(POOLS, RUN, 2.0) == pytest.approx(2 * 95 / 40)


def test_the_sweep_reads_no_domain_beyond_two_epochs():
    s = PROTOCOL.sweep
    assert (s.runs, s.designs, s.prior, s.stacked, s.run_sequences) == (64, ("dirichlet",), "tokens", False, 96_000)
    assert s.max_epochs == DESIGN.guardrails.max_epochs == 2.0  # the sweep caps in sequences, as runs read
    check_sweep(PROTOCOL, seeds_for(6))
    # no one-hot run fits: the largest pool, c's, holds 0.8156 of a run at 2 epochs
    assert max(2 * p / s.run_sequences for p in CORPUS.pools) == pytest.approx(2 * 39148 / 96_000)
    # a cap of 2 counted in tokens lets prose read 2.16 epochs in sequences
    at_token_cap = 2.0 * CORPUS.train_tokens[-1] / (s.run_sequences * 1024)
    row = [0.0] * 11 + [at_token_cap]
    assert over_the_rule([row], CORPUS.domains, CORPUS.pools, s.run_sequences, 2.0) == ["row 0: prose 2.1585 epochs"]


def test_the_equal_compute_multiples_are_within_the_corpus():
    assert baseline_capacity(PROTOCOL, "natural") == pytest.approx(
        2 * 6467 / (7146528 / sum(CORPUS.train_tokens) * 140_800)
    )
    # 1.10: uniform's 2x run is capped at 2 epochs (prose)
    assert baseline_capacity(PROTOCOL, "uniform") == pytest.approx(2 * 6467 / (140_800 / 12))
    assert corpus_capacity(PROTOCOL) == pytest.approx(2 * 168_168 / 140_800)
    assert largest_multiple(PROTOCOL) == max(PROTOCOL.equal_compute.multiples) == 2
    longer = dataclasses.replace(
        PROTOCOL, equal_compute=dataclasses.replace(PROTOCOL.equal_compute, multiples=(1, 2, 4))
    )
    with pytest.raises(ProtocolError, match=r"4x main-run tokens reads a domain beyond 2 epochs .* \(at most 2.294x\)"):
        check(longer)


# -- the two cost views ----------------------------------------------------------------------------------


def test_the_cost_views_on_a_hand_computed_example():
    points = [cost.Point(1.0, (2.0, 1.0)), cost.Point(2.0, (1.8, 0.9))]
    # An arm with a main run of 1.1 plain main runs' FLOPs and search stages of 0.4 of one: 1.5x.
    search = cost.search_flops([3e16, 1e16], main=1.1e17, plain_main=1e17)
    assert search == pytest.approx(5e16) and cost.compute_multiple(search, 1e17) == pytest.approx(1.5)
    views = cost.cost_views(search, 1e17, points, capacity=2.4)
    tokens, compute = views[cost.EQUAL_TOKENS], views[cost.EQUAL_COMPUTE]
    assert (tokens.losses, tokens.how, tokens.endpoint) == ((2.0, 1.0), cost.MEASURED, 1.5)
    # log-log: L(1.5) = L(1) (L(2) / L(1))^log2(1.5) = L(1) x 0.9^0.5849625 = L(1) x 0.9402289
    assert compute.how == cost.INTERPOLATED and compute.flag() == ""
    assert compute.losses == pytest.approx((1.8804577, 0.9402289), abs=1e-7)
    assert cost.paired_differences([1.40], [compute]) == pytest.approx([1.40 - 1.4103433], abs=1e-7)
    far = cost.baseline_at(points, 4.0, capacity=2.4)  # 0.9^2 = 0.81: extrapolated, beyond the corpus
    assert far.losses == pytest.approx((1.62, 0.81)) and far.how == cost.EXTRAPOLATED and far.beyond_corpus
    assert far.flag() == "extrapolated beyond the largest measured multiple; beyond the corpus's 2-epoch capacity"
    with pytest.raises(cost.CostError, match="below the smallest measured"):
        cost.baseline_at(points, 0.5)
    with pytest.raises(cost.CostError, match="fewer than a plain main run's"):
        cost.search_flops([], main=0.9e17, plain_main=1e17)


def test_the_planned_equal_compute_multiples():
    steps = plan.plan(PROTOCOL, (1,))
    costs = {c.arm: c for c in plan.arm_costs(PROTOCOL, steps, 1)}
    small, main = plan.flops_per_token(DESIGN.proxy, 2048), plan.flops_per_token(DESIGN.main, 2048)
    assert (small, main) == (87_913_728, 352_008_960)  # trainer/model/flops.py
    ratio = small * DESIGN.proxy.schedule.tokens / (main * DESIGN.main.schedule.tokens)
    # DoReMi: a reference, a proxy and the reference's forward over the proxy's tokens
    assert costs["doremi"].multiple == pytest.approx(1 + ratio * (1 + 1 + 1 / 3))
    assert costs["doge"].multiple == pytest.approx(1 + ratio * (1 + 12 / 96))  # its target batch: 96 / 8
    assert costs["doge_online"].multiple == pytest.approx(1 + 4 / 32) and costs["odm_online"].multiple == 1.0
    assert costs["aioli_online"].multiple == pytest.approx(1.1)  # its validation budget, a bound
    assert (costs["doremi"].how, costs["odm_online"].how) == (cost.INTERPOLATED, cost.MEASURED)
    assert costs["regmix"].how == cost.EXTRAPOLATED and costs["regmix"].beyond_corpus and costs["regmix"].shared


def test_a_pooled_arm_is_charged_all_its_searches_on_every_seed():
    """As the study charges doremi_pooled (summarize.compute_of(pooled_from=...)): per seed, the
    sum of the six seeds' searches; the transferred arms near 2x, the swept far beyond the corpus."""
    seeds = seeds_for(6)
    steps = plan.plan(PROTOCOL, seeds)
    small, main = plan.flops_per_token(DESIGN.proxy, 2048), plan.flops_per_token(DESIGN.main, 2048)
    ratio = small * DESIGN.proxy.schedule.tokens / (main * DESIGN.main.schedule.tokens)
    for seed in (1, 6):
        costs = {c.arm: c for c in plan.arm_costs(PROTOCOL, steps, seed)}
        for arm in (a for a in PROTOCOL.arms if a.pooled):
            searches = [s for s in steps if arm.name in s.arms and s.role == plan.SEARCH and s.seed in seeds]
            assert len(searches) == 6 * (2 if arm.name == "doremi_pooled" else 1)
            assert costs[arm.name].search_flops == pytest.approx(sum(s.flops for s in searches), rel=1e-12)
        assert costs["doremi_pooled"].multiple == pytest.approx(1 + 6 * ratio * (1 + 1 + 1 / 3))
        assert costs["doge"].multiple == pytest.approx(1 + 6 * ratio * (1 + 12 / 96))
        assert costs["odm"].multiple == pytest.approx(1 + 6 * ratio) and costs["doremi"].multiple < 1.4
        assert costs["regmix"].multiple == pytest.approx(
            1 + 6 * plan.sweep_flops(PROTOCOL) / plan.run_flops(PROTOCOL, DESIGN.main)
        )
        assert costs["regmix"].multiple > 70 and costs["regmix"].beyond_corpus
        assert {costs[a].how for a in ("doge", "odm", "aioli", "ado")} == {cost.EXTRAPOLATED}
        assert not any(costs[a].beyond_corpus for a in ("doge", "odm", "aioli", "ado"))
    # GPU-seconds: the six proxies and the pool, once each; the sweeps shared by both swept arms
    c = {c.arm: c for c in plan.arm_costs(PROTOCOL, steps, 1)}
    assert c["odm"].search_seconds == pytest.approx(6 * 76 / 0.984 + 6)
    assert c["odm"].total_seconds == pytest.approx(6 * 76 / 0.984 + 6 + 6 * 240)
    assert c["regmix"].search_seconds == pytest.approx(6 * 64 * 76 + 10.0)


def test_a_pool_that_is_not_the_gate_s_seeds_or_not_read_is_refused():
    seeds = seeds_for(6)
    steps = plan.plan(PROTOCOL, seeds)
    plan.check_pools(PROTOCOL, steps, seeds)
    check(PROTOCOL, seeds)
    pool = next(s for s in steps if s.name == "doge_pooled")
    assert pool.pool == tuple(f"doge_proxy-seed{k}" for k in seeds) and pool.verb == "average"
    assert next(s for s in steps if s.name == "regmix_pooled").pool == tuple(f"sweep-seed{k}" for k in seeds)
    short = [dataclasses.replace(s, pool=s.pool[:5]) if s is pool else s for s in steps]
    with pytest.raises(
        ProtocolError,
        match=r"arm doge: its pool doge_pooled averages doge_proxy-seed1, .*seed5; the gate's seeds are .*seed6",
    ):
        plan.check_pools(PROTOCOL, short, seeds)
    own = [dataclasses.replace(s, reads="") if s.name == "doge-seed3" else s for s in steps]
    with pytest.raises(
        ProtocolError,
        match="arm doge: every seed's main run trains on its pool doge_pooled, but doge-seed3 reads its own search",
    ):
        plan.check_pools(PROTOCOL, own, seeds)
    twice = steps + [dataclasses.replace(pool, name="doge_pooled2")]
    with pytest.raises(ProtocolError, match="arm doge: pooled, so one pool over every seed's search, got 2"):
        plan.check_pools(PROTOCOL, twice, seeds)
    with pytest.raises(
        ProtocolError,
        match="arm doremi_pooled: its pool pooled averages proxy-seed1, .*, proxy-seed6; the gate's seeds are proxy-seed1, proxy-seed2, proxy-seed3$",
    ):
        plan.check_pools(PROTOCOL, steps, (1, 2, 3))


# -- the launcher's dry run ----------------------------------------------------------------------------


def _per_seed_seconds() -> float:
    """One seed's stages the comparison runs, by hand from the measured times (small run 76 s,
    main run 240 s) and the methods' step ratios (doge 0.784, odm 0.984, aioli 1.002 with 10%
    validation, ado 0.999): no average or fit per seed (they are the pools')."""
    proxies = 76 / 0.784 + 76 / 0.984 + 76 / 1.002 * 1.1 + 76 / 0.999 + 4 * 240
    online = 240 / 0.784 + 240 / 0.984 + 240 / 1.002 * 1.1 + 240 / 0.999
    static = 2 * 240
    swept = 64 * 76 + 2 * 240
    equal = 2 * 480
    return static + proxies + online + swept + equal


#: The pools, once for every seed: 4 averages (6 s) and the 2 fits (10.0 s, 8.2 s).
POOL_SECONDS = 4 * 6 + 10.0 + 8.2


def test_the_dry_run_lists_every_stage_and_its_price(launcher, tmp_path, capsys):
    assert launcher.main(["--dry-run", "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    heads = re.findall(r"^# \[(\w+)\] (\S+) \(([\w-]+); ([\w, ]+); (seed \d|pool of seeds [\d, ]+)\)", out, re.M)
    # per seed: 7 stages of the study, reused (reference, proxy, its average, uniform, natural,
    # doremi, doremi_pooled), 19 run here; the study's pool and the comparison's 6
    assert len(heads) == 6 * 26 + 1 + 6
    names = {n for g, n, v, _, s in heads if s == "seed 1"}
    assert names == {
        *(f"{a}-seed1" for a in [a.name for a in PROTOCOL.arms]),
        "reference-seed1",
        "proxy-seed1",
        *(f"{m}_proxy-seed1" for m in ("doge", "odm", "aioli", "ado")),
        "sweep-seed1",
        "uniform_x2-seed1",
        "natural_x2-seed1",
    }
    pools = {n: (v, a) for g, n, v, a, s in heads if s == "pool of seeds 1, 2, 3, 4, 5, 6"}
    assert pools == {
        "pooled": ("average", "doremi_pooled"),
        **{f"{m}_pooled": ("average", m) for m in ("doge", "odm", "aioli", "ado")},
        **{f"{m}_pooled": ("fit", m) for m in ("regmix", "mixing_law")},
    }
    # every seed's fit reads the six sweeps, and every seed's main run the pool
    assert re.search(
        r"doremi fit .* --method regmix --sweep (\S+/sweep-seed\d ){5}\S+/sweep-seed6 --out \S+/regmix_pooled/regmix.json",
        out,
    )
    assert out.count("data.domain_weights=" + str(tmp_path / "comparison" / "doge_pooled" / "weights.json")) == 6
    assert (
        out.count("data.domain_weights=" + str(tmp_path / "comparison" / "mixing_law_pooled" / "mixing_law.json")) == 6
    )
    assert out.count("data.domain_weights=" + str(tmp_path / "study" / "pooled" / "weights.json")) == 6
    groups = [g for g, *_ in heads]
    order = ["static", "transferred", "online", "equal_compute", "swept"]
    assert groups == sorted(groups, key=order.index)  # group by group, each over every seed
    assert len(re.findall(r": reused, the study's run", out)) == 6 * 7 + 1
    total = 6 * _per_seed_seconds() + POOL_SECONDS
    assert f"Total: {total / 60:.1f} GPU minutes (120 stages)" in out
    assert f"{math.ceil(total / (1800 - 69.5))} sessions of 30 device-minutes" in out
    assert "Stacked main runs: not costed" in out and "GO with 6 pairs" in out


def test_the_dry_run_skips_what_is_finished(launcher, tmp_path, capsys):
    from data import artifact

    for folder, name in (("comparison", "unimax-seed1"), ("study", "uniform-seed1")):
        (tmp_path / folder / name).mkdir(parents=True)
        header = artifact.Header(kind="run", status="finished", step=4400, steps=4400)
        artifact.write(tmp_path / folder / name / "run.json", header, {"stage": "train"})
    assert launcher.main(["--dry-run", "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "unimax-seed1 (train; unimax; seed 1): finished before, skipped" in out
    assert "uniform-seed1 (train; uniform; seed 1): reused, the study's run (finished in the work folder)" in out
    assert f"Total: {(6 * _per_seed_seconds() + POOL_SECONDS - 240) / 60:.1f} GPU minutes (119 stages)" in out


def test_a_calibration_the_gate_refuses_is_one_line_and_exit_2(launcher, tmp_path, capsys):
    doc = json.loads(CALIBRATION.read_text())
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({**doc, "decision": {**doc["decision"], "provisional": "seed 4 still to run"}}))
    with pytest.raises(SystemExit) as stop:
        launcher.main(["--dry-run", "--calibration", str(path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("comparison: error: ") and "not a final GO" in err[0]


def test_a_run_starts_with_the_first_stage_of_its_own_and_packs_what_finished(launcher, tmp_path, monkeypatch):
    """The run path: preprocessing, then the comparison's own stages in the plan's order (the
    study's reused stages are never started), stopped after a failed stage, and packed."""
    import subprocess

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text("{}\n")
    started = []

    def fake_command(step, protocol, work, base, user):
        started.append(step.name)
        return [sys.executable, "-c", "raise SystemExit(2)"]

    monkeypatch.setattr(launcher, "command_of", fake_command)
    monkeypatch.setattr(launcher.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--corpus", str(corpus)]
    assert launcher.main(argv) == 1
    assert started[0] == "unimax-seed1" and len(started) == 120  # every command built, none of the study's
    with tarfile.open(tmp_path / "out" / "comparison.tar.xz") as tar:
        info = json.loads(tar.extractfile("comparison/launch.json").read())
    assert [(s["stage"], s["exit_status"]) for s in info["stages"]] == [("preprocess", 0), ("unimax-seed1", 2)]
    assert info["exit_status"] == 1


def test_side_by_side_batches_main_runs_only_never_a_fit_or_what_reads_it(launcher, tmp_path, monkeypatch):
    """`--side-by-side 2`: the first two main runs (unimax-seed1, temperature-seed1) start together;
    in the whole plan no batch holds anything but main `train` stages (a pooled fit or average runs
    alone, before the runs that read it); 0 is one line and exit 2."""
    import subprocess

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text("{}\n")
    monkeypatch.setattr(launcher, "command_of", lambda *a: [sys.executable, "-c", "raise SystemExit(2)"])
    monkeypatch.setattr(launcher.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--corpus", str(corpus)]
    assert launcher.main([*argv, "--side-by-side", "2"]) == 1
    with tarfile.open(tmp_path / "out" / "comparison.tar.xz") as tar:
        info = json.loads(tar.extractfile("comparison/launch.json").read())
    assert [(s["stage"], s.get("side_by_side")) for s in info["stages"]] == [
        ("preprocess", None),
        ("unimax-seed1", 2),
        ("temperature-seed1", 2),
    ]
    study = launcher.study_launcher()
    steps = [s for s in launcher.planning.plan(launcher.PROTOCOL, [1, 2, 3, 4, 5, 6]) if not s.reused]
    stages = [launcher.stage_of(s, launcher.PROTOCOL, tmp_path)[0] for s in steps]
    batches = study.batches(stages, 6)
    assert any(len(b) == 6 for b in batches)
    for b in batches:
        assert len(b) == 1 or all(stages[i].command == "train" and stages[i].main for i in b)
    assert {stages[b[0]].command for b in batches if len(b) == 1} >= {"fit", "average", "train-proxy"}
    with pytest.raises(SystemExit) as e:
        launcher.main([*argv, "--side-by-side", "0"])
    assert e.value.code == 2


def test_whole_stages_starts_no_stage_that_would_not_end_before_the_deadline(launcher, tmp_path, monkeypatch):
    """`--whole-stages` (a session's last call): with 400 s left, the first main run (240 s x 1.2)
    runs and the second (whose 288 s would end after the deadline) is not started, said in its
    record and on stdout, exit 3; without --deadline it is one line and exit 2."""
    import subprocess
    import time

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text("{}\n")
    clock = {"now": 1000.0}

    def fake_command(*args):
        return [sys.executable, "-c", "print('ok')"]

    def fake_time():
        clock["now"] += 1.0  # every reading a second later
        return clock["now"]

    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        clock["now"] += 200.0  # a stage takes 200 s
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(launcher, "command_of", fake_command)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    monkeypatch.setattr(subprocess, "Popen", popen)  # the launchers' own module objects
    monkeypatch.setattr(time, "time", fake_time)
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--corpus", str(corpus)]
    assert launcher.main([*argv, "--deadline", "400", "--whole-stages"]) == 3
    with tarfile.open(tmp_path / "out" / "comparison.tar.xz") as tar:
        info = json.loads(tar.extractfile("comparison/launch.json").read())
    ran, skipped = info["stages"][1], info["stages"][2]
    assert (ran["stage"], ran["exit_status"], "not_started" in ran) == ("unimax-seed1", 0, False)
    assert (skipped["stage"], skipped["exit_status"]) == ("temperature-seed1", None)
    assert skipped["not_started"].startswith("needs about 288 s, ")
    assert len(info["stages"]) == 3 and info["exit_status"] == 3
    with pytest.raises(SystemExit) as e:
        launcher.main([*argv, "--whole-stages"])
    assert e.value.code == 2
