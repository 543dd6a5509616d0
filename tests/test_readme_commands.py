"""The README's contract: every command it shows (and the docs pages' in DOCS) is run by a test.

`test_every_readme_command_has_a_test` extracts the commands (each line of a fenced bash block,
and each inline span that starts with a program and has arguments) and requires each in
COVERED, with the tests that run it. A new or changed command fails there until a test runs it.
The commands no other test ran are run here as a user runs them: the page's own line (looked
up in it, so an edit that breaks one fails here), with only size keys appended, from a scratch
directory holding a link to `experiments/`, so `runs/...` lands in the scratch directory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.runs import alphas
from trainer.records.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
# The pages whose commands are run; tests/test_readme.py requires every docs page but the two
# references (design.md, config.md) here.
DOCS = (
    "README.md",
    "docs/index.md",
    "docs/commands.md",
    "docs/own_data.md",
    "docs/methods.md",
    "docs/verdicts.md",
    "docs/runs.md",
    "docs/gpu.md",
    "docs/hugging_face.md",
    "docs/architecture.md",
    "docs/newcomer.md",
)
BIN = Path(sys.executable).parent
PROGRAMS = ("doremi", "make", "torchrun", "python", "sbatch", "pip")
QUICKSTART = "experiments/configs/quickstart.yaml"
DOMAINS = ["code", "docs", "notes", "noise", "repeat", "markov"]
STEPS = 4
SIZE = [
    f"train.steps={STEPS}",
    f"train.eval_every={STEPS}",
    "train.eval_sequences=16",
    "logging.progress=false",
    "logging.every=1",
    "checkpoint.every=0",
    "model.d_model=32",
    "model.n_layers=2",
    "model.ffn_dim=64",
]
PIPELINE_SIZE = [
    *SIZE,
    "train.eval_every=2",
    f"pipeline.main.train.steps={STEPS}",
    "pipeline.main.model.d_model=32",
    "pipeline.main.model.n_layers=2",
    "pipeline.main.model.ffn_dim=64",
    "pipeline.methods=[doremi]",
    "pipeline.baselines=[uniform]",
]
HERE = "tests/test_readme_commands.py"
CHAIN = f"{HERE}::test_the_staged_chain_on_the_quickstart"
HF = f"{HERE}::test_hugging_face_commands_on_the_quickstart_run"
LOOK = f"{HERE}::test_look_before_running"
QS = "tests/test_quickstart.py::test_readme_sweep_and_fit_commands"
OWN = "tests/test_own_data.py::test_own_jsonl_files_through_the_readme_route"
TORCHRUN = "tests/test_cli.py::test_torchrun_data_parallel"

# Each command of the pages in DOCS -> the tests that run it (exactly, or with
# size keys added; templates such as CONFIG: an instance of them).
COVERED: dict[str, list[str]] = {
    "make quickstart": [
        f"{HERE}::test_make_targets_run_the_readme_commands",
        "tests/test_quickstart.py::test_every_stage_ran_and_report_matches_the_runs",
    ],
    "make test": [f"{HERE}::test_make_targets_run_the_readme_commands"],
    "make test-fast": [f"{HERE}::test_make_targets_run_the_readme_commands"],
    "make TORCH_SPEC=torch quickstart": [
        "tests/test_makefile.py::test_a_changed_torch_spec_reinstalls_torch_and_an_unchanged_one_does_nothing"
    ],
    f"doremi preprocess {QUICKSTART}": [CHAIN, QS],
    f"doremi train-reference {QUICKSTART} --set train.run_dir=runs/ref": [CHAIN],
    f"doremi score {QUICKSTART} --set mixing.doremi.reference=runs/ref --out runs/ref-cache": [CHAIN],
    f"doremi train-proxy {QUICKSTART} --set train.run_dir=runs/proxy --set mixing.doremi.reference=runs/ref": [CHAIN],
    "doremi average runs/proxy": [CHAIN],
    f"doremi train {QUICKSTART} --set data.domain_weights=runs/proxy/weights.json": [CHAIN],
    "doremi eval runs/quickstart/train": [CHAIN],
    f"doremi pipeline {QUICKSTART}": ["tests/test_cli.py::test_pipeline_under_torchrun"],
    "doremi plan experiments/configs/llama3_70b.yaml --gpus 16 --gpu-memory 96": ["tests/test_cli.py::test_plan_70b"],
    f"doremi sweep {QUICKSTART} --set sweep.runs=32": [QS],
    f"doremi fit {QUICKSTART} --method mixing_law": [QS],
    "doremi config own_data.yaml": [OWN],
    "doremi preprocess own_data.yaml": [OWN],
    "doremi inspect own_data.yaml -n 2": [OWN],
    "doremi plan own_data.yaml --gpus 1 --gpu-memory 80": [OWN],
    "doremi pipeline own_data.yaml": [OWN],
    f"doremi config {QUICKSTART} --set train.steps=10": [LOOK],
    "doremi config --presets": ["tests/test_config_ux.py::test_config_lists_presets_with_sizes"],
    "doremi config --keys": ["tests/test_config_ux.py::test_config_keys_documents_every_key"],
    "doremi inspect runs/quickstart/stores -n 2": [LOOK],
    f"doremi inspect {QUICKSTART} --domain code": [LOOK],
    "doremi export runs/quickstart/train runs/quickstart-hf": [HF],
    "doremi import runs/quickstart-hf --out runs/from-hf.yaml": [HF],
    f"doremi train {QUICKSTART} --set model.init_from_hf=runs/quickstart-hf --set train.run_dir=runs/from-hf": [HF],
    "doremi <stage> CONFIG.yaml [--set key.path=value ...]": [CHAIN],
    "doremi <stage> CONFIG": [CHAIN],
    "torchrun --standalone --nproc_per_node=2 -m doremi train CONFIG --set parallelism.dp=2": [TORCHRUN],
    "torchrun ... -m doremi": [TORCHRUN],
    "python -m doremi": ["tests/test_packaging.py::test_python_m_doremi_is_not_shadowed_by_the_working_directory"],
    "doremi --debug ...": [f"{HERE}::test_debug_shows_the_traceback"],
    "doremi compare ROOT1 ROOT2 ... --out DIR": [f"{HERE}::test_seeds_then_compare"],
    "doremi compare runs/NAME-s* --out runs/NAME-compare": [f"{HERE}::test_seeds_then_compare"],
    "doremi sweep CONFIG": [QS],
    "doremi fit CONFIG --method regmix|mixing_law": [
        QS,
        "tests/test_sweep.py::test_fit_proposes_a_capped_mixture_with_its_provenance",
    ],
    "doremi preprocess CONFIG": [CHAIN],
    "doremi plan CONFIG --gpus 16 --gpu-memory 80": ["tests/test_plan_search.py", OWN],
    "sbatch --nodes=2 --gpus-per-node=8 --time=24:00:00 experiments/launch/slurm/doremi.sbatch CONFIG": [
        "tests/test_slurm.py::test_time_limit_signal_requeues_and_stops_the_run_with_a_checkpoint"
    ],
    f"doremi pipeline {QUICKSTART} --set model.preset=hybrid-quickstart --set pipeline.main.model.preset=hybrid-quickstart": [
        "tests/test_mamba.py::test_quickstart_pipeline_runs_hybrid_proxy_and_main"
    ],
    "doremi eval RUN": ["tests/test_config_ux.py::test_run_saves_absolute_paths_and_evaluates_from_elsewhere"],
    "python experiments/tools/mup_transfer.py": [f"{HERE}::test_mup_transfer_sweep"],
    "pip install 'doremi-mix[hf]'": [f"{HERE}::test_the_hf_extra_exists"],
    "pip install 'doremi-mix[wandb]'": [f"{HERE}::test_the_logger_extras_exist"],
    "pip install 'doremi-mix[tensorboard]'": [f"{HERE}::test_the_logger_extras_exist"],
    "pip install 'doremi-mix[fp8]'": [f"{HERE}::test_the_fp8_extra_exists"],
    "python -m doremi.commands.config_docs": [f"{HERE}::test_config_docs_regenerates_docs_config_md"],
    f"doremi train-proxy {QUICKSTART} --set mixing.doremi.reference=runs/ref": [CHAIN],
}


def commands(doc: str) -> list[str]:
    """Every fenced bash line (comment dropped) and inline command (a `doremi` one with
    arguments: `doremi eval` alone names the stage)."""
    text = (ROOT / doc).read_text()
    found = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang in ("", "bash", "sh"):
            lines = (line.split("  #")[0].strip() for line in body.splitlines())
            found += [line for line in lines if line.split(" ")[0] in PROGRAMS]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`([^`]+)`", prose):
        words = span.split()
        if words[0] in PROGRAMS and len(words) >= (3 if words[0] == "doremi" else 2):
            found.append(" ".join(words))
    return found


def readme_commands() -> set[str]:
    return {c for doc in DOCS for c in commands(doc)}


def test_every_readme_command_has_a_test():
    shown = readme_commands()
    assert sorted(shown - set(COVERED)) == [], "a command in DOCS that no test runs: add it to COVERED with its test"
    assert sorted(set(COVERED) - shown) == [], "COVERED lists a command no page in DOCS shows"
    for node in {n for nodes in COVERED.values() for n in nodes}:
        path, _, name = node.partition("::")
        assert (ROOT / path).is_file(), node
        assert not name or re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), node


def argv(command: str, *sets: str) -> list[str]:
    """The README's line as arguments, with `--set` keys appended; fails if the README lacks it."""
    assert command in readme_commands(), f"no page in DOCS shows `{command}`"
    args = shlex.split(command)
    program = str(BIN / args[0]) if args[0] in ("doremi", "python") else args[0]
    return [program, *args[1:], *[a for s in sets for a in ("--set", s)]]


