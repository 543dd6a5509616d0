"""DoGE (doremi/methods/doge/method.py) and the trainer's aligned step (trainer/run/alignment.py): the
update against hand-computed cases of the paper's equation 6, and one training step against
per-domain gradients computed directly with autograd on the same batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from data.store.batch import IGNORE_INDEX
from doremi.methods.doge.method import DoGEConfig, doge_scores, doge_update
from doremi.methods.history import read_history
from doremi.pipeline import stages
from tests.runs import config
from trainer.config.tools import ConfigError
from trainer.parallel.main_grad import grad_of

pytestmark = pytest.mark.usefixtures("one_thread")


def test_scores_and_update_by_hand():
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    assert doge_scores(w, lr=0.1, mu=0.05).tolist() == pytest.approx([1.0, -2.0, 4.0], abs=1e-12)
    # the authors' clip of lr * W into lr * [0, 5]
    assert doge_scores(w, lr=0.1, mu=0.05, clip=[0.0, 1.0]).tolist() == pytest.approx([1.0, 0.0, 2.0], abs=1e-12)
    log_alpha = torch.log(torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64))
    got = doge_update(log_alpha, torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)).exp()
    z = 0.2 * math.e + 0.3 * math.exp(-2) + 0.5
    assert got.tolist() == pytest.approx([0.2 * math.e / z, 0.3 * math.exp(-2) / z, 0.5 / z], abs=1e-12)


def test_config_errors():
    for bad, msg in [
        (DoGEConfig(mu=0), r"mixing.doge.mu: expected a finite value > 0, got 0"),
        (DoGEConfig(target_sequences=0), r"mixing.doge.target_sequences: expected >= 1, got 0"),
        (DoGEConfig(score_clip=[1.0, 0.0]), r"mixing.doge.score_clip: expected \[low, high\]"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            bad.validate()


SETS = [
    "train.decay=constant",
    "train.warmup_steps=0",
    "train.lr=0.01",
    "mixing.method=doge",
    "mixing.doge.variant=paper",
    "mixing.doge.mu=0.01",
]


def fit_capturing_gradients(trainer) -> dict[str, torch.Tensor]:
    """Run `trainer` and return each parameter's gradient as the step left it, before the
    optimizer's reduction (the last step's)."""
    seen: dict[str, torch.Tensor] = {}
    reduce = trainer.optimizer.reduce_gradients

    def capture() -> None:
        seen.update({n: grad_of(p).detach().clone() for n, p in trainer.named_params})
        reduce()

    trainer.optimizer.reduce_gradients = capture
    trainer.fit()
    return seen


def autograd_gradients(twin, k: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """By autograd on the model of `twin` (a proxy trainer of one step, not run): the gradient of
    the target batches' mean loss g_T, and of each of the `k` domains' mean loss over step 1's
    batch g_i (what DoGE's aligned step computes, Fan et al. 2023 eq. 3)."""
    batch = twin.feed.step_batches(1, twin.hook.sampling_weights(1))[0]
    spec = twin.hook.needs.alignment
    target = twin.feed.target_batches(1, np.asarray(spec.weights), spec.sequences, 8)
    params = [p for _, p in twin.named_params]

    def grad(batches: list[dict], weight_of) -> list[torch.Tensor]:
        total = 0.0
        for b in batches:
            mask = b["labels"] != IGNORE_INDEX
            total = total + (twin.model(None, b) * mask * weight_of(b)).sum()
        return list(torch.autograd.grad(total, params))

    n_target = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in target)
    g_t = grad(target, lambda b: 1.0 / n_target)
    ids = batch["domain_ids"]
    per_domain = []
    for d in range(k):
        n = int(((batch["labels"] != IGNORE_INDEX) & (ids == d)[:, None]).sum())
        per_domain.append(grad([batch], lambda b, d=d, n=n: (b["domain_ids"] == d).double()[:, None] / n))
    return g_t, per_domain


def test_one_step_matches_per_domain_gradients_by_autograd(stores, tmp_path):
    """The aligned step's inner products <g_i, g_T> and its gradient sum_i alpha_1[i] g_i equal
    those computed directly: each domain's mean-loss gradient and the target batch's by autograd
    on a copy of the model, on the same batches."""
    cfg = config(stores, tmp_path / "run", *SETS, "train.steps=1", "train.micro_batches=2", "train.grad_clip=0")
    trainer = stages.proxy_trainer(cfg)
    twin = stages.proxy_trainer(config(stores, tmp_path / "twin", *SETS, "train.steps=1"))
    twin.model.load_state_dict(trainer.model.state_dict())
    seen = fit_capturing_gradients(trainer)
    row = read_history(tmp_path / "run")[0]

    g_t, per_domain = autograd_gradients(twin, 3)
    alignment = [sum(float((a.double() * t.double()).sum()) for a, t in zip(g, g_t)) for g in per_domain]
    assert row["alignment"] == pytest.approx(alignment, rel=1e-5)
    scores = [0.01 * a / 0.01 for a in alignment]
    alpha = np.exp(scores) / np.exp(scores).sum()
    assert row["weights"] == pytest.approx(alpha.tolist(), rel=1e-5)
    for (name, _), *gs in zip(twin.named_params, *per_domain):
        want = sum(a * g for a, g in zip(alpha, gs))
        torch.testing.assert_close(seen[name], want.float(), rtol=1e-4, atol=1e-7, msg=name)


def test_alignment_dot_accumulates_bf16_gradients_in_fp32(monkeypatch):
    """bf16 gradients (a bf16 model at one micro-batch) give an fp32-accurate inner product, in
    chunks (no temporary the size of the parameter); fp32 ones one BLAS dot."""
    import trainer.run.alignment as alignment

    gen = torch.Generator().manual_seed(0)
    g, t = (torch.randn(10_000, generator=gen).to(torch.bfloat16) for _ in range(2))
    exact = float((g.double() * t.double()).sum())
    monkeypatch.setattr(alignment, "_DOT_CHUNK", 999)  # 11 chunks
    got = alignment.fp32_dot(g.view(100, 100), t.view(100, 100))
    assert got.dtype == torch.float64 and float(got) == pytest.approx(exact, rel=1e-6)
    assert float(torch.dot(g, t)) != pytest.approx(exact, rel=1e-4)  # what a bf16 dot gives
    f, u = g.float(), t.float()
    assert float(alignment.fp32_dot(f, u)) == float(torch.dot(f, u))
