"""Run the arms of the real-data studies side by side on one GPU: DoReMi (issue 17) and the
comparison of every mixing method (issue 21, the `compare-s*` arms).

Every arm is one `doremi pipeline` (its own reference, proxy, averaged weights and main runs)
with its own seed; all share one store directory, preprocessed once. ARMS is the whole design:

    python experiments/launch/doremi_real.py --out $OUT [--arms doremi-s1,doremi-s2]
        [--corpus runs/real_corpus] [--work runs/doremi_real] [--deadline SECONDS] [--set KEY=VALUE ...]

--deadline stops every pipeline after that many seconds (exit 3); the same command again resumes
(finished stages are skipped, interrupted ones resume from their last checkpoint under --work).
Each arm's run directory, without checkpoints, is packed as $OUT/<arm>.tar.gz with its log.
Exit status: 0 all arms finished, 1 an arm failed, 2 bad usage, 3 stopped at the deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIG = ROOT / "experiments" / "configs" / "doremi_real.yaml"
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, installed or not

from doremi.methods.registry import specs  # noqa: E402

CORPUS = "runs/real_corpus"
NATURAL = "natural.json"


@dataclass(frozen=True)
class Arm:
    seed: int
    baselines: tuple[str, ...] = ()
    sets: tuple[str, ...] = field(default_factory=tuple)


#: The study. DoReMi as in the paper (eta 1, smoothing 1e-3, uniform proxy sampling, reference
#: on uniform) against uniform on 4 seeds, and natural on 2; ablations on 2 seeds each: eta 0.1,
#: and the reference trained on natural weights. `{natural}` is the natural weights JSON.
ARMS: dict[str, Arm] = {
    "doremi-s1": Arm(1, ("uniform", "{natural}")),
    "doremi-s2": Arm(2, ("uniform", "{natural}")),
    "doremi-s3": Arm(3, ("uniform",)),
    "doremi-s4": Arm(4, ("uniform",)),
    "eta0.1-s1": Arm(1, (), ("mixing.doremi.eta=0.1",)),
    "eta0.1-s2": Arm(2, (), ("mixing.doremi.eta=0.1",)),
    "natref-s1": Arm(1, (), ("mixing.doremi.reference_weights={natural}",)),
    "natref-s2": Arm(2, (), ("mixing.doremi.reference_weights={natural}",)),
}

#: The first plan's comparison of every method of the catalog (doremi/methods/registry.py; issue 21,
#: its design and rule in experiments/notes/COMPARISON.md as of dc3a74a; superseded by the
#: pre-registered protocol of doremi/study/comparison/), with the schedules that fit the study's length.
COMPARE_SETS = (
    f"pipeline.methods=[{', '.join(specs())}]",
    "mixing.doge.target_sequences=30",
    "mixing.aioli.rounds=4",
    "mixing.aioli.delta=2",
    "mixing.aioli.sweeps=1",
    "mixing.ado.warmup=40",
    "mixing.ado.refit_every=20",
    "mixing.ado.record_every=5",
    "sweep.runs=48",
    "sweep.designs=[dirichlet, one_hot]",
    "sweep.prior={natural}",
)
ARMS.update({f"compare-s{s}": Arm(s, ("uniform", "{natural}", "unimax:2"), COMPARE_SETS) for s in (1, 2, 3, 4)})


def die(msg: str) -> None:
    print(f"doremi_real: error: {msg}", file=sys.stderr)
    sys.exit(2)


def natural_weights(corpus_manifest: Path, out: Path) -> Path:
    """Weights proportional to each source's uncapped size in bytes (the corpus manifest's
    `uncapped_bytes`), as a weights JSON."""
    from data.sampling.weights_file import write_weights_file

    raw = json.loads(corpus_manifest.read_text())
    outputs = raw["outputs"]
    domains = list(outputs)
    sizes = [float(outputs[d]["uncapped_bytes"]) for d in domains]
    total = sum(sizes)
    where = corpus_manifest.resolve()
    where = where.relative_to(ROOT) if where.is_relative_to(ROOT) else where
    return write_weights_file(
        out, domains, [s / total for s in sizes], {"source": f"uncapped bytes per domain, {where}"}
    )


def corpus_sets(corpus: Path) -> list[str]:
    """`--set` overrides pointing the study's domains at `corpus`/<domain>.jsonl.xz."""
    import yaml

    names = [d["name"] for d in yaml.safe_load(CONFIG.read_text())["data"]["domains"]]
    domains = [{"name": n, "paths": [str(corpus / f"{n}.jsonl.xz")]} for n in names]
    return [f"data.domains={json.dumps(domains)}"]


