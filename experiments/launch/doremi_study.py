"""Run the powered DoReMi study's phases on one GPU, one stage after another (issue 34).

    python experiments/launch/doremi_study.py PHASE --out $OUT [--seeds 1,2,3,4]
        [--work runs/doremi_study] [--corpus runs/real_corpus] [--deadline SECONDS]
        [--synthetic] [--steps N] [--set KEY=VALUE ...] [--session LABEL]

PHASE is one of
- `determinism`: the main shape twice with `train.deterministic` on and twice with it off, same
  seeds (`--steps`, default 200); the table says whether each pair is bitwise equal (every
  logged loss and gradient norm, and the final checkpoint's model files by their XXH3 hashes).
  `--synthetic` runs it on the GPU-scale config's six embedded and synthetic domains instead of
  the real corpus.
- `calibrate`: the main runs of the calibration (../shared/study-design.md): uniform and the
  first study's averaged DoReMi weights (fixed) on each seed; `doremi study calibrate` reads them.
- `study`: per seed its reference (on `mixing.doremi.reference_weights`), its DoReMi proxy (data seed
  offset by 1000 from its reference's, so the reference never saw the proxy's batches in the
  same order), the averaged weights, and the main runs uniform, natural and doremi; then the
  proxies' weights pooled over --seeds (`pooled/weights.json`, `doremi average` of them all) and
  per seed the main run doremi_pooled on them.

Every stage is an ordinary `doremi` command on experiments/configs/doremi_study.yaml (main runs
take its `pipeline.main` section as --set overrides), in its own run directory under --work; a
finished stage (its run.json or weights.json header says so) is skipped without starting a
process, an interrupted one resumes from its checkpoint. Arms run one after another, never side by side: with deterministic kernels
a run is then a function of its seeds (trainer/run/determinism.py). --deadline sends the running
stage SIGTERM after that many seconds (it saves a checkpoint and exits); the same command again
resumes. The run directories, without checkpoints, and the log are packed as
$OUT/<phase>.tar.xz, with launch.json (commands, seconds per stage, device, exit status);
with `--session LABEL` the records of each call go to `<phase>/session-LABEL/` instead
(`launch-call<n>.json`, `launch.log`, `stores-manifest.json`), so that the archive the next
session unpacks keeps every session's records apart with no hand-merging.
Exit status: 0 all finished, 1 a stage failed, 2 bad usage or stores other than those of the
finished runs (`stores_mismatch`; nothing runs), 3 stopped at the deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIG = ROOT / "experiments" / "configs" / "doremi_study.yaml"
SYNTHETIC_CONFIG = ROOT / "experiments" / "configs" / "gpu_scale.yaml"
PHASES = ("determinism", "calibrate", "study")

#: The fixed mixture of the calibration: the first study's DoReMi weights, mean over its 4 seeds
#: (experiments/results/doremi_real.md, "Averaged weights"), in the config's domain order.
FIXED_WEIGHTS = (0.0431, 0.1538, 0.0782, 0.0802, 0.0821, 0.0972, 0.0870, 0.0697, 0.0661, 0.1383, 0.0662, 0.0381)

#: The data seed of a proxy is its reference's plus this (study-design.md, "Reference and proxy").
PROXY_DATA_SEED_OFFSET = 1000
#: The pooled DoReMi arm (doremi/study/design.py): every seed's main run trains on the mean of
#: the --seeds proxies' weights, written to POOLED/weights.json once all of them are finished.
POOLED_ARM, POOLED = "doremi_pooled", "pooled"


@dataclass(frozen=True)
class Stage:
    """One `doremi` command: `name` is its run directory under the phase's folder."""

    name: str
    command: str  # train, train-reference, train-proxy, average
    sets: tuple[str, ...] = ()
    main: bool = False  # take the config's pipeline.main overrides
    pooled: tuple[str, ...] = ()  # average: the proxies pooled into <name>/weights.json (else <name>'s own)


