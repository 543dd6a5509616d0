"""What the layout tests assert of two runs that must agree, a layout's run against the
single-process one (docs/design.md section 5, "What must be layout-invariant"), and the settings
both run under."""

from __future__ import annotations

import pytest
import torch

#: The --set list of both runs of a comparison. Adam divides by |g| + eps: a larger eps keeps
#: summation-order rounding of near-zero gradients from being amplified to ~lr, so the parameter
#: comparison is about the gradients.
COMPARED = ["train.eps=1e-4", "train.decay=constant", "train.warmup_steps=0", "checkpoint.keep=1", "train.eval_every=3"]


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every parameter of `want` equal in `got` up to fp32 reduction order (rtol = atol = 1e-5)."""
    for p in want:
        torch.testing.assert_close(got[p], want[p], rtol=1e-5, atol=1e-5, msg=p)


def assert_same_alphas(want: list[list[float]], got: list[list[float]], steps: int, moved: float) -> None:
    """Two proxies' domain weights equal step by step (abs 1e-6), over `steps` steps, and the
    last step's weights more than `moved` from uniform (three domains), so that equal is not
    merely unchanged."""
    assert len(got) == len(want) == steps
    for t, (a, b) in enumerate(zip(want, got), start=1):
        assert b == pytest.approx(a, abs=1e-6), f"step {t}"
    assert max(abs(x - 1 / 3) for x in want[-1]) > moved
