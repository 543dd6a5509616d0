"""RMSNorm's backward for DoGE's one pass (`trainer.run.group_grads`): the input's gradient and
each group's weight gradient from one read of dy and x, with the residual stream's gradient
added where the norm is a block's pre-norm.

For y = x_hat w (x_hat = x rstd, rstd = 1 / sqrt(mean(x^2) + eps)) over batch-first rows whose
groups are known, the weight's gradient of group g is the sum over g's tokens of dy x_hat (one
[d] per group) and the input's is rstd (dy w - x_hat mean(dy w x_hat)), plus, for a pre-norm,
the gradient the residual stream brings past the norm (the block's `x + mixer(norm(x))`).

Why one op for all three (the fused add-norm backward of Megatron and Apex): written as
`F.rms_norm(x) * leaf[rows]` and left to inductor, the weight's per-row sums over the sequence
were fused with the norm's backward into one looped reduction that recomputed the norm: 218 us a
norm at 1B on one H100 against plain's 95 (session 16's profile). The weight's sums as an op of
their own beside inductor's row-wise backward cost about 55 us a norm, 2.4 ms a step, for
reading dy and x a second time (session 18's). As one op whose backward also writes the input's
gradient, inductor would add the residual stream's gradient in a kernel of its own (about 70 us
a norm): so the op takes that gradient too, and the pass's pre-norm is one autograd function
with two outputs, the stream and the norm (`Block.pre_norm`), whose backward receives both.

`group_norm_backward(dy, x, rstd, weight, rows, k, dtype, residual)`: dy, x [b, s, d]
(batch-first, each row one group's), rstd [b, s, 1] (fp32, or fp64 for fp64 inputs), weight [d]
(the forward's, in x's dtype), rows [b] each row's group (on the device; sorted, the one pass's
order, which `trainer.run.group_grads.group_offsets` checks), residual [b, s, d] or
None -> (dx [b, s, d] in x's dtype, rounded once from rstd's dtype; the groups' weight gradients
[k, d] in `dtype`, accumulated in rstd's dtype). On CUDA two Triton kernels
(`group_norm_backward_triton`): each program takes a chunk of one row's tokens, writes their dx
and its fp32 partial of the weight's sums (one read of dy, x and the residual's gradient), then
each group's partials are added in a fixed order (no atomics: bitwise repeatable); elsewhere the
same math in torch ops.
"""

from __future__ import annotations

import functools

import torch

from trainer.model.ops.dispatch import triton_kernels_of, triton_or_torch

#: Tokens a program of the first kernel takes (its partial's share), columns a program of the
#: second covers, partial rows a tile of the second adds.
TOKENS = 32
BLOCK = 64
CHUNKS = 64
#: Elements of one [tokens, d] tile the first kernel holds per tensor (its tokens per iteration:
#: this over d's power of two, at least one), and its warps (None: by the width, `launch_shape`).
TILE = 4096
WARPS: int | None = None


def group_norm_backward_torch(
    dy: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_norm_backward` in torch ops."""
    wide = rstd.dtype  # fp32, or fp64 for fp64 inputs
    x_hat = x.to(wide) * rstd
    g = dy.to(wide) * weight.to(wide)
    dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    if residual is not None:
        dx = dx + residual.to(wide)
    per_row = (dy.to(wide) * x_hat).sum(1)  # [b, d]
    onehot = (rows[:, None] == torch.arange(k, device=rows.device)[None, :]).to(per_row.dtype)  # [b, k]
    return dx.to(x.dtype), (onehot[:, :, None] * per_row[:, None, :]).sum(0).to(dtype)


@functools.cache
def triton_kernels():
    """(chunks' backward, group sums) Triton kernels, or None without Triton; built on first use."""
    return triton_kernels_of(
        "trainer.model.ops.group_norm_backward_triton", "chunk_backward_kernel", "group_sums_kernel"
    )


def launch_shape(d: int) -> tuple[int, int, int]:
    """(columns' power of two, tokens an iteration, warps) of the first kernel for width d."""
    cols = 1 << max(d - 1, 0).bit_length()
    warps = WARPS or (4 if cols < 2048 else 8 if cols < 8192 else 16)
    return cols, max(1, TILE // cols), warps


def group_norm_backward_triton(
    dy: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two kernels: dx and fp32 partials [b, chunks, d], then each group's partials in row
    and chunk order (fp64 inputs take the torch ops: the kernels add in fp32)."""
    if rstd.dtype != torch.float32:
        return group_norm_backward_torch(dy, x, rstd, weight, rows, k, dtype, residual)
    chunk_backward, group_sums = triton_kernels()
    b, s, d = x.shape
    dy, x, rstd, weight, rows = (t.contiguous() for t in (dy, x, rstd, weight, rows))
    dx = torch.empty_like(x)
    out = torch.empty(k, d, dtype=dtype, device=x.device)
    if b * s * d == 0:
        return dx, out.zero_()
    chunks = -(-s // TOKENS)
    partials = torch.empty(b, chunks, d, dtype=torch.float32, device=x.device)
    cols, per_step, warps = launch_shape(d)
    has_residual = residual is not None
    res = residual.contiguous() if has_residual else dx  # never read without a residual
    chunk_backward[(b * chunks,)](
        dy, x, rstd, weight, res, dx, partials, s, d, chunks,
        HAS_RESIDUAL=has_residual, TOKENS=TOKENS, STEP=per_step, COLS=cols, num_warps=warps,
    )  # fmt: skip
    if k:
        rows_pow2 = 1 << max(b - 1, 0).bit_length()
        group_sums[(k, -(-d // BLOCK))](partials, rows, out, b, chunks, d, ROWS=rows_pow2, CHUNKS=CHUNKS, BLOCK=BLOCK)
    return dx, out


group_norm_backward = torch.library.custom_op(
    "trainer::group_norm_backward", group_norm_backward_torch, mutates_args=()
)
group_norm_backward.register_kernel(
    "cuda", triton_or_torch(triton_kernels, group_norm_backward_torch, group_norm_backward_triton)
)


@group_norm_backward.register_fake
def _(dy, x, rstd, weight, rows, k, dtype, residual=None):
    return torch.empty_like(x), x.new_empty((k, x.shape[-1]), dtype=dtype)
