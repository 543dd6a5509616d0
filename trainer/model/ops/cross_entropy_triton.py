"""The Triton programs of `trainer.model.ops.cross_entropy`: per row, the loss and logsumexp in
one pass over the vocabulary, and the gradient. Imported only by `cross_entropy.triton_kernels`,
on first use (Triton is optional)."""

import triton
import triton.language as tl


@triton.jit
def cross_entropy_forward_kernel(
    logits, target, loss, lse_out, vocab_size, row_stride, ignore_index, BLOCK_SIZE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    m = tl.full([BLOCK_SIZE], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_SIZE], tl.float32)
    for start in range(0, vocab_size, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        z = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(z - shift)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
    t = tl.load(target + row)
    inside = (t >= 0) & (t < vocab_size)
    z_t = tl.load(base + t, mask=inside, other=float("nan")).to(tl.float32)
    tl.store(loss + row, tl.where(t == ignore_index, 0.0, lse - z_t))
    tl.store(lse_out + row, lse)


@triton.jit
def cross_entropy_backward_kernel(
    grad,
    logits,
    target,
    lse,
    out,
    vocab_size,
    n_cols,
    row_stride,
    out_row_stride,
    ignore_index,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    t = tl.load(target + row)
    g = tl.where(t == ignore_index, 0.0, tl.load(grad + row).to(tl.float32))
    z = tl.load(logits + row * row_stride + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.load(lse + row))
    d = g * (p - tl.where(cols == t, 1.0, 0.0))
    tl.store(out + row * out_row_stride + cols, d.to(out.dtype.element_ty), mask=cols < n_cols)