def run(cwd: Path, args: list[str], code: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == code, f"{args}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A user's working directory: `experiments/` as in the repository, `runs/` its own."""
    work = tmp_path_factory.mktemp("readme")
    (work / "experiments").symlink_to(ROOT / "experiments")
    return work


@pytest.fixture(scope="module")
def chain(workdir) -> dict[str, subprocess.CompletedProcess]:
    """The README's stage commands in order, and docs/newcomer.md's proxy without a run_dir."""
    out = {}
    for name, command, sets in (
        ("preprocess", f"doremi preprocess {QUICKSTART}", []),
        ("reference", f"doremi train-reference {QUICKSTART} --set train.run_dir=runs/ref", SIZE),
        ("score", f"doremi score {QUICKSTART} --set mixing.doremi.reference=runs/ref --out runs/ref-cache", SIZE),
        (
            "proxy",
            f"doremi train-proxy {QUICKSTART} --set train.run_dir=runs/proxy --set mixing.doremi.reference=runs/ref",
            SIZE,
        ),
        ("average", "doremi average runs/proxy", []),
        ("train", f"doremi train {QUICKSTART} --set data.domain_weights=runs/proxy/weights.json", SIZE),
        ("eval", "doremi eval runs/quickstart/train", []),
        ("newcomer", f"doremi train-proxy {QUICKSTART} --set mixing.doremi.reference=runs/ref", SIZE),
    ):
        out[name] = run(workdir, argv(command, *sets))
    cached = ["train.run_dir=runs/proxy-cached", "mixing.doremi.reference_cache=runs/ref-cache", *SIZE]
    out["cached"] = run(
        workdir, [str(BIN / "doremi"), "train-proxy", QUICKSTART, *[a for s in cached for a in ("--set", s)]]
    )
    return out


def test_the_staged_chain_on_the_quickstart(workdir, chain):
    runs = workdir / "runs"
    assert chain["preprocess"].stdout.splitlines()[-1] == "stores in runs/quickstart/stores: 6 domains"
    said = chain["preprocess"].stdout.splitlines()  # the tokenizer, then each domain's counts
    assert said[0].startswith("tokenizer: bpe-2048") and said[1].split()[:5] == [
        "domain",
        "train",
        "docs",
        "train",
        "tokens",
    ]
    assert [line.split()[0] for line in said[2:8]] == DOMAINS
    assert sorted(p.name for p in (runs / "quickstart" / "stores").iterdir() if p.is_dir()) == sorted(DOMAINS)
    assert (runs / "quickstart" / "stores" / "manifest.json").is_file()
    said = chain["reference"].stderr.splitlines() + chain["reference"].stdout.splitlines()
    assert f"new run in runs/ref ({STEPS} steps)" in said and "run directory runs/ref: step 4" in said
    cache = runs / "ref-cache"
    assert sorted(p.name for p in cache.iterdir()) == sorted(["meta.json", *(f"{d}.npy" for d in DOMAINS)])
    proxy = alphas(runs / "proxy")
    assert len(proxy) == STEPS and max(abs(a - 1 / 6) for a in proxy[-1]) > 1e-3
    assert alphas(runs / "proxy-cached") == proxy  # the optional cache: the same weights
    assert alphas(runs / "quickstart" / "proxy") == proxy  # newcomer.md's line: the default run_dir

    assert chain["average"].stdout.splitlines()[-1] == "written: runs/proxy/weights.json"
    weights = json.loads((runs / "proxy" / "weights.json").read_text())
    assert [line.split()[0] for line in chain["average"].stdout.splitlines()[:-1]] == DOMAINS
    assert weights["domains"] == DOMAINS and weights["steps_averaged"] == STEPS
    assert weights["weights"] == pytest.approx([sum(col) / STEPS for col in zip(*proxy)], abs=1e-12)

    main = runs / "quickstart" / "train"
    saved = yaml.safe_load((main / "config.yaml").read_text())
    assert saved["data"]["domain_weights"] == str(runs / "proxy" / "weights.json")
    rows = list(read_jsonl(main / "metrics.jsonl"))
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    for row in train_rows:  # README: within one sequence of the sum of B x w_t under fixed weights
        realised = row["realised"]
        for d, w in zip(DOMAINS, weights["weights"], strict=True):
            assert realised["nominal_sequences"][d] == pytest.approx(row["step"] * 32 * w, abs=1e-9)
            assert abs(realised["sequences"][d] - realised["nominal_sequences"][d]) <= 1
        assert sum(realised["sequences"].values()) == 32 * row["step"]

    table = [line.split() for line in chain["eval"].stdout.strip().splitlines()]
    assert table[0] == ["domain", "val_loss"] and [r[0] for r in table[1:7]] == DOMAINS
    losses = {r[0]: float(r[1]) for r in table[1:7]}
    last = [r for r in rows if "val_loss" in r][-1]["val_loss"]
    assert losses == pytest.approx(last, abs=1e-4)
    assert table[7][0] == "average" and float(table[7][1]) == pytest.approx(sum(losses.values()) / 6, abs=2e-4)
    worst = max(losses, key=losses.get)
    assert table[8] == ["worst", f"{losses[worst]:.4f}", f"({worst})"]


def test_hugging_face_commands_on_the_quickstart_run(workdir, chain):
    out = workdir / "runs" / "quickstart-hf"
    export = argv("doremi export runs/quickstart/train runs/quickstart-hf")
    run(workdir, export)
    files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in out.iterdir()) == ["artifact.json", *files]  # and its header (design 6b)
    refused = run(workdir, export, code=2)
    assert refused.stderr.count("\n") == 1 and "--force" in refused.stderr
    run(workdir, [*export, "--force", "--no-tokenizer", "--max-shard-size", "100KB"])
    shards = sorted(p.name for p in out.iterdir() if p.name.startswith("model-"))
    assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert not (out / "tokenizer.json").exists() and (out / "model.safetensors.index.json").is_file()
    run(workdir, [*export, "--force"])
    assert sorted(p.name for p in out.iterdir()) == ["artifact.json", *files]

    section = run(workdir, argv("doremi import runs/quickstart-hf --out runs/from-hf.yaml")).stdout
    assert (workdir / "runs" / "from-hf.yaml").read_text() == section
    assert yaml.safe_load(section)["model"]["init_from_hf"] == str(out)

    # lr 1e-30: the first step keeps the exported parameters, so the validation losses are the
    # exported run's own
    still = ["train.lr=1e-30", "train.min_lr=1e-31", "train.steps=1", "train.eval_every=1"]
    train = f"doremi train {QUICKSTART} --set model.init_from_hf=runs/quickstart-hf --set train.run_dir=runs/from-hf"
    run(workdir, argv(train, *SIZE, *still))
    start = [r for r in read_jsonl(workdir / "runs" / "from-hf" / "metrics.jsonl") if "val_loss" in r][-1]
    exported = [r for r in read_jsonl(workdir / "runs" / "quickstart" / "train" / "metrics.jsonl") if "val_loss" in r][
        -1
    ]
    assert start["val_loss"] == pytest.approx(exported["val_loss"], abs=1e-5)


