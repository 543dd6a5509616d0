"""Stacked training (trainer/stacked, issue 21) equals the ordinary trainer run by run.

Three mixtures are trained 5 steps stacked and each alone with `trainer.run.loop.Trainer`: per-step
losses, the final per-domain validation losses and the final parameters (the unstacked model
against the ordinary run's checkpoint) agree within 1e-5 relative. The gradient clip is small,
so each model's own clip coefficient is in play at every step; the weight decay is on, so the
decay groups must map by name; the schedule warms up and decays. Chunking changes nothing, and
bad layouts or mixtures are one-line errors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.runs import config, final_params, losses
from trainer.config.schema import TrainerConfig
from trainer.config.tools import ConfigError
from trainer.model.llama import Llama
from trainer.optim.param_groups import param_groups
from trainer.records.metrics import read_jsonl
from trainer.run.loop import Trainer
from trainer.stacked import train_stacked
from trainer.stacked.model import stack_llamas
from trainer.stacked.optim import decayed

pytestmark = pytest.mark.usefixtures("one_thread")

MIXTURES = np.array([[1 / 3, 1 / 3, 1 / 3], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8]])
CLIP = 0.05
# As tests/test_layouts.py: a larger Adam eps keeps summation-order rounding of near-zero
# gradients from being amplified to ~lr, so the comparison is about the gradients.
SETS = [
    "train.steps=5",
    "train.eps=1e-4",
    f"train.grad_clip={CLIP}",
    "train.warmup_steps=2",
    "train.eval_every=5",
    "train.eval_sequences=8",
    "checkpoint.keep=1",
]


def with_mixture(cfg: TrainerConfig, mixture: np.ndarray) -> TrainerConfig:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, domain_weights=[float(x) for x in mixture]))


@pytest.fixture(scope="module")
def runs(stores, tmp_path_factory):
    """The stacked result (all three at once) and each ordinary run's directory."""
    root = tmp_path_factory.mktemp("stacked")
    dirs = []
    for m, mixture in enumerate(MIXTURES):
        run = root / f"run{m}"
        Trainer(with_mixture(config(stores, run, *SETS), mixture)).fit()
        dirs.append(run)
    stacked = train_stacked(config(stores, root / "stacked", *SETS), MIXTURES, eval_every=5)
    return stacked, dirs


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def test_losses_and_validation_equal_the_ordinary_runs(runs):
    stacked, dirs = runs
    assert stacked.losses.shape == (3, 5) and stacked.grad_norms.shape == (3, 5)
    assert [s for s, _ in stacked.evals] == [5]
    for m, run in enumerate(dirs):
        rows = read_jsonl(Path(run) / "metrics.jsonl")
        assert rel(stacked.losses[m], losses(run)) < 1e-5, (m, stacked.losses[m], losses(run))
        norms = [r["grad_norm"] for r in rows if "loss" in r]
        assert rel(stacked.grad_norms[m], norms) < 1e-5
        val = next(r for r in reversed(rows) if "val_loss" in r)["val_loss"]
        assert rel(stacked.final_eval[m], [val[d] for d in stacked.domains]) < 1e-5
    # The clip acts at every step, with a coefficient of each model's own.
    assert (stacked.grad_norms > 2 * CLIP).all()
    assert len({round(float(x), 6) for x in stacked.grad_norms[:, 0]}) == 3
    # The models did learn differently: the mixtures are not a no-op.
    assert rel(stacked.final_eval[0], stacked.final_eval[2]) > 1e-3


def test_final_parameters_equal_the_ordinary_checkpoints(runs, stores):
    stacked, dirs = runs
    for m, run in enumerate(dirs):
        ordinary = final_params(stores, run)
        assert set(ordinary) == set(stacked.params[m])
        for name, p in ordinary.items():
            q = stacked.params[m][name]
            scale = max(float(p.abs().max()), 1e-12)
            assert float((q - p).abs().max()) / scale < 1e-5, (m, name)


def test_chunking_changes_nothing(runs, stores, tmp_path):
    stacked, _ = runs
    one = train_stacked(config(stores, tmp_path / "chunks", *SETS), MIXTURES, eval_every=5, chunk_size=1)
    np.testing.assert_array_equal(one.losses, stacked.losses)
    np.testing.assert_array_equal(one.grad_norms, stacked.grad_norms)
    np.testing.assert_array_equal(one.final_eval, stacked.final_eval)
    for a, b in zip(one.params, stacked.params):
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_gradient_accumulation_and_per_model_seeds(stores, tmp_path):
    """Model 1, seed 5 and 2 micro-batches, against the ordinary run with train.seed=5."""
    sets = [*SETS, "train.micro_batches=2", "train.steps=3", "train.eval_every=0"]
    run = tmp_path / "seed5"
    Trainer(with_mixture(config(stores, run, *sets, "train.seed=5"), MIXTURES[2])).fit()
    stacked = train_stacked(config(stores, tmp_path / "stacked", *sets), MIXTURES[1:], seeds=[0, 5], keep_params=False)
    assert stacked.params is None and [s for s, _ in stacked.evals] == [3]
    assert rel(stacked.losses[1], losses(run)) < 1e-5
    assert rel(stacked.losses[0], stacked.losses[1]) > 1e-4


def test_init_stacks_ordinary_models_and_decay_groups_map_by_name(stores, tmp_path):
    cfg = config(stores, tmp_path / "init").model
    stacked = stack_llamas(cfg, [3, 7])
    ordinary = Llama(cfg, seed=7)
    assert all(torch.equal(stacked.unstack(1)[n], p) for n, p in ordinary.named_parameters())
    assert all(torch.equal(p, q) for p, q in zip(stacked.llama(1).parameters(), ordinary.parameters()))
    decay = {id(p) for p in param_groups(list(ordinary.named_parameters()), 0.1)[0]["params"]}
    names = {n for n, p in ordinary.named_parameters() if id(p) in decay}
    assert {n for n, p in stacked.named_parameters() if decayed(p)} == names


@pytest.mark.parametrize(
    ("sets", "mixtures", "match"),
    [
        (["parallelism.tp=2"], MIXTURES, r"tp = pp = dp = 1, got tp=2 pp=1 dp=1"),
        (["parallelism.pp=2", "train.micro_batches=2"], MIXTURES, r"tp = pp = dp = 1, got tp=1 pp=2 dp=1"),
        (["parallelism.dp=2"], MIXTURES, r"tp = pp = dp = 1, got tp=1 pp=1 dp=2"),
        (["model.moe.num_experts=2"], MIXTURES, r"^model.moe: stacked training runs the plain Llama"),
        (["model.mup.base_width=32"], MIXTURES, r"^model.mup: stacked training runs the plain Llama"),
        (["model.block_pattern=MA"], MIXTURES, r"^model.block_pattern: stacked training runs attention blocks only"),
        ([], MIXTURES[0], r"mixtures: expected numbers of shape \[M, 3\] .* got shape \(3,\)"),
        ([], MIXTURES[:, :2], r"mixtures: expected numbers of shape \[M, 3\] .* got shape \(3, 2\)"),
    ],
)
def test_one_line_errors(stores, tmp_path, sets, mixtures, match):
    cfg = config(stores, tmp_path / "bad", *sets)
    with pytest.raises(ConfigError, match=match) as err:
        train_stacked(cfg, mixtures)
    assert "\n" not in str(err.value)
