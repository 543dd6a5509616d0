"""The README's commands, run as a user runs them: the staged DoReMi chain through the `doremi`
console script, `torchrun`, `doremi plan`, and `doremi eval`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import alphas, config_path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def sh(*args: str, timeout: int = 300) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def doremi(*args: str) -> str:
    return sh(BIN / "doremi", *args)


def test_staged_doremi_chain(stores, tmp_path):
    cfg = config_path(stores, tmp_path / "exp")
    doremi("preprocess", cfg)
    doremi("train-reference", cfg, "--set", f"train.run_dir={tmp_path / 'ref'}")
    proxy = [
        "--set",
        f"train.run_dir={tmp_path / 'proxy'}",
        "--set",
        f"mixing.doremi.reference={tmp_path / 'ref'}",
        "--set",
        "train.steps=4",
    ]
    doremi("score", cfg, *proxy, "--out", tmp_path / "cache")
    doremi("train-proxy", cfg, *proxy)
    assert len(alphas(tmp_path / "proxy")) == 4
    out = doremi("average", tmp_path / "proxy", "--from-step", "2").splitlines()
    assert out[-1] == f"written: {tmp_path / 'proxy' / 'weights.json'}"
    weights = json.loads((tmp_path / "proxy" / "weights.json").read_text())
    assert weights["domains"] == ["noise", "easy", "markov"] and weights["steps_averaged"] == 3
    assert out[:3] == [f"{d:<6}  {w:.4f}" for d, w in zip(weights["domains"], weights["weights"])]
    assert sum(weights["weights"]) == pytest.approx(1.0)
    doremi(
        "train",
        cfg,
        "--set",
        f"train.run_dir={tmp_path / 'main'}",
        "--set",
        f"data.domain_weights={tmp_path / 'proxy' / 'weights.json'}",
    )
    table = doremi("eval", tmp_path / "main")
    lines = table.strip().splitlines()
    assert lines[0].split() == ["domain", "val_loss"] and len(lines) == 1 + 3 + 2
    assert lines[-1].startswith("worst")


def test_torchrun_data_parallel(stores, tmp_path):
    cfg = config_path(stores, tmp_path / "dp")
    sh(
        BIN / "torchrun",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "doremi",
        "train",
        cfg,
        "--set",
        "parallelism.dp=2",
        "--set",
        "logging.progress=false",
    )
    rows = [json.loads(l) for l in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]


def test_plan_70b():
    out = doremi("plan", "experiments/configs/llama3_70b.yaml", "--gpus", "16", "--gpu-memory", "96")
    assert "tp4 x pp4 x dp1" in out
    assert "bf16 params, fp32 main grads" in out  # train.param_dtype auto, resolved for GPUs
    stage_rows = [l for l in out.splitlines() if l.strip()[:1].isdigit()]
    assert len(stage_rows) == 4


TINY_MODEL = ("d_model=32", "n_layers=2", "ffn_dim=64")


def test_pipeline_under_torchrun(tmp_path):
    """Two ranks share the stages: rank 0 alone builds stores and writes markers, the others wait."""
    run = tmp_path / "run"
    args = [
        "--set",
        "parallelism.dp=2",
        "--set",
        f"pipeline.run_dir={run}",
        "--set",
        f"data.store_dir={tmp_path / 's'}",
        "--set",
        "train.steps=6",
        "--set",
        "train.eval_every=6",
        "--set",
        "train.eval_sequences=16",
        "--set",
        "pipeline.main.train.steps=4",
        "--set",
        "pipeline.baselines=[uniform]",
        "--set",
        "pipeline.methods=[doremi,odm]",
        "--set",
        "logging.progress=false",
        "--set",
        "checkpoint.every=0",
        "--set",
        "data.tokenizer.vocab_size=512",
        "--set",
        "model.vocab_size=512",
        # the rank protocol does not depend on the model's size: the smallest that runs
        *[a for k in TINY_MODEL for a in ("--set", f"model.{k}", "--set", f"pipeline.main.model.{k}")],
    ]
    torchrun = [
        BIN / "torchrun",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "doremi",
        "pipeline",
        "experiments/configs/quickstart.yaml",
        *args,
    ]
    out = sh(*torchrun)
    assert "mixture  " in out and "worst case" in out and (run / "report.md").is_file()  # the closing summary
    assert [len(alphas(run / "round1" / "proxy"))] == [6]
    again = sh(*torchrun)
    # preprocess, reference, proxy, average, ODM's proxy and average, and a main run and its
    # eval for doremi, odm and uniform
    assert again.count("done already") == 12


def test_version_names_the_project_its_commit_and_packages():
    import torch

    from data.code_identity import code_identity

    out = doremi("--version").strip()
    assert out.startswith("doremi 0.1.0") and f"torch {torch.__version__}" in out and "python " in out
    code = code_identity()
    assert f"sources {code['sources']})" in out and (code["commit"] is None or f"(commit {code['commit']}, " in out)