def flat_sets(section: dict, prefix: str = "") -> list[str]:
    """A nested config section as `key.path=value` overrides (values as JSON, which YAML reads)."""
    out = []
    for key, value in section.items():
        path = f"{prefix}{key}"
        out += flat_sets(value, path + ".") if isinstance(value, dict) else [f"{path}={json.dumps(value)}"]
    return out


def main_sets(config: Path) -> list[str]:
    import yaml

    return flat_sets(yaml.safe_load(config.read_text())["pipeline"]["main"])


def seeded(seed: int, data_seed: int | None = None) -> tuple[str, ...]:
    return (f"train.seed={seed}", f"data.seed={seed if data_seed is None else data_seed}")


def determinism_stages(steps: int) -> list[Stage]:
    common = (f"train.steps={steps}", "train.warmup_steps=20", "train.eval_every=0", "logging.every=10")
    on, off = ("train.deterministic=true",), ("train.deterministic=false",)
    return [
        Stage(name, "train", common + seeded(1) + switch, main=True)
        for name, switch in (("on-a", on), ("on-b", on), ("off-a", off), ("off-b", off))
    ]


def calibration_stages(seeds: list[int]) -> list[Stage]:
    fixed = "data.domain_weights=[" + ", ".join(str(w) for w in FIXED_WEIGHTS) + "]"
    out = []
    for s in seeds:
        out.append(Stage(f"uniform-seed{s}", "train", seeded(s) + ("data.domain_weights=uniform",), main=True))
        out.append(Stage(f"fixed-seed{s}", "train", seeded(s) + (fixed,), main=True))
    return out


def study_stages(seeds: list[int], work: Path) -> list[Stage]:
    out = []
    for s in seeds:
        ref, proxy = work / f"reference-seed{s}", work / f"proxy-seed{s}"
        out.append(Stage(ref.name, "train-reference", seeded(s)))
        out.append(
            Stage(
                proxy.name, "train-proxy", seeded(s, s + PROXY_DATA_SEED_OFFSET) + (f"mixing.doremi.reference={ref}",)
            )
        )
        out.append(Stage(proxy.name, "average"))
        for arm, weights in (("uniform", "uniform"), ("natural", "tokens"), ("doremi", str(proxy / "weights.json"))):
            out.append(Stage(f"{arm}-seed{s}", "train", seeded(s) + (f"data.domain_weights={weights}",), main=True))
    pooled = work / POOLED
    out.append(Stage(pooled.name, "average", pooled=tuple(f"proxy-seed{s}" for s in seeds)))
    for s in seeds:
        weights = f"data.domain_weights={pooled / 'weights.json'}"
        out.append(Stage(f"{POOLED_ARM}-seed{s}", "train", seeded(s) + (weights,), main=True))
    return out


def corpus_sets(corpus: Path, config: Path) -> list[str]:
    """--set overrides pointing the study's domains at `corpus`/<domain>.jsonl.xz."""
    import yaml

    names = [d["name"] for d in yaml.safe_load(config.read_text())["data"]["domains"]]
    return ["data.domains=" + json.dumps([{"name": n, "paths": [str(corpus / f"{n}.jsonl.xz")]} for n in names])]


def synthetic_sets() -> list[str]:
    """The GPU-scale config's domains and tokenizer, in place of the real corpus."""
    import yaml

    data = yaml.safe_load(SYNTHETIC_CONFIG.read_text())["data"]
    return [
        "data.domains=" + json.dumps(data["domains"]),
        "data.tokenizer=" + json.dumps(data["tokenizer"]),
        "data.holdout_sequences=0",
    ]


