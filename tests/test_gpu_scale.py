"""The GPU-scale experiment (issue 7): its config's model sizes and overrides, and the real
`experiments/launch/gpu_scale.sh` -> `experiments/tools/gpu_scale_summary.py` path end to end at a tiny size
on CPU (both seeds at once, a deadline stop and its resume), with the write-up's numbers checked
against the runs' own files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from doremi.pipeline.pipeline import Pipeline, store_fingerprint
from trainer.model.flops import param_count
from trainer.records.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "configs" / "gpu_scale.yaml"
SCRIPT = ROOT / "experiments" / "launch" / "gpu_scale.sh"
SUMMARY = ROOT / "experiments" / "tools" / "gpu_scale_summary.py"
MIXTURES = ("doremi", "uniform", "tokens")
TINY = [
    "train.steps=6",
    "pipeline.main.train.steps=4",
    "train.eval_every=2",
    "train.eval_sequences=4",
    "logging.every=2",
    "data.seq_len=32",
    "data.num_proc=1",
    "data.tokenizer.vocab_size=512",  # the logits are most of a tiny model's work
    "model.vocab_size=512",
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=64",
    "pipeline.main.model.d_model=32",
    "pipeline.main.model.n_layers=2",
    "pipeline.main.model.n_heads=4",
    "pipeline.main.model.n_kv_heads=2",
    "pipeline.main.model.ffn_dim=64",
]


def stage_configs(*sets: str):
    pipe = Pipeline(CONFIG, list(sets), say=lambda _: None)
    return pipe.stage_config(pipe.p.proxy), pipe.stage_config(pipe.p.main)


def test_config_sizes_and_step_overrides():
    ref, main = stage_configs()
    assert param_count(ref.model) == pytest.approx(30e6, rel=0.15)
    assert param_count(main.model) == pytest.approx(120e6, rel=0.15)
    assert ref.model.compile and main.model.compile and ref.train.precision == "auto"
    assert (ref.train.steps, main.train.steps) == (1500, 2500)
    ref, main = stage_configs("train.steps=555", "pipeline.main.train.steps=777", "train.seed=3")
    assert (ref.train.steps, main.train.steps) == (555, 777)
    assert ref.train.seed == main.train.seed == 3
    assert main.model.d_model == 896 and main.model.n_heads == 14 and ref.model.d_model == 512


def test_runs_that_differ_in_sampling_share_the_stores():
    ref, _ = stage_configs()
    assert store_fingerprint(ref) == store_fingerprint(stage_configs("data.seed=7", "data.seq_len=64")[0])
    assert store_fingerprint(ref) != store_fingerprint(stage_configs("data.tokenizer.vocab_size=1024")[0])


def run_script(out: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = ["bash", str(SCRIPT), "--work", str(work), *args]
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_bad_arguments_are_one_line_errors(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert (
        r.returncode == 2
        and r.stderr.strip() == "gpu_scale.sh: error: OUT is not set (the directory the packed results go to)"
    )
    r = run_script(tmp_path / "out", tmp_path / "work", "--seeds", "one")
    assert r.returncode == 2 and "--seeds: expected integers" in r.stderr and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """A deadline-stopped start, then the resumed full run, then the summary of both seeds."""
    root = tmp_path_factory.mktemp("gpu_scale")
    sets = [a for s in TINY for a in ("--set", s)]
    stopped = run_script(root / "out-stopped", root / "work", "--deadline", "1", *sets)
    manifest = root / "work" / "stores" / "manifest.json"
    built = manifest.stat().st_mtime_ns
    done = run_script(root / "out", root / "work", *sets)
    assert manifest.stat().st_mtime_ns == built  # the rerun reused the stores
    assert done.returncode == 0, done.stdout + done.stderr
    seeds = []
    for s in (1, 2):
        with tarfile.open(root / "out" / f"gpu_scale_seed{s}.tar.gz") as tar:
            tar.extractall(root / "unpacked", filter="data")
        seeds.append(root / "unpacked" / f"seed{s}")
    out = root / "results" / "gpu_scale.md"
    r = subprocess.run(
        [
            sys.executable,
            str(SUMMARY),
            *map(str, seeds),
            "--out",
            str(out),
            "--plots",
            str(root / "results" / "gpu_scale"),
            "--notes",
            str(root / "none.md"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return {"root": root, "stopped": stopped, "done": done, "seeds": seeds, "summary": out}


def test_deadline_stops_packs_and_the_rerun_resumes(experiment):
    stopped, done, root = experiment["stopped"], experiment["done"], experiment["root"]
    assert stopped.returncode == 3, stopped.stdout + stopped.stderr
    assert "deadline of 1s reached" in stopped.stdout and "rerun to resume" in stopped.stdout
    assert sorted(p.name for p in (root / "out-stopped").iterdir()) == [
        "gpu_scale_seed1.log",
        "gpu_scale_seed1.tar.gz",
        "gpu_scale_seed2.log",
        "gpu_scale_seed2.tar.gz",
    ]
    assert "seed 1: finished" in done.stdout and "seed 2: finished" in done.stdout


def test_packed_results_hold_every_stage_without_checkpoints(experiment):
    seed2 = experiment["seeds"][1]
    with tarfile.open(experiment["root"] / "out" / "gpu_scale_seed2.tar.gz") as tar:
        names = tar.getnames()
    assert not any("checkpoints" in n for n in names)
    for f in (
        "report.md",
        "domain_weights.png",
        "val_loss.png",
        "loss_vs_baseline.png",
        "weights.json",
        "stores/manifest.json",
        "pipeline.log",
        "run_info.json",
        "round1/proxy/domain_weights.jsonl",
        "round1/reference/metrics.jsonl",
        *(f"main/{m}/metrics.jsonl" for m in MIXTURES),
    ):
        assert f"seed2/{f}" in names, f
    info = json.loads((seed2 / "run_info.json").read_text())
    assert info["seed"] == 2 and info["exit_status"] == 0 and "train.steps=6" in info["overrides"]
    for stage in ("round1/reference", "round1/proxy", "main/doremi", "main/tokens"):
        cfg = (seed2 / stage / "config.yaml").read_text()
        assert cfg.count("  seed: 2") == 2, stage  # train.seed and data.seed of every stage


def table(text: str, first_header: str) -> dict[tuple[str, ...], list[str]]:
    """The markdown table whose header starts with `first_header`: rows keyed by their first
    cells (two cells when the second is a seed name)."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(f"| {first_header} |"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        key = tuple(cells[:2]) if cells[1].startswith("seed") or cells[1] == "mean" else (cells[0],)
        rows[key] = cells[len(key) :]
    return rows


