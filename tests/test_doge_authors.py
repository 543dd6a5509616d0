"""DoGE's `variant: authors` (doremi/methods/doge/method.py) against the released code (github
Olivia-fsm/DoGE, commit 88400e9263dfdd69a24b28aec8533fcb1bf9363d, `src/trainer.py`,
`update_domain_weights_distributed`): the update of a small fixed case computed by hand from its
equations, and one training step of the trainer (trainer/run/alignment.py, deferred alignment)
against the same equations applied to per-domain gradients taken directly by autograd."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from doremi.methods.doge.method import DoGEConfig, authors_scores, doge_update, domain_clip, score_clip
from doremi.methods.history import read_history
from doremi.pipeline import stages
from tests.runs import config
from tests.test_method_doge import autograd_gradients, fit_capturing_gradients
from trainer.config.tools import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_defaults_are_the_released_config():
    """config/doge.json: mu 0.01, dw_min 0, dw_max 5, max_grad_norm 5."""
    cfg = DoGEConfig()
    assert (cfg.variant, cfg.mu, score_clip(cfg), domain_clip(cfg)) == ("authors", 0.01, [0.0, 5.0], 5.0)
    paper = DoGEConfig(variant="paper")
    assert (score_clip(paper), domain_clip(paper)) == (None, 0.0)
    assert score_clip(DoGEConfig(variant="paper", score_clip=[0.0, 1.0])) == [0.0, 1.0]
    with pytest.raises(ConfigError, match=r"^mixing.doge.domain_grad_clip: applies to variant 'authors' only"):
        DoGEConfig(variant="paper", domain_grad_clip=1.0).validate()
    with pytest.raises(ConfigError, match=r"^mixing.doge.variant: expected 'authors' or 'paper', got 'x'$"):
        DoGEConfig(variant="x").validate()  # type: ignore[arg-type]


def clip_coef(norm: float, max_norm: float = 5.0) -> float:
    """torch.nn.utils.clip_grad_norm_ (src/trainer.py lines 733-734): min(1, C / (norm + 1e-6))."""
    return min(1.0, max_norm / (norm + 1e-6))


def test_update_of_a_fixed_case_by_hand():
    """Three domains with 2-element gradients g_a = (6, 8), g_b = (1, 1), g_c = (0, -2), the
    target's g_T = (0, 12); lr_t = 1e-3, mu = 0.01, alpha_{t-1} = (0.5, 0.25, 0.25).

    lines 733-734: clip to norm 5: c_a = 5 / (10 + 1e-6) = 0.499999950000005, c_T = 5 / (12 + 1e-6)
      = 0.41666663194444736; g_b (norm sqrt 2) and g_c (norm 2) are kept.
    line 748, 756: W = (96 c_a c_T, 12 c_T, -24 c_T) = (19.99999633333384, 4.999999583333368,
      -9.999999166666736) (one target domain: the sum over targets is that one product).
    line 758: N = mean(10 c_a, sqrt 2, 2) = 2.804737687457715.
    line 759: lr W / (N + 1e-6) = (0.007130787770985658, 0.0017826971210161088, -0.0035653942420322176).
    line 760: clipped into lr [0, 5] = [0, 0.005]: (0.005, 0.0017826971210161088, 0).
    lines 763-764: alpha_t = softmax(log alpha_{t-1} + s / mu), s / mu = (0.5, 0.17826971210161088, 0):
      alpha_t = (0.5 e^0.5, 0.25 e^0.178..., 0.25) / their sum
              = (0.6003438163736897, 0.2175927181265433, 0.18206346549976704).
    line 769: direction = sum_i alpha_t[i] (clipped g_i) = (2.0186239871444855, 2.254840812484266).
    """
    f64 = torch.float64
    grads = torch.tensor([[6.0, 8.0], [1.0, 1.0], [0.0, -2.0]], dtype=f64)
    target = torch.tensor([0.0, 12.0], dtype=f64)
    coefs = torch.tensor([clip_coef(float(g.norm())) for g in grads], dtype=f64)
    assert coefs.tolist() == [0.499999950000005, 1.0, 1.0]
    clipped = grads * coefs[:, None]
    t = target * clip_coef(12.0)
    alignment, norms = clipped @ t, clipped.norm(dim=1)
    assert alignment.tolist() == pytest.approx([19.99999633333384, 4.999999583333368, -9.999999166666736], rel=1e-15)
    assert float(norms.mean()) == pytest.approx(2.804737687457715, rel=1e-15)

    scores = authors_scores(alignment, norms, lr=1e-3, mu=0.01, clip=[0.0, 5.0])
    assert scores.tolist() == pytest.approx([0.5, 0.17826971210161088, 0.0], rel=1e-13, abs=1e-15)
    log_prev = torch.log(torch.tensor([0.5, 0.25, 0.25], dtype=f64))
    alpha = doge_update(log_prev, scores).exp()
    assert alpha.tolist() == pytest.approx([0.6003438163736897, 0.2175927181265433, 0.18206346549976704], rel=1e-13)
    assert (alpha @ clipped).tolist() == pytest.approx([2.0186239871444855, 2.254840812484266], rel=1e-13)
    # the paper's form keeps the negative alignment and skips the normalisation
    paper = torch.tensor([19.99999633333384, 4.999999583333368, -9.999999166666736], dtype=f64) * 1e-3 / 0.01
    assert not math.isclose(float(paper[2]), float(scores[2]))


SETS = ["train.decay=constant", "train.warmup_steps=0", "train.lr=0.01", "mixing.method=doge", "train.grad_clip=0"]


def test_one_step_matches_the_released_equations_on_autograd_gradients(stores, tmp_path):
    """The deferred aligned step: each domain's mean-loss gradient and the target's, clipped to
    `domain_grad_clip` (set between the smallest and largest raw norm, so that it binds for
    some), their products, the mean norm, the clipped scores and the update sum_i alpha_1[i] g_i
    equal the released code's equations applied to gradients taken by autograd on a copy."""
    twin = stages.proxy_trainer(config(stores, tmp_path / "twin", *SETS, "train.steps=1"))
    spec = twin.hook.needs.alignment
    assert spec.deferred and spec.domain_clip == 5.0

    def norm(g: list[torch.Tensor]) -> float:
        return math.sqrt(sum(float((x * x).sum()) for x in g))

    g_target, per_domain = autograd_gradients(twin, 3)
    raw = [[x.double() for x in g] for g in [g_target, *per_domain]]
    raw_norms = sorted(norm(g) for g in raw)
    clip = (raw_norms[1] + raw_norms[2]) / 2

    cfg = config(stores, tmp_path / "run", *SETS, "train.steps=1", "train.micro_batches=2")
    cfg.mixing.doge.domain_grad_clip = clip
    trainer = stages.proxy_trainer(cfg)
    trainer.model.load_state_dict(twin.model.state_dict())
    seen = fit_capturing_gradients(trainer)
    row = read_history(tmp_path / "run")[0]

    clipped = [[x * clip_coef(norm(g), clip) for x in g] for g in raw]
    assert any(norm(g) > clip for g in raw) and any(norm(g) < clip for g in raw)
    g_t, per_domain = clipped[0], clipped[1:]
    alignment = [sum(float((a * t).sum()) for a, t in zip(g, g_t)) for g in per_domain]
    norms = [norm(g) for g in per_domain]
    assert row["alignment"] == pytest.approx(alignment, rel=1e-5)
    assert row["grad_norm"] == pytest.approx(norms, rel=1e-5)
    lr = 0.01
    s = [min(max(lr * a / (sum(norms) / 3 + 1e-6), 0.0), 5 * lr) / 0.01 for a in alignment]
    alpha = np.exp(s) / np.exp(s).sum()
    assert row["weights"] == pytest.approx(alpha.tolist(), rel=1e-5)
    for (name, _), *gs in zip(twin.named_params, *per_domain):
        want = sum(a * g for a, g in zip(alpha, gs))
        torch.testing.assert_close(seen[name].double(), want, rtol=1e-4, atol=1e-7, msg=name)