def test_look_before_running(workdir, chain):
    resolved = run(
        workdir,
        argv(f"doremi config {QUICKSTART} --set train.steps=10", "data.domains[1].max_documents=100"),
    ).stdout
    cfg = yaml.safe_load(resolved)
    assert cfg["train"]["steps"] == 10 and cfg["model"]["d_model"] == 96
    assert [d.get("max_documents") for d in cfg["data"]["domains"]] == [None, 100, None, None, None, None]
    assert cfg["data"]["store_dir"] == str(workdir / "runs" / "quickstart" / "stores")

    shown = run(workdir, argv("doremi inspect runs/quickstart/stores -n 2")).stdout
    assert shown.splitlines()[0] == "stores: runs/quickstart/stores"
    assert [line.split()[0] for line in shown.splitlines()[3:9]] == DOMAINS
    assert all(f"\n== {d}: 2 of " in shown for d in DOMAINS)

    one = run(workdir, argv(f"doremi inspect {QUICKSTART} --domain code")).stdout
    assert re.findall(r"^== (\w+):", one, re.M) == ["code"]


def test_debug_shows_the_traceback(tmp_path):
    plain = run(tmp_path, [str(BIN / "doremi"), "inspect", str(tmp_path)], code=2)
    assert plain.stderr.count("\n") == 1 and "no token stores here" in plain.stderr
    debug = run(tmp_path, [str(BIN / "doremi"), "--debug", "inspect", str(tmp_path)], code=1)
    assert debug.stderr.startswith("Traceback") and "no token stores here" in debug.stderr.splitlines()[-1]