def command(stage: Stage, folder: Path, base: list[str], main: list[str], user: list[str]) -> list[str]:
    """The stage's command line: the data overrides, then the main runs' section, the stage's
    own keys, the user's --set (last, so they win) and the run directory."""
    cmd = [sys.executable, "-m", "doremi", stage.command]
    if stage.command == "average" and stage.pooled:
        return cmd + [str(folder / p) for p in stage.pooled] + ["--out", str(folder / stage.name / "weights.json")]
    if stage.command == "average":
        return cmd + [str(folder / stage.name)]
    cmd.append(str(CONFIG))
    sets = base + (main if stage.main else []) + list(stage.sets) + user + [f"train.run_dir={folder / stage.name}"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def model_hashes(run: Path) -> dict[str, str]:
    """The final checkpoint's model files and their recorded XXH3 hashes (trainer/checkpoint/checkpoint.py)."""
    ckpts = sorted(p for p in (run / "checkpoints").glob("step_*") if (p / "meta.json").is_file())
    if not ckpts:
        return {}
    files = json.loads((ckpts[-1] / "meta.json").read_text()).get("files", {})
    return {name: str(info) for name, info in files.items() if name.startswith("model")}


def logged(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def determinism_table(folder: Path) -> str:
    lines = [
        "| switch | logged steps | first differing step | losses at the last step | model files equal |",
        "|---|---:|---|---|---|",
    ]
    for switch in ("on", "off"):
        a, b = folder / f"{switch}-a", folder / f"{switch}-b"
        la, lb = logged(a), logged(b)
        differ = next((x[0] for x, y in zip(la, lb) if x != y), None)
        ha, hb = model_hashes(a), model_hashes(b)
        last = f"{la[-1][1]!r} / {lb[-1][1]!r}" if la and lb else "-"
        lines.append(
            f"| {switch} | {len(la)} | {differ if differ is not None else 'none'} | {last} | "
            f"{'yes' if ha and ha == hb else 'no'} |"
        )
    return "\n".join(lines)


def records_dir(folder: Path, session: str) -> Path:
    """Where a call's launch records go: the phase's folder itself, or with `--session LABEL`
    its `session-LABEL/`, so that the calls of one device session leave their records apart from
    other sessions' in the archive that the next session unpacks (the study spans sessions)."""
    return folder / f"session-{session}" if session else folder


def pack(
    out: Path,
    phase: str,
    folder: Path,
    info: dict,
    stores: Path,
    session: str = "",
    unfinished: frozenset = frozenset(),
) -> Path:
    """The run directories (without checkpoints) and the call's records (the log among them), as
    `$OUT/<phase>.tar.xz`. The directories named in `unfinished` (stages interrupted or not yet
    begun) are left out: their checkpoints never travel, so a later session redoes them from the
    start, and a partial directory in the archive would only stand in the way of that.
    With a session label the record is `session-LABEL/launch-call<n>.json` (n counting this
    session's calls) and the stores' manifest `session-LABEL/stores-manifest.json`; without, one
    `launch.json` and `stores/manifest.json`, rewritten by every call."""
    records = records_dir(folder, session)
    records.mkdir(parents=True, exist_ok=True)
    if session:
        n = 1 + len(list(records.glob("launch-call*.json")))
        (records / f"launch-call{n}.json").write_text(json.dumps(info, indent=1) + "\n")
        if (stores / "manifest.json").is_file():
            shutil.copyfile(stores / "manifest.json", records / "stores-manifest.json")
    else:
        (folder / "launch.json").write_text(json.dumps(info, indent=1) + "\n")
    archive = out / f"{phase}.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(folder, arcname=phase, filter=lambda t: None if _left_out(t.name, unfinished) else t)
        if not session and (stores / "manifest.json").is_file():
            tar.add(stores / "manifest.json", arcname=f"{phase}/stores/manifest.json")
    return archive


def _left_out(member: str, unfinished: frozenset) -> bool:
    parts = member.split("/")
    return "checkpoints" in parts or (len(parts) > 1 and parts[1] in unfinished)


def left_unfinished(stages: list[Stage], folder: Path) -> frozenset:
    """The run directories of which no stage is finished (a proxy's directory stays once its
    training is, whether or not its average is)."""
    return frozenset({s.name for s in stages} - {s.name for s in stages if finished(s, folder)})


def batches(stages: list[Stage], side_by_side: int) -> list[list[int]]:
    """Stage indices in the order they run: up to `side_by_side` consecutive main runs (`train`
    stages with the main overrides) at once (their results do not depend on it, `run_stages`),
    every other stage alone: a main-shaped fit, say, writes the weights its next stages read."""

    def together(stage: Stage) -> bool:
        return stage.main and stage.command == "train"

    out: list[list[int]] = []
    for i, stage in enumerate(stages):
        if together(stage) and out and len(out[-1]) < side_by_side and all(together(stages[j]) for j in out[-1]):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def finished(stage: Stage, folder: Path) -> bool:
    """Whether the stage's output is already there and finished (its artifact header), so a
    resumed call starts no process for it: a trainer would build, compile and load its final
    checkpoint only to find nothing to do."""
    sys.path.insert(0, str(ROOT))
    from data import artifact

    record = folder / stage.name / ("weights.json" if stage.command == "average" else "run.json")
    header = artifact.read(record) if record.is_file() else None
    if header is not None and stage.pooled:
        made_from = sorted(Path(src.path).name for src in header.sources if src.kind == "run")
        if made_from != sorted(stage.pooled):
            die(
                f"{record}: pools {', '.join(made_from)}, this call's --seeds pool {', '.join(stage.pooled)}; "
                f"runs may have trained on it: move it aside (and its doremi_pooled runs) to pool again"
            )
    return header is not None and header.status == "finished"


def run_stages(
    stages: list[Stage],
    cmds: list[list[str]],
    log: Path,
    deadline: float | None,
    side_by_side: int = 1,
    needs: list[float] | None = None,
) -> Iterator[dict]:
    """Run the commands, a batch at a time (`batches`), each to its end or to the deadline
    (SIGTERM: the stage saves a checkpoint and stops), yielding one record per stage. With
    `needs` (each stage's estimated seconds), a batch that would not end before the deadline is
    not started: its stages' records say so (`not_started`) and the call stops there, for a
    session's last call, whose stopped stage's checkpoint would go back with the machine.

    Side by side, the processes time-slice one GPU: with deterministic kernels each run is
    bitwise the run it would be alone (../shared/study-design.md, "Measured since": three
    same-seed runs started together equal a run alone), and the batch overlaps the runs'
    compilation, evaluation and start-up (this study's calibration, call 3: three main runs in
    529 s of wall time against about 800 s one after another)."""
    for batch in batches(stages, side_by_side):
        start = time.time()
        if needs is not None and deadline is not None:
            need = max(needs[i] for i in batch)
            if start + need > deadline:
                for i in batch:
                    yield {
                        "stage": stages[i].name,
                        "command": stages[i].command,
                        "exit_status": None,
                        "seconds": 0.0,
                        "stopped": True,
                        "not_started": f"needs about {need:.0f} s, {max(0.0, deadline - start):.0f} s left",
                        "side_by_side": len(batch),
                        "argv": shlex.join(cmds[i][1:]),
                    }
                return
        procs = {}
        for i in batch:
            out = open(log if len(batch) == 1 else log.with_name(f"{log.stem}-{stages[i].name}.log"), "a")
            out.write(f"\n$ {shlex.join(cmds[i][1:])}\n")
            out.flush()
            procs[i] = (
                subprocess.Popen(cmds[i], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True),
                out,
            )
        stopped = False
        while any(p.poll() is None for p, _ in procs.values()):
            if deadline is not None and time.time() >= deadline and not stopped:
                for p, _ in procs.values():
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGTERM)
                stopped = True
            time.sleep(1)
        for i, (p, out) in procs.items():
            out.close()
            yield {
                "stage": stages[i].name,
                "command": stages[i].command,
                "exit_status": p.returncode,
                "seconds": round(time.time() - start, 1),
                "stopped": stopped,
                "side_by_side": len(batch),
                "argv": shlex.join(cmds[i][1:]),
            }
        if stopped or any(p.returncode for p, _ in procs.values()):
            return


#: Seconds between looks at the running stages of `run_on_gpus`.
POLL_SECONDS = 0.2


def run_on_gpus(
    stages: list[Stage],
    cmds: list[list[str]],
    log: Path,
    deadline: float | None,
    gpus: int,
    waits: list[tuple[int, ...]],
    needs: list[float] | None = None,
    order: Sequence[int] | None = None,
) -> Iterator[dict]:
    """Run the commands on `gpus` GPUs, each stage alone on one (`CUDA_VISIBLE_DEVICES`, its
    log `<log>-<stage>.log`), yielding one record per stage as it ends. Whenever a GPU is free,
    the first stage in `order` (every stage's index once, doremi/study/comparison/schedule.py
    `start_order`; the stages' own order by default) whose `waits` (indices of the stages whose
    outputs it reads, `waits_for`) have all exited 0 starts on it; a stage
    waiting for one that failed or was not started is not started either (its record says
    which), and the stages that do not depend on it go on. With `needs` and `deadline`, a stage
    whose estimated seconds would not end before the deadline is not started (a session's last
    call: its checkpoint would go back with the machine); at the deadline every running stage
    gets SIGTERM (it checkpoints) and nothing more starts. A stage's result does not depend on
    what runs beside it: each has its own GPU, and with deterministic kernels a run is bitwise
    the run alone (../shared/study-design.md)."""
    if gpus < 1 or len(waits) != len(stages) or len(cmds) != len(stages):
        raise ValueError(f"run_on_gpus: {len(stages)} stages, {len(cmds)} commands, {len(waits)} waits, {gpus} GPUs")
    pending = list(range(len(stages)) if order is None else order)
    if sorted(pending) != list(range(len(stages))):
        raise ValueError(f"run_on_gpus: the order {pending} is not every stage's index once")
    ok: set[int] = set()
    bad: dict[int, str] = {}
    free = list(range(gpus))
    running: dict[int, tuple[subprocess.Popen, object, int, float]] = {}
    stopped = False

    def record(i: int, **fields) -> dict:
        return {"stage": stages[i].name, "command": stages[i].command, **fields, "argv": shlex.join(cmds[i][1:])}

    while pending or running:
        now = time.time()
        if deadline is not None and now >= deadline and not stopped:
            for proc, *_ in running.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            stopped = True
        for i in list(pending):
            if stopped or not free:
                break
            failed = [j for j in waits[i] if j in bad]
            if failed:
                pending.remove(i)
                bad[i] = "not started"
                why = ", ".join(f"{stages[j].name} ({bad[j]})" for j in failed)
                yield record(i, exit_status=None, seconds=0.0, stopped=False, not_started=f"waits for {why}")
                continue
            if any(j not in ok for j in waits[i]):
                continue
            if needs is not None and deadline is not None and now + needs[i] > deadline:
                pending.remove(i)
                bad[i] = "not started"
                left = max(0.0, deadline - now)
                yield record(
                    i,
                    exit_status=None,
                    seconds=0.0,
                    stopped=True,
                    not_started=f"needs about {needs[i]:.0f} s, {left:.0f} s left",
                )
                continue
            pending.remove(i)
            gpu = free.pop(0)
            out = open(log.with_name(f"{log.stem}-{stages[i].name}.log"), "a")
            out.write(f"\n$ {shlex.join(cmds[i][1:])}\n")
            out.flush()
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
            proc = subprocess.Popen(
                cmds[i], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
            running[i] = (proc, out, gpu, now)
        if not running:
            return  # the rest wait for stages that cannot start (stopped at the deadline)
        ended = [i for i, (proc, *_) in running.items() if proc.poll() is not None]
        if not ended:
            time.sleep(POLL_SECONDS)
            continue
        for i in ended:
            proc, out, gpu, start = running.pop(i)
            out.close()
            free.append(gpu)
            free.sort()
            if proc.returncode == 0 and not stopped:
                ok.add(i)
            else:
                bad[i] = "stopped" if stopped else f"exit {proc.returncode}"
            yield record(
                i, exit_status=proc.returncode, seconds=round(time.time() - start, 1), stopped=stopped, gpu=gpu
            )


def stores_mismatch(folder: Path, stores: Path) -> str | None:
    """One line naming the finished runs in `folder` that were trained on other stores than
    `stores` (their headers' `stores` source against the stores' own fingerprint), or None.

    A study spans sessions, and each fresh machine rebuilds the corpus and the stores: a seed
    trained on other data than the seeds before it would enter the pairs' table silently, so
    the launcher compares before it starts any stage (docs/design.md section 6b)."""
    sys.path.insert(0, str(ROOT))
    from data import artifact

    header = artifact.read(stores)
    want = header.fingerprint if header is not None else None
    other: dict[str, list[str]] = {}
    for record in sorted(folder.glob("*/run.json")):
        run = artifact.read(record)
        if run is None or run.status != "finished":
            continue
        for source in run.sources:
            if source.kind == "stores" and source.fingerprint != want:
                other.setdefault(str(source.fingerprint)[:16], []).append(record.parent.name)
    if not other:
        return None
    seen = "; ".join(f"{fp} ({', '.join(runs)})" for fp, runs in sorted(other.items()))
    return f"{stores}: stores fingerprint {str(want)[:16]}, but finished runs were trained on {seen}"


def check_gate(calibration: str | None) -> None:
    """The study starts only on the calibration gate's final GO (`doremi study calibrate`:
    every planned pair measured). A study spans several sessions, so one call may run fewer
    seeds than the gate's pairs; `doremi study summarize --calibration` names an arm that ends
    with fewer, and its verdict then does not count."""
    if not calibration:
        die("study: --calibration is required (the calibration.json of `doremi study calibrate`)")
    try:
        decision = json.loads(Path(calibration).read_text())["decision"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        die(f"--calibration {calibration}: not a calibration.json ({e})")
    if not decision.get("go") or decision.get("provisional"):
        die(f"study: the calibration gate does not let it start: {decision.get('line')}")


def die(msg: str) -> None:
    print(f"doremi_study: error: {msg}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=PHASES)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--seeds", default="1,2,3,4")
    ap.add_argument("--work", default="runs/doremi_study")
    ap.add_argument("--corpus", default="runs/real_corpus")
    ap.add_argument("--deadline", type=int, default=0)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument(
        "--session",
        default="",
        help="a label (e.g. 8): this call's launch records, log and stores manifest go to <phase>/session-LABEL/",
    )
    ap.add_argument("--side-by-side", type=int, default=1, help="main runs at once on the one GPU (default 1)")
    ap.add_argument("--calibration", help="study: the calibration.json whose gate lets the study start")
    ap.add_argument(
        "--dry-run", action="store_true", help="print the commands of the stages not finished yet, run nothing"
    )
    args = ap.parse_args(argv)
    if not args.out and not args.dry_run:
        die("--out (or OUT) is not set: the directory the packed results go to")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        die(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if args.side_by_side < 1:
        die(f"--side-by-side: expected >= 1, got {args.side_by_side}")
    if not seeds or len(set(seeds)) != len(seeds):
        die(f"--seeds: expected distinct seeds, got {args.seeds!r}")
    if args.session and not re.fullmatch(r"[A-Za-z0-9._-]+", args.session):
        die(f"--session: expected a label of letters, digits, '.', '_' or '-', got {args.session!r}")
    if args.phase == "study":
        check_gate(args.calibration)
    work = Path(args.work).resolve()
    folder = work / args.phase
    stores = work / ("stores-synthetic" if args.synthetic else "stores")
    if args.synthetic:
        data_sets = synthetic_sets()
    else:
        corpus = Path(args.corpus).resolve()
        if not (corpus / "manifest.json").is_file() and not args.dry_run:
            die(f"{corpus}: no corpus manifest; build it with `python experiments/tools/real_corpus.py --out {corpus}`")
        data_sets = corpus_sets(corpus, CONFIG)
    base = data_sets + [f"data.store_dir={stores}"]
    stages = {
        "determinism": lambda: determinism_stages(args.steps),
        "calibrate": lambda: calibration_stages(seeds),
        "study": lambda: study_stages(seeds, folder),
    }[args.phase]()
    planned = list(stages)
    main_overrides = main_sets(CONFIG)
    cmds = [command(s, folder, base, main_overrides, args.sets) for s in stages]
    preprocess = [sys.executable, "-m", "doremi", "preprocess", str(CONFIG)]
    preprocess += sum((["--set", s] for s in base + args.sets), [])
    if args.dry_run:
        print(shlex.join(preprocess[1:]))
        for stage, cmd in zip(stages, cmds):
            done = finished(stage, folder)
            print(f"# {stage.name} ({stage.command}): finished before, skipped" if done else shlex.join(cmd[1:]))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    start = time.time()
    deadline = start + args.deadline if args.deadline else None
    log = records_dir(folder, args.session) / "launch.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    say = lambda m: print(f"[{int(time.time() - start)}s] {m}", flush=True)  # noqa: E731
    info: dict = {
        "command": "python experiments/launch/doremi_study.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "device": device_name(),
        "stages": [],
    }
    say("preprocess")
    t0 = time.time()
    pre = subprocess.run(preprocess, cwd=ROOT, stdout=open(log, "a"), stderr=subprocess.STDOUT)
    info["stages"].append({"stage": "preprocess", "exit_status": pre.returncode, "seconds": round(time.time() - t0, 1)})
    status = 0
    if pre.returncode:
        say("preprocess FAILED: " + " | ".join(log.read_text(errors="replace").splitlines()[-5:]))
        status = 1
    elif (mismatch := stores_mismatch(folder, stores)) is not None:
        say(f"stopped before any stage: {mismatch}")
        info["stores_mismatch"] = mismatch
        status = 2
    else:
        todo = [i for i, stage in enumerate(stages) if not finished(stage, folder)]
        for i in sorted(set(range(len(stages))) - set(todo)):
            say(f"{stages[i].name} ({stages[i].command}): finished before, skipped")
            info["stages"].append({"stage": stages[i].name, "command": stages[i].command, "skipped": "finished"})
        stages, cmds = [stages[i] for i in todo], [cmds[i] for i in todo]
        for record in run_stages(stages, cmds, log, deadline, args.side_by_side):
            info["stages"].append(record)
            say(f"{record['stage']} ({record['command']}): exit {record['exit_status']} in {record['seconds']} s")
            if record["stopped"]:
                status = 3
            elif record["exit_status"]:
                say(
                    f"{record['stage']} FAILED: see {folder.name}/launch*.log; "
                    + " | ".join(log.read_text(errors="replace").splitlines()[-8:])
                )
                status = status or 1
    info["exit_status"] = status
    info["elapsed_s"] = round(time.time() - start, 1)
    if args.phase == "determinism" and status == 0:
        table = determinism_table(folder)
        (folder / "determinism.md").write_text(table + "\n")
        print(table)
    archive = pack(out, args.phase, folder, info, stores, args.session, left_unfinished(planned, folder))
    say(f"packed {archive} ({archive.stat().st_size / 1e6:.1f} MB); exit {status}")
    return status


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception as e:  # noqa: BLE001 - the record names what it could not read
        return f"unknown ({e})"


if __name__ == "__main__":
    sys.exit(main())