LAYOUT = ["parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=2", "parallelism.sequence_parallel=true"]
CLIPPED = [*SETS, "train.steps=3", "train.micro_batches=2", "mixing.doge.domain_grad_clip=0.01"]


def _layout_worker(rank: int, world: int, store: str, run: str) -> None:
    stages.train_proxy(config(Path(store), Path(run), *CLIPPED, *LAYOUT))


def test_clipped_norms_scores_and_weights_do_not_depend_on_the_layout(stores, tmp_path):
    """With the per-domain clip binding (norm 0.01), the deferred step under tp2 pp2 dp2 (each
    domain's gradient summed over dp before its norm) logs the norms, inner products and
    weights of one process to 1e-6."""
    from tests.distributed import spawn

    stages.train_proxy(config(stores, tmp_path / "single", *CLIPPED))
    spawn(_layout_worker, 8, str(stores), str(tmp_path / "grid"))
    want, got = read_history(tmp_path / "single"), read_history(tmp_path / "grid")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for a, b in zip(want, got):
        assert a["grad_norm"] == pytest.approx([0.01] * 3, rel=1e-3)  # every domain clipped
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], abs=1e-9)
        assert b["alignment"] == pytest.approx(a["alignment"], rel=1e-5, abs=1e-12)
        assert b["weights"] == pytest.approx(a["weights"], abs=1e-6)
    assert max(abs(x - 1 / 3) for x in want[-1]["weights"]) > 1e-4  # they moved
