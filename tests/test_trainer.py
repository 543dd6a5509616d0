"""The single-process trainer end to end: accumulation, kill-and-resume, the CLI's errors."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from doremi.pipeline import stages
from tests.runs import config, config_path, final_params, losses
from trainer.records.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


# Adam's first step is lr * g / (|g| + eps): with eps = 1e-8 the summation-order rounding of
# near-zero gradients (~1e-9) would be amplified to ~lr. eps = 1e-4 keeps the comparison about
# the gradients, which is what accumulation changes.
ADAM_EPS = "train.eps=1e-4"


def test_accumulation_equals_one_big_batch(stores, tmp_path):
    one, four = tmp_path / "mb1", tmp_path / "mb4"
    stages.train(config(stores, one, "train.steps=1", ADAM_EPS))
    stages.train(config(stores, four, "train.steps=1", "train.micro_batches=4", ADAM_EPS))
    assert losses(four) == pytest.approx(losses(one), rel=1e-6)
    a, b = final_params(stores, one), final_params(stores, four)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-6, msg=name)


def test_metrics_rows(stores, tmp_path):
    run = tmp_path / "run"
    stages.train(config(stores, run, "train.eval_every=3", "train.eval_sequence_losses=final"))
    rows = read_jsonl(run / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for r in train_rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "domain_loss"} <= set(r)
        assert r["tokens"] == r["step"] * 8 * 32
        assert set(r["epochs"]) == {"noise", "easy", "markov"} and all(e > 0 for e in r["epochs"].values())
    val = [r for r in rows if "val_loss" in r]
    assert len(val) == 1 and set(val[0]["val_loss"]) == {"noise", "easy", "markov"}
    assert val[0]["val_worst"] == max(val[0]["val_loss"].values())
    assert 0 < val[0]["eval_seconds"] < 60  # the evaluation's wall time, apart from the steps'
    # the tokens the pass forwarded: every evaluated sequence (eval_sequences/*.npz) x seq_len
    with np.load(run / "eval_sequences" / "step_0000003.npz") as z:
        assert val[0]["eval_tokens"] == len(z["tokens"]) * 32 and len(z["tokens"]) > 3
    assert (run / "config.yaml").is_file()


def test_realised_mixture_and_memorisation_rows(stores, tmp_path):
    """The logged realised mixture is what was drawn (sequences, tokens), beside the nominal
    sum of B x w_t; with held-back sequences the eval rows carry seen and held-back losses."""
    run = tmp_path / "realised"
    stages.train(
        config(
            stores,
            run,
            "train.steps=7",
            "train.eval_every=7",
            "data.holdout_sequences=16",
            "data.domain_weights=[0.6, 0.3, 0.1]",
        )
    )
    rows = read_jsonl(run / "metrics.jsonl")
    last = [r for r in rows if "loss" in r][-1]
    realised = last["realised"]
    seqs = [realised["sequences"][d] for d in ("noise", "easy", "markov")]
    assert sum(seqs) == 7 * 8
    nominal = [realised["nominal_sequences"][d] for d in ("noise", "easy", "markov")]
    assert nominal == pytest.approx([7 * 8 * 0.6, 7 * 8 * 0.3, 7 * 8 * 0.1])
    assert max(abs(a - b) for a, b in zip(seqs, nominal)) <= 1.0
    assert [realised["tokens"][d] for d in ("noise", "easy", "markov")] == [n * 32 for n in seqs]
    val = [r for r in rows if "val_loss" in r][-1]
    assert set(val["seen_loss"]) == set(val["heldout_loss"]) == {"noise", "easy", "markov"}
    assert all(0 < val[k][d] < 1 for k in ("seen_loss_se", "heldout_loss_se") for d in ("noise", "markov"))
    # `noise` is uniform noise over 64 symbols: nothing to memorise, so seen and held-back
    # losses differ by sampling noise only (16 x 32 tokens each: a few hundredths).
    assert abs(val["seen_loss"]["noise"] - val["heldout_loss"]["noise"]) < 0.15


def _doremi(*args, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "doremi", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=kw.get("cwd", ROOT),
        timeout=kw.get("timeout", 300),
    )


def test_kill_and_resume_equals_uninterrupted(stores, tmp_path):
    steps = ["train.steps=20", "checkpoint.every=1", "checkpoint.keep=2"]
    whole = tmp_path / "whole"
    stages.train(config(stores, whole, *steps))

    run = tmp_path / "killed"
    cfg = config_path(stores, run)
    args = [sys.executable, "-m", "doremi", "train", str(cfg), *[a for s in steps for a in ("--set", s)]]
    proc = subprocess.Popen(
        args,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        done = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
        if done and done[-1] >= 4:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r][-1]
    assert killed_at < 20

    result = _doremi("train", str(cfg), *[a for s in steps for a in ("--set", s)])
    assert result.returncode == 0, result.stderr
    assert losses(run) == losses(whole)  # exact, every step 1..20
    a, b = final_params(stores, whole), final_params(stores, run)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    "args, expect",
    [
        (["train", "missing.yaml"], "missing.yaml: config file not found"),
        (["train", "{cfg}", "--set", "train.lrr=1"], "unknown key train.lrr (did you mean train.lr?)"),
        (["train", "{cfg}", "--set", "train.steps=many"], "train.steps: expected int, got 'many' (str)"),
        (["train", "{cfg}", "--set", "model.vocab_size=100"], "model.vocab_size: expected >= 257"),
        (["train", "{cfg}", "--set", "data.domain_weights=[0.5, 0.5]"], "expected 3"),
        (["train", "{cfg}", "--set", "data.domain_weights=[0.5, -0.5, 1.0]"], "finite and >= 0, got easy=-0.5"),
        (["train", "{cfg}", "--set", "data.store_dir=/nonexistent/stores"], "/nonexistent/stores"),
        (["train-proxy", "{cfg}"], "mixing.doremi.reference: required"),
        (["eval", "/nonexistent/run"], "/nonexistent/run"),
        (["average", "/nonexistent/run"], "/nonexistent/run"),
    ],
)
def test_cli_errors_are_one_line(stores, tmp_path, args, expect):
    cfg = config_path(stores, tmp_path / "run")
    result = _doremi(*[a.format(cfg=cfg) for a in args])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], result.stderr
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_wandb_offline(stores, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "wb"
    stages.train(config(stores, run, "train.steps=2", "logging.wandb=true", "logging.run_name=t"))
    assert len(losses(run)) == 2
    assert list((run / "wandb").glob("offline-run-*")), "no offline wandb run written"
