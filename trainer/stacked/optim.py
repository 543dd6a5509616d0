"""AdamW and gradient clipping for stacked parameters, equal to each model's own.

AdamW (Loshchilov & Hutter 2019) is elementwise: the moments, the bias corrections (one step
count for all models, which step together), the decoupled decay and the update of an element
read only that element. So torch's AdamW over a [M, ...] tensor is M ordinary AdamWs, provided
the options are the ordinary trainer's (`trainer.optim.sharded`: betas, eps, lr, weight decay;
fused on CUDA, foreach elsewhere, the same implementation as the ordinary run on the same
device) and the decay groups map by name: a stacked parameter is decayed when its per-model
slice is (`trainer.optim.param_groups`: matrices, not norms), i.e. on its per-model ndim, not
the stacked one.

Clipping is not elementwise: each model's coefficient min(1, max_norm / (norm_m + 1e-6))
(`trainer.optim.clip.clip_coefficient`) comes from its own global norm, the square root of
the sum over parameters, in the model's parameter order, of each parameter's squared norm over
model m's slice (all dims but the first).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import Parameter

from trainer.config.schema import TrainConfig
from trainer.config.tools import ConfigError
from trainer.optim.clip import clip_coefficient
from trainer.optim.multi_tensor import sums_of_squares, uses_triton_squares


def decayed(stacked: Parameter) -> bool:
    """`trainer.optim.param_groups`'s rule (matrices decay) applied to one model's slice."""
    return stacked.ndim - 1 >= 2


def stacked_adamw(named: Sequence[tuple[str, Parameter]], cfg: TrainConfig) -> torch.optim.AdamW:
    """torch AdamW over the stacked parameters with the ordinary run's options and groups."""
    if cfg.optimizer != "adamw":
        raise ConfigError(
            f"train.optimizer: stacked training is elementwise AdamW only (Adafactor factors the "
            f"second moment over each tensor), got {cfg.optimizer!r}"
        )
    decay = [p for _, p in named if decayed(p)]
    no_decay = [p for _, p in named if not decayed(p)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = all(p.device.type == "cuda" for _, p in named)
    accel = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **accel
    )


def slice_squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """[M, len(grads)] fp32: the sum of squares of each model's slice of each gradient, each the
    ordinary clip's own on that slice as on a whole parameter (`trainer.optim.clip.squares`):
    on CUDA the same Triton kernels over the slices as rows (`sums_of_squares(rows=M)`), elsewhere
    the same `linalg_vector_norm` reduction that `_foreach_norm` runs per tensor, over each
    gradient's rows. Either is a fixed number of ops per parameter whatever M is: a slice list
    of M x parameters views cost one op each (issue 37 item 4)."""
    models = grads[0].shape[0]
    if uses_triton_squares(grads, rows=models):
        return sums_of_squares(grads, rows=models).view(models, len(grads))
    norms = [torch.linalg.vector_norm(g.reshape(models, -1), 2, dim=1, dtype=torch.float32) for g in grads]
    return torch.stack(norms, dim=1).square()


def per_model_grad_norms(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """[M] fp32: each model's global gradient norm over its slices of `params` (in order), each
    model's sum over a contiguous row (`slice_squares`), so a model's norm depends on its
    gradients only, not on how many models are stacked with it."""
    grads = [p.grad for p in params if p.grad is not None]
    return slice_squares(grads).sum(dim=1).sqrt()


@torch.no_grad()
def clip_per_model(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip each model's gradients in place by its own coefficient when max_norm > 0; return
    the per-model norms [M] (device tensor, no host sync)."""
    norms = per_model_grad_norms(params)
    if max_norm > 0:
        coef = clip_coefficient(norms, max_norm)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.view(-1, *([1] * (p.ndim - 1))).to(p.grad.dtype))
    return norms
