import math

import pytest

from trainer.config.schema import TrainConfig
from trainer.optim.lr_schedule import lr_at, warmup_steps

# 100 steps, 6% warmup -> W = 6; the decay runs over steps 7..100, progress (s - 6) / 94.
BASE = dict(steps=100, lr=1e-3, min_lr=1e-4, warmup_fraction=0.06)


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**{**BASE, **kw})


def test_warmup_is_linear_from_step_one():
    c = cfg(decay="exponential")
    assert warmup_steps(c) == 6
    assert lr_at(1, c) == pytest.approx(1e-3 / 6, rel=1e-12)
    assert lr_at(3, c) == pytest.approx(0.5e-3, rel=1e-12)
    assert lr_at(6, c) == pytest.approx(1e-3, rel=1e-12)


@pytest.mark.parametrize(
    "decay, mid, step7",
    [
        # mid: step 53, progress 1/2. step7: progress 1/94.
        ("exponential", 1e-3 * math.sqrt(0.1), 1e-3 * 0.1 ** (1 / 94)),
        ("cosine", 1e-4 + 9e-4 * 0.5, 1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi / 94))),
        ("linear", 1e-3 - 9e-4 * 0.5, 1e-3 - 9e-4 / 94),
        ("constant", 1e-3, 1e-3),
    ],
)
def test_decay_shapes(decay, mid, step7):
    c = cfg(decay=decay)
    assert lr_at(7, c) == pytest.approx(step7, rel=1e-12)
    assert lr_at(53, c) == pytest.approx(mid, rel=1e-12)
    final = 1e-3 if decay == "constant" else 1e-4
    assert lr_at(100, c) == pytest.approx(final, rel=1e-12)
    assert lr_at(150, c) == pytest.approx(final, rel=1e-12)


def test_doremi_paper_schedule_reaches_min_lr_at_last_step():
    c = cfg(steps=200_000, decay="exponential")
    assert warmup_steps(c) == 12_000
    assert lr_at(12_000, c) == pytest.approx(1e-3, rel=1e-12)
    assert lr_at(106_000, c) == pytest.approx(1e-3 * math.sqrt(0.1), rel=1e-12)
    assert lr_at(200_000, c) == pytest.approx(1e-4, rel=1e-12)


def test_warmup_steps_override_fraction_and_zero_warmup():
    c = cfg(warmup_steps=10, decay="linear")
    assert lr_at(5, c) == pytest.approx(5e-4, rel=1e-12)
    assert lr_at(55, c) == pytest.approx(1e-3 - 9e-4 * 0.5, rel=1e-12)
    z = cfg(warmup_steps=0, decay="linear")
    assert lr_at(1, z) == pytest.approx(1e-3 - 9e-4 / 100, rel=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match="1-based"):
        lr_at(0, cfg())
    with pytest.raises(ValueError, match="train.min_lr"):
        lr_at(50, cfg(decay="exponential", min_lr=0.0))
    with pytest.raises(ValueError, match="train.warmup_steps"):
        lr_at(5, cfg(warmup_steps=-1))