def arm_command(name: str, arm: Arm, work: Path, natural: Path, sets: list[str]) -> list[str]:
    fill = lambda s: s.replace("{natural}", str(natural))  # noqa: E731
    baselines = "[" + ", ".join(fill(b) for b in arm.baselines) + "]"
    cmd = [
        sys.executable,
        "-m",
        "doremi",
        "pipeline",
        str(CONFIG),
        "--set",
        f"pipeline.run_dir={work / name}",
        "--set",
        f"data.store_dir={work / 'stores'}",
        "--set",
        f"train.seed={arm.seed}",
        "--set",
        f"data.seed={arm.seed}",
        "--set",
        f"pipeline.baselines={baselines}",
    ]
    for s in list(arm.sets) + sets:
        cmd += ["--set", fill(s)]
    return cmd


def pack(name: str, work: Path, out: Path, log: Path, info: dict) -> None:
    run = work / name
    run.mkdir(parents=True, exist_ok=True)
    (run / "run_info.json").write_text(json.dumps(info, indent=1) + "\n")
    manifest = work / "stores" / "manifest.json"
    with tarfile.open(out / f"{name}.tar.gz", "w:gz") as tar:
        tar.add(run, arcname=name, filter=lambda t: None if "/checkpoints" in t.name else t)
        if manifest.is_file():
            tar.add(manifest, arcname=f"{name}/stores/manifest.json")
        if log.is_file():
            tar.add(log, arcname=f"{name}/pipeline.log")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--corpus", default=CORPUS)
    ap.add_argument("--work", default="runs/doremi_real")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--deadline", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    args = ap.parse_args(argv)
    if not args.out:
        die("--out (or OUT) is not set: the directory the packed results go to")
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        die(f"--arms: unknown arm(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(ARMS)}")
    corpus = Path(args.corpus)
    if not (corpus / "manifest.json").is_file():
        die(f"{corpus}: no corpus manifest; build it with `python experiments/tools/real_corpus.py --out {corpus}`")
    args.sets = corpus_sets(corpus.resolve()) + args.sets
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    start = time.time()
    say = lambda m: print(f"[{int(time.time() - start)}s] {m}", flush=True)  # noqa: E731
    natural = natural_weights(corpus / "manifest.json", work / NATURAL)
    say(f"natural weights -> {natural}")

    say("preprocess")
    pre = subprocess.run(
        [
            sys.executable,
            "-m",
            "doremi",
            "preprocess",
            str(CONFIG),
            "--set",
            f"data.store_dir={work / 'stores'}",
            *sum((["--set", s] for s in args.sets), []),
        ],
        cwd=ROOT,
    )
    if pre.returncode:
        print("doremi_real: preprocess failed", file=sys.stderr)
        return 1

    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    for name in arms:
        logs[name] = out / f"{name}.log"
        cmd = arm_command(name, ARMS[name], work, natural, args.sets)
        with open(logs[name], "a") as log:
            procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        say(f"{name}: started ({shlex.join(cmd[3:])})")

    stopped = False
    while any(p.poll() is None for p in procs.values()):
        if args.deadline and time.time() - start >= args.deadline:
            say(f"deadline of {args.deadline}s reached: stopping the pipelines")
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            stopped = True
            break
        time.sleep(5)
    failed = False
    for name, p in procs.items():
        rc = p.wait()
        if rc and stopped:
            say(f"{name}: stopped at the deadline (run the same command again to resume)")
        elif rc:
            failed = True
            tail = logs[name].read_text(errors="replace").splitlines()[-15:]
            say(f"{name}: FAILED (exit {rc}); last lines:\n" + "\n".join(tail))
        else:
            say(f"{name}: finished")
        info = {
            "arm": name,
            "exit_status": rc,
            "elapsed_s": int(time.time() - start),
            "command": "python experiments/launch/doremi_real.py " + shlex.join(sys.argv[1:]),
            "pipeline": shlex.join(arm_command(name, ARMS[name], work, natural, args.sets)[1:]),
        }
        pack(name, work, out, logs[name], info)
    return 1 if failed else 3 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