def test_seeds_then_compare(workdir):
    """README's several-seeds recipe: one pipeline per seed, then `doremi compare`; the mean
    paired difference it prints is the one of the runs' final losses."""
    diffs = []
    for seed in (1, 2):
        root = f"runs/NAME-s{seed}"
        sets = [*PIPELINE_SIZE, f"train.seed={seed}", f"data.seed={seed}", f"pipeline.run_dir={root}"]
        run(workdir, argv(f"doremi pipeline {QUICKSTART}", *sets))
        final = {
            m: [r for r in read_jsonl(workdir / root / "main" / m / "metrics.jsonl") if "val_avg" in r][-1]["val_avg"]
            for m in ("doremi", "uniform")
        }
        diffs.append(final["doremi"] - final["uniform"])
    assert diffs[0] != diffs[1]
    args = argv("doremi compare runs/NAME-s* --out runs/NAME-compare")
    roots = sorted(str(p.relative_to(workdir)) for p in workdir.glob("runs/NAME-s*"))  # the shell's glob
    report = run(workdir, [*args[:2], *roots, *args[3:]]).stdout
    assert sorted(p.name for p in (workdir / "runs" / "NAME-compare").iterdir()) == ["compare.md", "compare.png"]
    row = next(line for line in report.splitlines() if line.startswith("| doremi | 2 |"))
    assert row.split("|")[3].strip().startswith(f"{sum(diffs) / 2:+.4f} ± ")
    per_root = [line.split("|")[2].strip() for line in report.splitlines() if line.startswith("| doremi | NAME-s")]
    assert per_root[:2] == ["NAME-s1", "NAME-s2"]  # each seed's difference, then each seed's weights
    assert sorted(per_root) == ["NAME-s1", "NAME-s1", "NAME-s2", "NAME-s2"]


