"""Numeric health of a run: a non-finite loss or gradient norm stops it, naming the step.

A run whose loss became NaN used to train on, write NaN checkpoints over its finite ones and
fail later in its summary. `NumericHealth` remembers, on the device, the first step whose loss
or global gradient norm was not finite (`observe`: tensor ops only, no host sync inside a
step; docs/design.md section 7). The loop reads it (`check`) only where it reads the device
anyway: at each logging step, before each evaluation, and always before a checkpoint is written.
So a non-finite step is detected at the latest at the next log step, evaluation or checkpoint,
whichever comes first, and no checkpoint is written after it: the last finite checkpoint stays
the latest, and the same command resumes from it (with a lower learning rate, say).

Both numbers are global (the loss is reduced over dp and broadcast over pipeline stages, the
gradient norm all-reduced over every rank), so every rank reaches the same verdict at the same
step without a collective of its own (docs/design.md section 6).
"""

from __future__ import annotations

import torch

from data.errors import UserError


class NonFiniteError(UserError):
    """The loss or gradient norm of a step was NaN or infinite; the run stopped before any
    checkpoint of that step or later was written."""

    def __init__(self, step: int, loss: float, grad_norm: float, run_dir: str):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(
            f"{run_dir}: step {step}: loss {loss:g}, gradient norm {grad_norm:g}: not finite; stopped "
            f"before any checkpoint of step {step} or later was written (lower train.lr, set "
            "train.grad_clip or check the data, then rerun: it resumes from the latest checkpoint)"
        )


class NumericHealth:
    """The first non-finite step since this process started, kept on `device`."""

    def __init__(self, device: torch.device):
        self.first = torch.zeros((), dtype=torch.int64, device=device)  # 0: none yet
        self.values = torch.zeros(2, dtype=torch.float64, device=device)  # its loss and gradient norm

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Record `step` if its loss or gradient norm is not finite and no earlier step was."""
        norm = torch.zeros((), dtype=torch.float64, device=self.first.device) if grad_norm is None else grad_norm
        now = torch.stack([loss.detach().to(torch.float64).reshape(()), norm.detach().to(torch.float64).reshape(())])
        new = (~torch.isfinite(now).all()) & (self.first == 0)
        self.first = torch.where(new, torch.full_like(self.first, step), self.first)
        self.values = torch.where(new, now, self.values)

    def check(self, run_dir: str) -> None:
        """Raise NonFiniteError for the first non-finite step observed (one host read)."""
        step = int(self.first)
        if step:
            loss, norm = (float(v) for v in self.values.tolist())
            raise NonFiniteError(step, loss, norm, run_dir)
