"""The check shared by the interpreter's and the GPU's tests of `MasterWeightAdamW.combine_gradients`
(tests/test_master_weights.py, tests/test_gpu.py): two optimizers built alike, one given each
step's sum of rows written as `.grad` by `write`, the other the rows unwritten, must end every
step bitwise alike."""

from __future__ import annotations

from collections.abc import Callable

import torch


def combined_against_written(
    written,
    combined,
    shapes: dict[str, tuple[int, ...]],
    write: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    rows: int,
    steps: int = 3,
) -> tuple[dict[int, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Steps both optimizers with clipping active; returns the last step's rows by parameter id,
    weights and norm (for the refusals a test checks after)."""
    g = torch.Generator(device=device).manual_seed(1)
    for t in range(steps):
        by_name = {n: torch.randn(rows, *s, generator=g, device=device).bfloat16() for n, s in shapes.items()}
        weights = torch.randn(rows, generator=g, device=device).bfloat16()
        for n, p in written.named_params:
            p.grad = write(weights, by_name[n])
        norm = written.clip_grad_norm(0.5)
        assert norm > 0.5  # clipping is active
        written.step(1e-2 / (t + 1))
        written.zero_grad()
        by_id = {id(p): by_name[n] for n, p in combined.named_params}
        assert combined.combine_gradients(by_id, weights, norm.double())
        assert all(p.grad is None for _, p in combined.named_params)
        assert torch.equal(combined.clip_grad_norm(0.5), norm)
        combined.step(1e-2 / (t + 1))
        combined.zero_grad()
        for (n, a), (_, b) in zip(written.named_params, combined.named_params):
            assert torch.equal(a.detach(), b.detach()), n
        for buf in ("remainder", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(written, buf), getattr(combined, buf)), buf
    return by_id, weights, norm
