"""Which parameters are decayed, their learning-rate multipliers (`lr_scale`, e.g. muP's per-layer
rates, `trainer.model.mup`: a parameter's `_lr_scale` attribute, default 1), and the order both
optimizers keep them in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.nn import Parameter


def lr_scale(p: Parameter) -> float:
    return float(getattr(p, "_lr_scale", 1.0))


def scaled_weight_decay(weight_decay: float, scale: float) -> float:
    """The decoupled weight decay of a matrix whose lr is multiplied by `scale`: divided by it, so
    that the decay per step, lr x weight_decay, does not depend on the multiplier. Under muP
    (scale = 1 / width ratio) this is microsoft/mup's rule (mup/optim.py `MuAdam`: `lr /=
    width_mult`, `weight_decay *= width_mult` for matrix-like parameters); with the decay scaled
    along with the lr, a wider model would shrink its hidden weights less per step than its base."""
    return weight_decay if scale == 1.0 else weight_decay / scale


def param_groups(named: Sequence[tuple[str, Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Matrices (decayed) then vectors; within each, runs of equal `lr_scale` in the given order
    (so that the groups' parameters, concatenated, keep `decay_first`'s order, which torch's
    state_dict indices follow). A group's lr is the scheduled lr times its "lr_scale"; a matrix
    group's weight decay is `scaled_weight_decay`'s."""
    groups: list[dict[str, Any]] = []
    keys: list[tuple[bool, float]] = []
    for _, p in decay_first(named):
        key = (p.ndim >= 2, lr_scale(p))
        if not keys or keys[-1] != key:
            keys.append(key)
            decay = scaled_weight_decay(weight_decay, key[1]) if key[0] else 0.0
            groups.append({"params": [], "weight_decay": decay, "lr_scale": key[1]})
        groups[-1]["params"].append(p)
    return groups


def decay_first(named: Sequence[tuple[str, Parameter]]) -> list[tuple[str, Parameter]]:
    """Matrices (weight decay) then vectors (none): the order of `param_groups`, which is that
    of the indices of torch's state_dict, and the two contiguous decay regions of a flat buffer."""
    return [x for x in named if x[1].ndim >= 2] + [x for x in named if x[1].ndim < 2]
