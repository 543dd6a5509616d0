"""Which parameters are decayed, their learning-rate multipliers (`lr_scale`, e.g. muP's per-layer
rates, `trainer.model.mup`: a parameter's `_lr_scale` attribute, default 1), and the order both
optimizers keep them in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Parameter


def lr_scale(p: Parameter) -> float:
    return float(getattr(p, "_lr_scale", 1.0))


def param_groups(named: Sequence[tuple[str, Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Matrices (decayed) then vectors; within each, runs of equal `lr_scale` in the given order
    (so that the groups' parameters, concatenated, keep `decay_first`'s order, which torch's
    state_dict indices follow). A group's lr is the scheduled lr times its "lr_scale"."""
    groups: list[dict[str, Any]] = []
    keys: list[tuple[bool, float]] = []
    for _, p in decay_first(named):
        key = (p.ndim >= 2, lr_scale(p))
        if not keys or keys[-1] != key:
            keys.append(key)
            groups.append({"params": [], "weight_decay": weight_decay if key[0] else 0.0, "lr_scale": key[1]})
        groups[-1]["params"].append(p)
    return groups


def decay_first(named: Sequence[tuple[str, Parameter]]) -> list[tuple[str, Parameter]]:
    """Matrices (weight decay) then vectors (none): the order of `param_groups`, which is that
    of the indices of torch's state_dict, and the two contiguous decay regions of a flat buffer."""
    return [x for x in named if x[1].ndim >= 2] + [x for x in named if x[1].ndim < 2]