def test_mup_transfer_sweep(workdir, tmp_path):
    args = argv("python experiments/tools/mup_transfer.py")
    out = tmp_path / "mup"
    tiny = ["--widths", "32", "64", "--lrs", "1e-3", "1e-2", "--steps", "2", "--batch", "2", "--seq", "16"]
    done = run(workdir, [*args, *tiny, "--base-width", "32", "--out", str(out)])
    for param in ("standard", "mup"):
        block = done.stdout.split(f"**{param}**")[1]
        cells = re.findall(r"^\| (0\.01|0\.001) \| (\S+) \| (\S+) \|$", block, re.M)[:2]
        assert [c[0] for c in cells] == ["0.001", "0.01"]
        assert all(float(v.strip("*")) > 0 for c in cells for v in c[1:])
        assert "best lr per width: 32: " in block
    assert (out / "mup_transfer.md").read_text().startswith("# muP transfer sweep (quickstart data)")
    runs = json.loads((out / "mup_transfer.json").read_text())["runs"]
    assert len(runs) == 2 * 2 * 2 - 2  # parametrizations x widths x lrs, the base width's once


def test_config_docs_regenerates_docs_config_md(tmp_path):
    """`python -m doremi.commands.config_docs` (to a scratch file: run bare it rewrites docs/config.md)."""
    args = argv("python -m doremi.commands.config_docs")
    target = tmp_path / "config.md"
    assert run(tmp_path, [*args, str(target)]).stdout == f"wrote {target}\n"
    assert target.read_text() == (ROOT / "docs" / "config.md").read_text()
    assert run(tmp_path, [*args, "--help"], code=2).stderr.startswith(
        "usage: python -m doremi.commands.config_docs [OUT.md]"
    )
    assert not (tmp_path / "--help").exists()  # an option is not an output path


