"""Run the comparison of every mixing method (issue 39) on one GPU, resuming across sessions;
`--dry-run` prints its plan and its price before any run.

    python experiments/launch/comparison.py --dry-run [--calibration CAL] [--work DIR]
    python experiments/launch/comparison.py --out $OUT [--calibration CAL] [--work runs/doremi_study]
        [--corpus runs/real_corpus] [--deadline SECONDS [--whole-stages]] [--side-by-side N | --gpus N]
        [--session LABEL] [--set KEY=VALUE ...]

The protocol is doremi/study/comparison/protocol.py (the prose: experiments/notes/COMPARISON.md):
the arms, their seeds (1 to the pairs of the calibration's gate, read from CAL, default the
committed experiments/results/doremi_study/calibration.json) and the stages of each, in the
protocol's order. Every stage is an ordinary `doremi` command on the study's config
(experiments/configs/doremi_study.yaml), built by the study's launcher
(experiments/launch/doremi_study.py: its `Stage`, `seeded`, `command`, `finished`, `run_stages`,
`pack`), in `<work>/comparison/<name>`; the arms the study ran (uniform, natural, DoReMi and
doremi_pooled with its `pooled/` average) are read from `<work>/study/` (the study's archive
unpacked there) and never run here. A pooled arm's pool (`<arm>_pooled/`: one `doremi average`
of its six proxies, or one `doremi fit` of the six sweeps) runs after every seed's search of its
group and before any of its main runs, which all train on it. A finished
stage is skipped; an interrupted one resumes from its checkpoint; `--deadline` stops the running
stage with SIGTERM (it checkpoints); with `--whole-stages` (a session's last call, whose stopped
stage's checkpoint goes back with the machine) no stage is started that its estimated time
would not end before the deadline. `--side-by-side N` runs up to N consecutive main runs at
once, as the study's launcher does (each bitwise the run alone; every other stage, a fit or an
average whose output the next stages read, alone). `--gpus N` runs up to N stages at once, each
on its own GPU, a stage starting once every stage it reads has ended well
(doremi/study/comparison/schedule.py; the study launcher's `run_on_gpus`). The run directories, without checkpoints, and the call's
records are packed as `$OUT/comparison.tar.xz`.

The dry run prints every stage with its command and its estimated GPU-seconds (from the study's
measured stage times, doremi/study/comparison/price.py), then the price per arm, the total
GPU-minutes of the stages still to run and the 30-minute sessions they take, and why main runs
are not stacked. Exit status: 0 done (or planned), 1 a stage failed, 2 bad usage, 3 stopped at
the deadline.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from data import artifact  # noqa: E402
from doremi.study.comparison import plan as planning  # noqa: E402
from doremi.study.comparison import schedule  # noqa: E402
from doremi.study.comparison.price import STAGE_TIMES, sessions  # noqa: E402
from doremi.study.comparison.protocol import (  # noqa: E402
    ONLINE,
    PROTOCOL,
    STATIC,
    SWEPT,
    TRANSFERRED,
    Protocol,
    ProtocolError,
    check,
    corpus_capacity,
    multiple_stage,
    pairs_from_calibration,
)
from doremi.study.runs import seeds_for  # noqa: E402

CALIBRATION = ROOT / "experiments" / "results" / "doremi_study" / "calibration.json"
PHASE, STUDY_PHASE = "comparison", "study"


def study_launcher() -> ModuleType:
    """experiments/launch/doremi_study.py as a module (its dataclasses look their module up)."""
    name = "doremi_study"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "doremi_study.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def die(msg: str) -> None:
    print(f"comparison: error: {msg}", file=sys.stderr)
    sys.exit(2)


@functools.cache
def _main_eval_every(config: Path) -> int:
    import yaml

    return int(yaml.safe_load(config.read_text())["pipeline"]["main"]["train"]["eval_every"])


@functools.cache
def _main_sets(config: Path) -> tuple[str, ...]:
    """The config's pipeline.main section as --set overrides (the study launcher's `main_sets`)."""
    return tuple(study_launcher().main_sets(config))


def stage_of(step: planning.Step, protocol: Protocol, work: Path) -> tuple[Any, Path]:
    """The study launcher's `Stage` for one step of the plan, and the folder it runs in (the
    study's for a reused arm, the comparison's for the rest)."""
    study = study_launcher()
    folder = work / (STUDY_PHASE if step.reused else PHASE)
    s = step.seed
    proxy_seeds = study.seeded(s, s + study.PROXY_DATA_SEED_OFFSET)
    arm = next((a for a in protocol.arms if a.name == step.arms[0]), None)
    if step.verb == "average":
        return study.Stage(step.name, "average", pooled=step.pool), folder
    if step.verb == "train-reference":
        return study.Stage(step.name, "train-reference", study.seeded(s)), folder
    if step.verb == "train-proxy":
        from doremi.methods import registry

        sets = proxy_seeds + (f"mixing.method={arm.method}",)
        if registry.spec(arm.method).needs_reference:
            reference = next(x for x in planning.arm_steps(protocol, arm, s) if x.verb == "train-reference")
            sets += (f"mixing.{arm.method}.reference={folder / reference.name}",)
        return study.Stage(step.name, "train-proxy", sets + arm.sets()), folder
    if step.verb == "sweep":
        return study.Stage(step.name, "sweep", proxy_seeds + protocol.sweep.sets(s)), folder
    if step.verb == "fit":
        if step.pool:  # one fit of every seed's sweep: the keys of the first (they differ only in their seeds)
            s = planning.pool_seeds(step)[0]
            proxy_seeds = study.seeded(s, s + study.PROXY_DATA_SEED_OFFSET)
        sets = proxy_seeds + protocol.sweep.sets(s) + protocol.sweep.fit_sets() + arm.sets()
        return study.Stage(step.name, "fit", sets, main=True), folder
    sets = study.seeded(s)
    if arm is None:  # an equal-compute baseline's longer run
        eq = protocol.equal_compute
        base = next(b for b in eq.baselines if eq.name(b, step.multiple) == step.arms[0])
        longer = multiple_stage(protocol.design.main, step.multiple).schedule
        sets += (
            f"data.domain_weights={protocol.arm(base).mixture}",
            f"train.steps={longer.steps}",
            f"train.eval_every={_main_eval_every(study.CONFIG) * step.multiple}",
        )
    elif arm.kind == STATIC:
        sets += (f"data.domain_weights={arm.mixture}",)
    elif arm.pooled:
        sets += (f"data.domain_weights={folder / step.reads / planning.pool_file(arm)}",)
    elif arm.kind == TRANSFERRED:
        proxy = next(x for x in planning.arm_steps(protocol, arm, s) if x.verb == "train-proxy")
        sets += (f"data.domain_weights={folder / proxy.name / 'weights.json'}",)
    elif arm.kind == SWEPT:
        sets += (f"data.domain_weights={folder / f'sweep-seed{s}' / f'{arm.method}.json'}",)
    elif arm.kind == ONLINE:
        sets += (f"mixing.main={arm.method}",) + arm.sets()
    return study.Stage(step.name, "train", sets, main=True), folder


def command_of(step: planning.Step, protocol: Protocol, work: Path, base: list[str], user: list[str]) -> list[str]:
    """The step's command line: the study launcher's, plus a sweep's directory or a fit's method
    and sweep (the `doremi sweep` and `doremi fit` arguments it does not know)."""
    study = study_launcher()
    stage, folder = stage_of(step, protocol, work)
    cmd = study.command(stage, folder, base, list(_main_sets(study.CONFIG)), user)
    if step.verb == "sweep":
        cmd += ["--set", f"sweep.run_dir={folder / step.name}"]
    if step.verb == "fit":
        method = protocol.arm(step.arms[0]).method
        sweeps = [str(folder / n) for n in step.pool or (step.name,)]
        cmd += ["--method", method, "--sweep", *sweeps]
        if step.pool:
            cmd += ["--out", str(folder / step.name / planning.pool_file(protocol.arm(step.arms[0])))]
    return cmd


def done(step: planning.Step, protocol: Protocol, work: Path) -> bool:
    """Whether the step's output is there and finished (its artifact header)."""
    study = study_launcher()
    stage, folder = stage_of(step, protocol, work)
    if step.verb in ("sweep", "fit"):
        name = "sweep.json" if step.verb == "sweep" else f"{protocol.arm(step.arms[0]).method}.json"
        record = folder / step.name / name
        header = artifact.read(record) if record.is_file() else None
        return header is not None and header.status == "finished"
    return study.finished(stage, folder)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def price_table(protocol: Protocol, steps: list[planning.Step], seeds: tuple[int, ...]) -> str:
    """Per arm: GPU-seconds a seed (search, main; a pooled arm's search is every seed's and its
    pool), minutes over the seeds (each stage once), search FLOPs a seed, the equal-compute
    multiple and how the baseline there is obtained; a secondary arm says it is outside Holm's family."""
    costs = planning.arm_costs(protocol, steps, seeds[0])
    lines = [
        "| arm | kind | search s/seed | main s/seed | GPU min, all seeds | search PFLOPs/seed | equal-compute multiple |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for c, arm in zip(costs, protocol.arms):
        total = "reused (the study's)" if c.reused else _minutes(c.total_seconds)
        shared = " (shared)" if c.shared else ""
        kind = arm.kind + (", pooled" if arm.pooled else "") + (", secondary: outside Holm" if arm.secondary else "")
        flag = c.how + (", beyond the corpus" if c.beyond_corpus else "")
        lines.append(
            f"| {c.arm} | {kind} | {c.search_seconds:.0f}{shared} | {c.main_seconds:.0f} | {total} | "
            f"{c.search_flops / 1e15:.2f} | {c.multiple:.3f} ({flag}) |"
        )
    eq = protocol.equal_compute
    for b in eq.baselines:
        for m in eq.multiples[1:]:
            mine = [s for s in steps if s.arms == (eq.name(b, m),)]
            lines.append(
                f"| {eq.name(b, m)} | equal-compute point | 0 | {mine[0].price.seconds:.0f} | "
                f"{_minutes(sum(s.price.seconds for s in mine))} | - | {m} (measured) |"
            )
    return "\n".join(lines)


def wall_on(steps: list[planning.Step], todo: list[planning.Step], gpus: int) -> float:
    """Wall seconds of the stages still to run (`todo`) on `gpus` GPUs under `--gpus`'s rule, at
    their prices (finished and reused stages take none)."""
    left = {id(s) for s in todo if not s.reused}
    seconds = [s.price.seconds if id(s) in left else 0.0 for s in steps]
    return schedule.wall_seconds(seconds, schedule.waits_for(steps), gpus)


def summary(protocol: Protocol, steps: list[planning.Step], todo: list[planning.Step], seeds: tuple[int, ...]) -> str:
    """The dry run's closing part: the price per arm, by group and in all for the stages still to
    run (`todo`), the sessions they take, and why main runs are not stacked."""
    total = planning.total_seconds(todo)
    groups = {g: sum(s.price.seconds for s in todo if s.group == g and not s.reused) for g in protocol.order}
    without_sweeps = total - groups.get(SWEPT, 0.0)
    pre = STAGE_TIMES["preprocess"]
    out = [
        "",
        f"## Price: the comparison's stages still to run, {len(seeds)} seeds",
        "",
        price_table(protocol, steps, seeds),
        "",
        "By group (GPU minutes): " + ", ".join(f"{g} {_minutes(v)}" for g, v in groups.items()),
        f"Total: {_minutes(total)} GPU minutes ({len([s for s in todo if not s.reused])} stages); "
        f"{sessions(total)} sessions of 30 device-minutes, each spending {pre.value:g} s preprocessing "
        "on a fresh machine (a lower bound: a stage cut at a session's end repeats its last checkpoint "
        "interval, and machine starts are not counted)",
        "On several GPUs (`--gpus N`: each stage on a free GPU once the stages it reads have ended, "
        "doremi/study/comparison/schedule.py): "
        + ", ".join(f"{n} GPUs {_minutes(wall_on(steps, todo, n))}" for n in (2, 4, 8))
        + " wall minutes",
        f"Without the swept arms ({', '.join(a.name for a in protocol.arms if a.kind == SWEPT)} and their sweeps): "
        f"{_minutes(without_sweeps)} GPU minutes, "
        f"{sessions(without_sweeps)} sessions",
        f"Equal compute: baselines measured at {', '.join(f'{m}x' for m in protocol.equal_compute.multiples)} "
        f"main-run tokens; beyond {corpus_capacity(protocol):.3f}x no run is within the 2-epoch rule",
        "",
        "Stacked main runs: not costed. " + " ".join(planning.STACKED_MAIN_RUNS),
    ]
    return "\n".join(out)


def power_lines(protocol: Protocol, decision: Any) -> str:
    from doremi.study import stats

    cal = json.loads(CALIBRATION.read_text()) if CALIBRATION.is_file() else None
    if cal is None:
        return ""
    r, n, arms = protocol.rule, decision.pairs, len(protocol.holm_family())
    sd = float(cal["sigma_d"])
    one = stats.detectable_effect(sd, n, r.alpha, r.power)
    holm = stats.detectable_effect(sd, n, r.alpha / arms, r.power)
    return (
        f"# power at sigma_D {sd:.4f}, {n} pairs: detectable effect {one:.4f} nats at the rule's one-sided alpha "
        f"{r.alpha:g}; {holm:.4f} at Holm's strictest alpha/{arms} (the secondary column)"
    )


#: `--whole-stages`: a stage's estimated seconds are its price times this. The prices are the
#: study's H200 times (a main run 240 s); on an H100 main runs took 256-274 s with their start
#: (experiments/results/gpu_session15), 1.14x at most.
WHOLE_MARGIN = 1.2


def visible_gpus() -> int:
    """GPUs this process may use (`--gpus` at most this many)."""
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--calibration", default=str(CALIBRATION), help="the study's calibration.json (the gate's pairs)")
    ap.add_argument("--work", default="runs/doremi_study", help="holds study/ (the study's runs) and comparison/")
    ap.add_argument("--corpus", default="runs/real_corpus")
    ap.add_argument("--deadline", type=int, default=0)
    ap.add_argument(
        "--side-by-side", type=int, default=1, help="consecutive main runs at once on the one GPU (default 1)"
    )
    ap.add_argument(
        "--gpus", type=int, default=0, help="stages at once, each on its own GPU (default: one after another)"
    )
    ap.add_argument(
        "--whole-stages",
        action="store_true",
        help="with --deadline: start no stage whose estimated time (its price x "
        f"{WHOLE_MARGIN:g}) would not end before it (a session's last call)",
    )
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--session", default="", help="a label: this call's records go to comparison/session-LABEL/")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, its commands and its price; run nothing")
    args = ap.parse_args(argv)
    if not args.out and not args.dry_run:
        die("--out (or OUT) is not set: the directory the packed results go to")
    if args.side_by_side < 1:
        die(f"--side-by-side: expected >= 1, got {args.side_by_side}")
    if args.gpus < 0 or (args.gpus and args.side_by_side > 1):
        die(f"--gpus: expected N >= 1 GPUs, and not with --side-by-side (several runs on one GPU), got {args.gpus}")
    if args.whole_stages and not args.deadline:
        die("--whole-stages: needs --deadline (the time the stages must end by)")
    if args.session and not re.fullmatch(r"[A-Za-z0-9._-]+", args.session):
        die(f"--session: expected a label of letters, digits, '.', '_' or '-', got {args.session!r}")
    try:
        decision = pairs_from_calibration(args.calibration)
        seeds = seeds_for(decision.pairs)
        check(PROTOCOL, seeds)
        steps = planning.plan(PROTOCOL, seeds)
    except ProtocolError as e:
        die(str(e))
    study = study_launcher()
    work = Path(args.work).resolve()
    corpus = Path(args.corpus).resolve()
    if not (corpus / "manifest.json").is_file() and not args.dry_run:
        die(f"{corpus}: no corpus manifest; build it with `python experiments/tools/real_corpus.py --out {corpus}`")
    stores = work / "stores"
    base = study.corpus_sets(corpus, study.CONFIG) + [f"data.store_dir={stores}"]
    finished = [done(s, PROTOCOL, work) for s in steps]
    todo = [s for s, f in zip(steps, finished) if not f]
    preprocess = [sys.executable, "-m", "doremi", "preprocess", str(study.CONFIG)]
    preprocess += sum((["--set", s] for s in base + args.sets), [])
    if args.dry_run:
        print(
            f"# the comparison (doremi/study/comparison/protocol.py): {len(PROTOCOL.arms)} arms, seeds "
            f"{', '.join(map(str, seeds))}: the calibration's gate: {decision.line()}"
        )
        print(power_lines(PROTOCOL, decision))
        print(shlex.join(preprocess[1:]))
        for step, f in zip(steps, finished):
            seed = (
                f"pool of seeds {', '.join(map(str, planning.pool_seeds(step)))}" if step.pool else f"seed {step.seed}"
            )
            head = f"# [{step.group}] {step.name} ({step.verb}; {', '.join(step.arms)}; {seed})"
            cmd = shlex.join(command_of(step, PROTOCOL, work, base, args.sets)[1:])
            if step.reused:
                state = "finished in the work folder" if f else "not yet in the work folder: the study runs it"
                print(f"{head}: reused, the study's run ({state}), never run here\n#   {cmd}")
            elif f:
                print(f"{head}: finished before, skipped")
            else:
                print(f"{head}: {step.price.seconds:.0f} s = {step.price.how}\n{cmd}")
        print(summary(PROTOCOL, steps, todo, seeds))
        return 0
    ours = [s for s in steps if not s.reused]
    if args.gpus and args.gpus > visible_gpus():
        die(f"--gpus {args.gpus}: this machine shows {visible_gpus()} GPUs")
    run_now = [i for i, (s, f) in enumerate(zip(steps, finished)) if not f and not s.reused]
    at = {i: k for k, i in enumerate(run_now)}
    every = schedule.waits_for(steps)  # finished and reused stages wait for nothing more
    waits = [tuple(at[j] for j in every[i] if j in at) for i in run_now]
    return run(args, study, work, stores, preprocess, ours, [steps[i] for i in run_now], base, waits)


