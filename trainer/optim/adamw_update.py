"""The AdamW update of `trainer.optim.master_weights`: fp32 master weights and moments in flat
buffers, the bf16 parameters the master's top half. Two forms of one update, by where the
gradients are:

- `adamw_update`: the gradients in one flat buffer (the main grads, when the step sums them
  over micro-batches or ranks). torch ops; `torch.compile` makes it one kernel on CUDA.
- `adamw_update_tensors`: the gradients where autograd left them, one `.grad` tensor per
  parameter (when nothing sums gradients, so a main-grad buffer would only be a copy: 4 bytes
  per parameter of traffic, 1.2 ms of a 1B step on an H200, and 2 bytes of memory). On CUDA one
  Triton kernel covers every parameter (`trainer.optim.multi_tensor`: whole blocks, then the partial
  last blocks): each program updates one block of one tensor, finding its gradient through a
  device table of the `.grad` addresses (rebuilt each step, copied from pinned memory, so no
  synchronisation). Elsewhere, or without Triton, the flat form per parameter. Few launches
  matter: 99 launches of a compiled update (one per tensor of the 1B model) measured slower
  than the copy they saved (experiments/notes/PERFORMANCE.md, run 8).

Both compute torch.optim.AdamW's update (Loshchilov & Hutter 2019: decoupled weight decay,
bias corrections) on the master with gradient `grad * grad_scale`, weight decay on the first
`n_decay` elements only (the matrices come first in the buffers). `lr` and `step` are 0-dim
float64 device tensors (`step` counts this update: 1 on the first), so nothing is read back to
the host.

The master is not stored as fp32: it is the bf16 parameter plus a 16-bit remainder
(`split_fp32`, `join_fp32`), which together hold its 32 bits exactly. The update moves 8 bytes
of master per parameter (parameter and remainder, in and out) instead of 10 (the fp32 master in
and out, its bf16 rounding out), and the optimizer keeps 2 bytes of master instead of 4. The
price: the parameter is the master rounded half away from zero, not half to even. Only exact
ties differ (a low half of exactly 2^15); under round half to even 2^16 + 1 fp32 values round
to each even bf16 and 2^16 - 1 to each odd one, so no 16 bits could tell them apart.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.model.ops.dispatch import triton_kernels_of
from trainer.optim.multi_tensor import ADDRESS_ALIGN, TensorBlocks, aligned, launch, tensor_pointers, triton_runs_on

#: Elements per Triton program (one tensor's block) and warps per program: the fastest of
#: 512-4096 elements and 2-16 warps at the 1B sizes on an H200 (7.56 ms for 30.9 GB;
#: `micro_bench.py --sections update`, experiments/notes/PERFORMANCE.md).
BLOCK = 1024
NUM_WARPS = 8


def adamw_coefficients(
    lr: torch.Tensor, step: torch.Tensor, grad_scale: torch.Tensor, beta1: float, beta2: float, weight_decay: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (step size, sqrt of the second bias correction, decay factor, gradient scale),
    computed in float64 as torch.optim.AdamW does on the host."""
    step_size = (lr / (1.0 - beta1**step)).float()
    bias_correction2_sqrt = (1.0 - beta2**step).sqrt().float()
    keep = (1.0 - lr * weight_decay).float()
    return step_size, bias_correction2_sqrt, keep, grad_scale.float()


def stacked_coefficients(
    lr: torch.Tensor, step: torch.Tensor, grad_scale: torch.Tensor, beta1: float, beta2: float, weight_decay: float
) -> torch.Tensor:
    """`adamw_coefficients` as one fp32 [4] tensor, what the Triton kernel reads."""
    return torch.stack(adamw_coefficients(lr, step, grad_scale, beta1, beta2, weight_decay))


