"""Gradient-norm clipping over the whole model, under any (tp, pp, dp) layout.

The total norm is the L2 norm of the full (single-process) model's gradient, each element
counted once: every rank adds the squares of the gradients it is responsible for, and one
all-reduce sums them over the world. A rank is responsible for a parameter when
- it is not the tied duplicate of the embedding (`trainer.parallel.tied.is_tied_duplicate`: its
  gradient was summed with the first stage's, which counts it),
- it is tp-sharded (each tp rank holds a distinct slice), or replicated over tp and this is tp
  rank 0,
- this is its dp owner (`trainer.parallel.data_parallel.get_dp_owner`, set by the optimizer; with ZeRO-1
  only the owner holds the reduced gradient), or dp rank 0 when the parameter has no owner.
The scale factor is applied to every gradient present on the rank, duplicates included, so
what the optimizer uses is clipped. Semantics follow `torch.nn.utils.clip_grad_norm_`:
coefficient min(1, max_norm / (norm + 1e-6)). Gradients are read through
`trainer.parallel.main_grad.grad_of` (the fp32 main grad where one exists). No host synchronisation.

`global_grad_norm` and `clip_coefficient` are the two halves for an optimizer that applies the
coefficient inside its own update (`trainer.optim.master_weights`) instead of scaling in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from trainer.optim.multi_tensor import sums_of_squares, uses_triton_squares
from trainer.parallel.context import ParallelContext
from trainer.parallel.data_parallel import get_dp_owner
from trainer.parallel.main_grad import grad_of
from trainer.parallel.shard import get_shard_spec
from trainer.parallel.tied import is_tied_duplicate


def counts_here(name: str, param: torch.Tensor, pc: ParallelContext) -> bool:
    if is_tied_duplicate(name, pc):
        return False
    if pc.tp > 1 and get_shard_spec(param) is None and pc.tp_rank != 0:
        return False
    owner = get_dp_owner(param)
    return pc.dp_rank == (0 if owner is None else owner)


def global_grad_norm(named_params: Sequence[tuple[str, torch.Tensor]], pc: ParallelContext) -> torch.Tensor:
    """L2 norm of the whole model's gradient (fp32 0-dim on the device). Collective.

    Each parameter's sum of squares is computed alone, on the rank that counts it; the vector of
    them (one entry per parameter of this stage, zero where another dp rank counts it) is summed
    over dp, which is exact, and then in the order of `named_params`. So the norm adds no layout
    dependence of its own: given the same gradients, it and the clip coefficient are bitwise the
    same for any dp size, with or without ZeRO-1. With bf16 parameters a last-bit difference in
    the coefficient flips roundings, and runs that should agree drift apart."""
    grads = [grad_of(p) if counts_here(n, p, pc) else None for n, p in named_params]
    present = [g for g in grads if g is not None]
    if present:
        zero = torch.zeros((), dtype=torch.float32, device=pc.device)
        found = iter(squares(present).to(pc.device).unbind())
        per_param = torch.stack([next(found) if g is not None else zero for g in grads])
    else:
        per_param = torch.zeros(max(1, len(grads)), dtype=torch.float32, device=pc.device)
    if pc.dp > 1:
        dist.all_reduce(per_param, op=dist.ReduceOp.SUM, group=pc.dp_group)
    total = per_param.sum()
    if pc.world_size > pc.dp:
        if pc.dp_rank != 0:
            total = torch.zeros_like(total)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.sqrt()


def squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's sum of squares, in fp32: [len(tensors)], accumulated in fp32 without an fp32
    copy of a bf16 gradient (4 bytes a parameter at once, at the step's end, where full
    recompute has its peak). On CUDA `trainer.optim.multi_tensor.sums_of_squares` (deterministic, at
    copy bandwidth); elsewhere `_foreach_norm`, which read the 1B model's bf16 gradients at
    about 2.3 TB/s on an H200 (experiments/notes/PERFORMANCE.md)."""
    if uses_triton_squares(tensors):
        return sums_of_squares(tensors)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square()


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    return (max_norm / (total + 1e-6)).clamp(max=1.0)


def clip_grad_norm(
    named_params: Sequence[tuple[str, torch.Tensor]], max_norm: float, pc: ParallelContext
) -> torch.Tensor:
    """Clip in place when max_norm > 0; return the global total norm (fp32 0-dim tensor on the
    device). Call after the tp/tied syncs and the dp reduction."""
    total = global_grad_norm(named_params, pc)
    grads = [g for _, p in named_params if (g := grad_of(p)) is not None]
    if max_norm > 0 and grads:
        torch._foreach_mul_(grads, clip_coefficient(total, max_norm).to(grads[0].device))
    return total
