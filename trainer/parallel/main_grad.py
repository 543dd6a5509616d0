"""Main grads (Megatron-LM's `main_grad`): fp32 gradient accumulators for bf16 parameters.

With bf16 parameters, summing micro-batch gradients in bf16 `.grad` rounds every partial sum to
8 mantissa bits. `attach_main_grad` gives a parameter an fp32 buffer (`trainer.optim.master_weights`
does, when the step sums gradients) that a post-accumulate-grad hook fills after each backward
(the first write of a step copies, later ones add) before dropping `.grad`. `grad_of` is the one
accessor that every gradient consumer (the dp reductions, the tp and tied syncs, clipping) reads:
the main grad where one is attached, `.grad` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_WRITTEN_ATTR = "_main_grad_written"
_HOOK_ATTR = "_main_grad_hook"


def attach_main_grad(param: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Accumulate `param`'s gradients into `main_grad` (same shape, fp32) from now
    on, exposed as `param.main_grad`; `.grad` is dropped after each backward."""
    old = getattr(param, _HOOK_ATTR, None)
    if old is not None:
        old.remove()
    param.main_grad = main_grad
    setattr(param, _WRITTEN_ATTR, False)
    setattr(param, _HOOK_ATTR, param.register_post_accumulate_grad_hook(_accumulate_main_grad))


def _accumulate_main_grad(param: torch.Tensor) -> None:
    if getattr(param, _WRITTEN_ATTR):
        param.main_grad.add_(param.grad)
    else:
        param.main_grad.copy_(param.grad)
        setattr(param, _WRITTEN_ATTR, True)
    param.grad = None


def reset_main_grads(params: Sequence[torch.Tensor]) -> None:
    """Start a new step: the next backward overwrites the main grads instead of adding (no
    memset: a main grad that no backward writes reads as zero, see `grad_of`)."""
    for p in params:
        if hasattr(p, _WRITTEN_ATTR):
            setattr(p, _WRITTEN_ATTR, False)


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient of `param` for this step: its main grad when one is attached (zeroed if no
    backward wrote it since `reset_main_grads`; a `.grad` set outside autograd is added in
    first), else `.grad`."""
    main = getattr(param, "main_grad", None)
    if main is None:
        return param.grad
    if param.grad is not None:
        _accumulate_main_grad(param)
    if not getattr(param, _WRITTEN_ATTR):
        main.zero_()
        setattr(param, _WRITTEN_ATTR, True)
    return main
