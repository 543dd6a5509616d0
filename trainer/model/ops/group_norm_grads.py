"""Per-group RMSNorm weight gradients for DoGE's one pass (`trainer.run.group_grads`): for
y = x_hat w_row (x_hat = x rstd, each row's weight its group's), the gradient of group g's weight
is sum over g's tokens of dy x_hat, one [d] per group.

Why an op of its own: written as `F.rms_norm(x) * leaf[rows]` and left to inductor, the weight's
per-row sums over the sequence (a reduction over s for each (row, column)) were fused with the
norm's backward into one looped reduction that recomputed the norm: 218 us a norm at 1B on one
H100 against plain's 95 us (7.2 ms of the step against 3.2 at 9/8 of plain's rows; the 16th
session's profile). As an opaque op the weight's sums are one pass over dy and x (this op), and
the input's gradient is the usual row-wise norm backward that inductor fuses with the residual's.

`group_norm_weight_grads(dy, x, rstd, rows, k, dtype)`: dy, x [b, s, d] (batch-first rows,
each row one group's), rstd [b, s, 1] (fp32, or fp64 for fp64 inputs), rows [b] each row's
group (on the device) -> [k, d] in `dtype`, accumulated in rstd's dtype. On CUDA two Triton
kernels (`group_norm_grads_triton`): each program sums dy x rstd over a chunk of one row's
tokens into fp32 partials (one read of dy and x), then each group's partials are added in a
fixed order (no atomics: bitwise repeatable); elsewhere the same sums in torch ops.
"""

from __future__ import annotations

import functools

import torch

from trainer.model.ops.dispatch import triton_kernels_of, triton_or_torch

#: Tokens a program of the first kernel adds up (one [TOKENS, BLOCK] tile of dy and of x), columns
#: a program covers (both kernels), partial rows a tile of the second adds.
TOKENS = 64
BLOCK = 128
CHUNKS = 32


def group_norm_weight_grads_torch(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, rows: torch.Tensor, k: int, dtype: torch.dtype
) -> torch.Tensor:
    """`group_norm_weight_grads` in torch ops."""
    wide = rstd.dtype  # fp32, or fp64 for fp64 inputs
    per_row = (dy.to(wide) * (x.to(wide) * rstd)).sum(1)  # [b, d]
    onehot = (rows[:, None] == torch.arange(k, device=rows.device)[None, :]).to(per_row.dtype)  # [b, k]
    return (onehot[:, :, None] * per_row[:, None, :]).sum(0).to(dtype)


@functools.cache
def triton_kernels():
    """(row chunks, group sums) Triton kernels, or None without Triton; built on first use."""
    return triton_kernels_of("trainer.model.ops.group_norm_grads_triton", "row_chunk_sums_kernel", "group_sums_kernel")


def group_norm_weight_grads_triton(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, rows: torch.Tensor, k: int, dtype: torch.dtype
) -> torch.Tensor:
    """The two kernels: fp32 partials [b, chunks, d], then each group's in row and chunk order
    (fp64 inputs take the torch ops: the kernels add in fp32)."""
    if rstd.dtype != torch.float32:
        return group_norm_weight_grads_torch(dy, x, rstd, rows, k, dtype)
    chunk_sums, group_sums = triton_kernels()
    b, s, d = x.shape
    dy, x, rstd, rows = dy.contiguous(), x.contiguous(), rstd.contiguous(), rows.contiguous()
    chunks = -(-s // TOKENS)
    out = torch.empty(k, d, dtype=dtype, device=x.device)
    if out.numel() == 0:
        return out
    if b * s == 0:
        return out.zero_()
    partials = torch.empty(b, chunks, d, dtype=torch.float32, device=x.device)
    blocks = -(-d // BLOCK)
    chunk_sums[(b * chunks, blocks)](dy, x, rstd, partials, s, d, chunks, TOKENS=TOKENS, BLOCK=BLOCK)
    group_sums[(k, blocks)](partials, rows, out, b, chunks, d, CHUNKS=CHUNKS, BLOCK=BLOCK)
    return out


group_norm_weight_grads = torch.library.custom_op(
    "trainer::group_norm_weight_grads", group_norm_weight_grads_torch, mutates_args=()
)
group_norm_weight_grads.register_kernel(
    "cuda", triton_or_torch(triton_kernels, group_norm_weight_grads_torch, group_norm_weight_grads_triton)
)


@group_norm_weight_grads.register_fake
def _(dy, x, rstd, rows, k, dtype):
    return x.new_empty((k, x.shape[-1]), dtype=dtype)
