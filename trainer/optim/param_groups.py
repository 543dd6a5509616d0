"""Which parameters are decayed, and the order both optimizers keep them in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Parameter


def param_groups(named: Sequence[tuple[str, Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def decay_first(named: Sequence[tuple[str, Parameter]]) -> list[tuple[str, Parameter]]:
    """Matrices (weight decay) then vectors (none): the order of `param_groups`, which is that
    of the indices of torch's state_dict, and the two contiguous decay regions of a flat buffer."""
    return [x for x in named if x[1].ndim >= 2] + [x for x in named if x[1].ndim < 2]