def final_val(seed: Path, mixture: str) -> dict[str, float]:
    rows = [r for r in read_jsonl(seed / "main" / mixture / "metrics.jsonl") if "val_loss" in r]
    assert rows[-1]["step"] == 4
    return rows[-1]["val_loss"]


def test_summary_numbers_come_from_the_runs(experiment):
    text = experiment["summary"].read_text()
    manifest = json.loads((experiment["seeds"][0] / "stores" / "manifest.json").read_text())
    domains = [d["name"] for d in manifest["domains"]]
    entropy = [d["entropy"] for d in manifest["domains"]]
    train_tokens = np.array([d["train"]["tokens"] for d in manifest["domains"]], dtype=float)

    weights = table(text, "domain | H | uniform")
    doremi = [json.loads((s / "weights.json").read_text())["weights"] for s in experiment["seeds"]]
    for i, d in enumerate(domains):
        w = weights[(d,)]
        assert float(w[1]) == pytest.approx(1 / 6, abs=5e-5)
        assert float(w[2]) == pytest.approx(train_tokens[i] / train_tokens.sum(), abs=5e-5)
        assert [float(x) for x in w[3:5]] == pytest.approx([doremi[0][i], doremi[1][i]], abs=5e-5)
        assert float(w[5]) == pytest.approx((doremi[0][i] + doremi[1][i]) / 2, abs=5e-5)

    comparison = table(text, "mixture | seed")
    means = {}
    for m in MIXTURES:
        per_seed = []
        for s in experiment["seeds"]:
            val = final_val(s, m)
            losses = np.array([val[d] for d in domains])
            adj = np.array([l - h if h is not None else l for l, h in zip(losses, entropy)])
            row = comparison[(m, s.name)]
            assert float(row[0]) == pytest.approx(losses.mean(), abs=5e-5)
            assert float(row[1]) == pytest.approx(adj.mean(), abs=5e-5)
            assert row[2] == f"{adj.max():.4f} ({domains[int(adj.argmax())]})"
            per_seed.append((losses.mean(), adj.mean(), adj.max()))
        means[m] = np.mean(per_seed, axis=0)
        assert [float(x) for x in comparison[(m, "mean")]] == pytest.approx(means[m].tolist(), abs=5e-5)

    seed1 = table(text, "domain | H | weight: doremi")  # the first per-seed table: seed1
    for m in MIXTURES:
        val = final_val(experiment["seeds"][0], m)
        header = ["H", "weight: doremi", "weight: uniform", "weight: tokens", *(f"loss: {x}" for x in MIXTURES)]
        for d in domains:
            assert float(seed1[(d,)][header.index(f"loss: {m}")]) == pytest.approx(val[d], abs=5e-5)

    diagnostics = table(text, "domain | reference val loss")
    ref_train = np.mean(
        [
            [h["ref_loss"] for h in read_jsonl(s / "round1" / "proxy" / "domain_weights.jsonl")]
            for s in experiment["seeds"]
        ],
        axis=(0, 1),
    )
    for i, d in enumerate(domains):
        assert float(diagnostics[(d,)][1]) == pytest.approx(ref_train[i], abs=5e-5)

    wins = {k: all(means["doremi"][k] < means[b][k] for b in ("uniform", "tokens")) for k in (1, 2)}
    expected = {2: "win", 1: "mixed", 0: "lose"}[sum(wins.values())]
    assert f"- mean over seeds: DoReMi **{expected} (" in text
    for png in (
        "domain_weights_seed1.png",
        "domain_weights_seed2.png",
        "val_loss_seed1.png",
        "val_loss_seed2.png",
        "final_adjusted_loss.png",
    ):
        assert f"(gpu_scale/{png})" in text
        assert (experiment["summary"].parent / "gpu_scale" / png).read_bytes()[:4] == b"\x89PNG"


def test_summary_rejects_an_unfinished_seed(tmp_path, experiment):
    import shutil

    seed = tmp_path / "seed9"
    shutil.copytree(experiment["seeds"][0], seed)
    (seed / "main" / "tokens" / "eval.json.stage.json").unlink()
    r = subprocess.run(
        [sys.executable, str(SUMMARY), str(seed), "--out", str(tmp_path / "x.md")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and not (tmp_path / "x.md").exists()
    assert r.stderr.strip().endswith("main run(s) tokens have no eval result (did the pipeline finish?)")