def split_fp32(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write fp32 `master` into bf16 `param` (its rounding, half away from zero) and int16
    `remainder` (its low 16 bits), so that `join_fp32(param, remainder)` is `master` exactly
    (every bit, NaN payloads aside). Integer ops on the bits: the carry of the low half into the
    high one is the rounding."""
    bits = master.view(torch.int32)
    low = bits & 0xFFFF
    remainder.copy_((low ^ 0x8000) - 0x8000)
    param.copy_(((bits >> 16) + (low >> 15)).to(torch.int16).view(torch.bfloat16))


def join_fp32(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master held by bf16 `param` and int16 `remainder` (`split_fp32`'s inverse): a
    negative remainder (low half >= 2^15) says the rounding carried into the parameter."""
    high = param.view(torch.int16).to(torch.int32) - (remainder < 0).to(torch.int32)
    return ((high << 16) | (remainder.to(torch.int32) & 0xFFFF)).view(torch.float32)


def adamw_update(
    remainder: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param: torch.Tensor,
    lr: torch.Tensor,
    step: torch.Tensor,
    grad_scale: torch.Tensor,
    n_decay: int,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """In place on flat buffers of one length (see the module docstring): the master is
    `join_fp32(param, remainder)` before and after."""
    step_size, bias_correction2_sqrt, keep, scale = adamw_coefficients(lr, step, grad_scale, beta1, beta2, weight_decay)
    g = grad.float() * scale
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    decayed = torch.arange(param.numel(), device=param.device) < n_decay
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    master = join_fp32(param, remainder) * torch.where(decayed, keep, 1.0) - step_size * exp_avg / denom
    split_fp32(master, param, remainder)


@functools.cache
def triton_kernel():
    """The Triton kernel (`trainer.optim.multi_tensor_triton`), or None without Triton; built on first
    use (trainer.model.ops.dispatch)."""
    kernels = triton_kernels_of("trainer.optim.multi_tensor_triton", "adamw_tensors_kernel")
    return kernels and kernels[0]


def uses_triton(device: torch.device) -> bool:
    """Whether `adamw_update_tensors` runs the Triton kernel for buffers on `device`."""
    return triton_runs_on(device) and triton_kernel() is not None


@dataclass(frozen=True)
class UpdateState:
    """What the Triton update writes and reads beside the gradients: this rank's flat buffers
    (`remainder`, the moments, `param`), their block table, the stacked coefficients
    (`stacked_coefficients`, fp32 [4]), the decayed elements and the AdamW constants."""

    remainder: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    param: torch.Tensor
    blocks: TensorBlocks
    coefficients: torch.Tensor
    n_decay: int
    beta1: float
    beta2: float
    eps: float


def adamw_update_tensors(state: UpdateState, grads: Sequence[torch.Tensor]) -> None:
    """The update with one gradient tensor per parameter, in one Triton kernel (see the module
    docstring). `grads[i]` is the gradient of the flat buffers' elements [offsets[i], +numels[i])
    (`state.blocks`), in the parameters' dtype."""
    for g in grads:
        if g.dtype != state.param.dtype or not g.is_contiguous():
            raise ValueError(
                f"adamw_update_tensors: gradients must be contiguous {state.param.dtype}, "
                f"got {g.dtype} of strides {g.stride()}"
            )
    if not aligned(grads):
        raise ValueError(f"adamw_update_tensors: gradient addresses must be {ADDRESS_ALIGN}-byte aligned")
    _launch_update(state, tensor_pointers(grads, state.param.device), 0, state.coefficients, len(grads))


def adamw_update_combined(state: UpdateState, rows: Sequence[torch.Tensor], weights: torch.Tensor) -> None:
    """`adamw_update_tensors` with each parameter's gradient sum_r weights[r] rows[i][r] (rows[i]
    [R, *shape], R rows each contiguous, in the parameters' dtype; weights [R], upcast to fp32),
    summed in fp32 in row order and rounded once to the parameters' dtype inside the kernel:
    what `trainer.model.ops.skinny_products_triton.weighted_rows` would write and this update
    would read, without the write and the read (DoGE's one-pass update, `trainer.run.alignment`:
    one read of the k domain gradients instead of that read, a write and another read)."""
    r = rows[0].shape[0] if rows else 0
    dtype = state.param.dtype
    for g in rows:
        if g.dtype != dtype or not g.is_contiguous() or g.shape[0] != r or g.numel() % max(r, 1):
            raise ValueError(
                f"adamw_update_combined: rows must be contiguous {dtype} [{r}, ...], "
                f"got {g.dtype} {tuple(g.shape)} of strides {g.stride()}"
            )
    if not 1 <= r <= 16 or weights.shape != (r,):
        raise ValueError(f"adamw_update_combined: expected 1 to 16 rows and weights [{r}], got {tuple(weights.shape)}")
    if not aligned(rows) or any(g.numel() // r * g.element_size() % ADDRESS_ALIGN for g in rows):
        raise ValueError(f"adamw_update_combined: row addresses must be {ADDRESS_ALIGN}-byte aligned")
    device = state.param.device
    weights = weights.to(device=device, dtype=torch.float32).contiguous()
    _launch_update(state, tensor_pointers(rows, device, r), r, weights, len(rows))


def _launch_update(state: UpdateState, pointers: torch.Tensor, rows: int, weights: torch.Tensor, n: int) -> None:
    """The kernel over every block of `state.blocks`, the gradients at `pointers` (`rows` of each
    of the n tensors, or 0: the tensors themselves; `weights` read only with rows)."""
    s = state
    launch(
        triton_kernel(),
        s.blocks,
        pointers,
        s.blocks.offsets,
        s.blocks.numels,
        s.remainder,
        s.exp_avg,
        s.exp_avg_sq,
        s.param,
        s.coefficients,
        s.n_decay,
        s.beta1,
        1.0 - s.beta1,
        s.beta2,
        1.0 - s.beta2,
        s.eps,
        weights,
        n,
        ROWS=rows,
        ALIGN=s.blocks.align,
        num_warps=NUM_WARPS,
    )