def run(
    args: argparse.Namespace,
    study: ModuleType,
    work: Path,
    stores: Path,
    preprocess: list[str],
    ours: list[planning.Step],
    todo: list[planning.Step],
    base: list[str],
    waits: list[tuple[int, ...]],
) -> int:
    """Preprocess, then the stages still to run (`todo` of the comparison's own, `ours`) one
    after another, or with `--gpus` each on a free GPU once the stages it reads (`waits`, indices
    into `todo`) have ended well, the longest remaining path first (`schedule.start_order`), then pack (the study launcher's `run_stages`, `run_on_gpus`
    and `pack`). Exit 1 where a stage failed, else 3 where one stopped or was not started."""
    out, folder = Path(args.out), work / PHASE
    out.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    start = time.time()
    deadline = start + args.deadline if args.deadline else None
    log = study.records_dir(folder, args.session) / "launch.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    info: dict = {"command": "python experiments/launch/comparison.py " + shlex.join(sys.argv[1:]), "stages": []}
    info["device"] = study.device_name()
    pre = subprocess.run(preprocess, cwd=ROOT, stdout=open(log, "a"), stderr=subprocess.STDOUT)
    info["stages"].append({"stage": "preprocess", "exit_status": pre.returncode})
    status = 1 if pre.returncode else 0
    if not status:
        stages = [stage_of(s, PROTOCOL, work)[0] for s in todo]
        cmds = [command_of(s, PROTOCOL, work, base, args.sets) for s in todo]
        needs = [s.price.seconds * WHOLE_MARGIN for s in todo] if args.whole_stages else None
        if args.gpus:
            order = schedule.start_order([s.price.seconds for s in todo], waits)
            records = study.run_on_gpus(stages, cmds, log, deadline, args.gpus, waits, needs, order)
        else:
            records = study.run_stages(stages, cmds, log, deadline, args.side_by_side, needs)
        for record in records:
            info["stages"].append(record)
            if "not_started" in record:
                print(f"{record['stage']} ({record['command']}): not started ({record['not_started']})")
                continue
            on = f" on GPU {record['gpu']}" if "gpu" in record else ""
            print(f"{record['stage']} ({record['command']}): exit {record['exit_status']} in {record['seconds']} s{on}")
        ran = info["stages"][1:]
        failed = any(r["exit_status"] not in (0, None) and not r["stopped"] for r in ran)
        status = 1 if failed else 3 if any(r["stopped"] or "not_started" in r for r in ran) else 0
    info["exit_status"] = status
    # the directories of which no stage is finished (a proxy's stays once it trained, averaged or not)
    unfinished = frozenset(s.name for s in ours) - {s.name for s in ours if done(s, PROTOCOL, work)}
    archive = study.pack(out, PHASE, folder, info, stores, args.session, unfinished)
    print(f"packed {archive}; exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