def test_the_hf_extra_exists():
    assert "pip install 'doremi-mix[hf]'" in readme_commands()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "doremi-mix"
    assert any(dep.startswith("safetensors") for dep in project["optional-dependencies"]["hf"])


def test_the_logger_extras_exist():
    """The extras the README names for logging.wandb and logging.tensorboard; the run with
    both is tests/test_run_lifecycle.py::test_a_stopped_and_resumed_run_is_one_wandb_run_and_one_tensorboard_log."""
    said = readme_commands()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, package in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        assert f"pip install 'doremi-mix[{extra}]'" in said
        assert any(dep.startswith(package) for dep in extras[extra])


def test_the_fp8_extra_exists():
    """The extra docs/gpu.md names for model.fp8: torchao, the version trainer/model/fp8.py reads
    (the refusal without it is tests/test_fp8.py::test_model_fp8_without_torchao_is_refused_with_what_to_install)."""
    assert "pip install 'doremi-mix[fp8]'" in readme_commands()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["fp8"] == ["torchao>=0.18,<0.19"]


def test_make_targets_run_the_readme_commands(tmp_path):
    """`make quickstart` is the pipeline on the quickstart config that the quickstart tests run;
    `make test` is lint and this suite over xdist workers, `make test-fast` the suite without the
    files marked slow (the recipes as `make -n` prints them)."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    venv = tmp_path / "venv"

    def recipe(target: str) -> list[str]:
        argv(f"make {target}")
        done = subprocess.run(
            ["make", "-n", "--no-print-directory", "-C", str(ROOT), target, f"VENV={venv}", "TEST_WORKERS=2"],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    assert recipe("quickstart")[-1] == f"{venv}/bin/doremi pipeline {QUICKSTART}"
    test = recipe("test")
    assert test[-3:] == [
        f"{venv}/bin/python -m ruff check .",
        f"{venv}/bin/python -m ruff format --check .",
        f"{venv}/bin/python -m pytest -q -x --timeout=900 -n 2 --dist loadfile --no-loadscope-reorder tests",
    ]
    assert recipe("test-fast")[-1] == (
        f'{venv}/bin/python -m pytest -q -x --timeout=900 -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" tests'
    )
