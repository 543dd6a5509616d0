"""What the training loop and the checkpoints use of an optimizer, and its state error."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from data.errors import UserError


class OptimizerStateError(UserError, ValueError):
    """An optimizer state that does not fit this optimizer: one line naming the parameter."""


class Optimizer(Protocol):
    """What the training loop and the checkpoints use of an optimizer."""

    kind: str  # "adamw" | "adafactor": the state's format
    zero1: bool  # the state is sharded over dp (each rank writes its own)
    keeps_master: bool  # the state holds an fp32 "master" of each (lower-precision) parameter

    def reduce_gradients(self) -> Any: ...
    def combine_gradients(self, rows: dict[int, torch.Tensor], weights: torch.Tensor, norm: torch.Tensor) -> bool:
        """Take each parameter p's next gradient as sum_r weights[r] rows[id(p)][r], unwritten,
        with `norm` its global L2 norm; False where this optimizer cannot (write `.grad`)."""
        ...

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor: ...
    def step(self, lr: float | None = None) -> None: ...
    def zero_grad(self) -> None: ...
    def owned_names(self) -> list[str]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, sd: dict[str, Any]) -> None: ...
