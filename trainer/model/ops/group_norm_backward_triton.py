"""The Triton programs of `trainer.model.ops.group_norm_backward`; imported only through its
`triton_kernels`, on first use (Triton optional; TRITON_INTERPRET=1 read when they are made)."""

import triton
import triton.language as tl


@triton.jit
def chunk_backward_kernel(
    dy_ptr, x_ptr, rstd_ptr, w_ptr, res_ptr, dx_ptr, part_ptr, s, d, chunks,
    HAS_RESIDUAL: tl.constexpr, TOKENS: tl.constexpr, STEP: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Program (row r, chunk c): for the chunk's TOKENS tokens, STEP at a time with the whole
    width (COLS >= d) in registers, dx = rstd (dy w - x_hat mean(dy w x_hat)) (+ the residual's
    gradient), rounded once to dx's dtype, and part[r, c] = the sum over the chunk of dy x_hat in
    fp32 (dy, x, residual, dx [b, s, d] and rstd [b, s] contiguous; w [d])."""
    pid = tl.program_id(0)
    row = pid // chunks
    first = (pid % chunks) * TOKENS
    cols = tl.arange(0, COLS)
    live = cols < d
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    acc = tl.zeros((COLS,), dtype=tl.float32)
    for t in range(0, TOKENS, STEP):
        toks = first + t + tl.arange(0, STEP)
        inside = (toks < s) & (toks < first + TOKENS)
        flat = row.to(tl.int64) * s + toks
        at = flat[:, None] * d + cols[None, :]
        mask = inside[:, None] & live[None, :]
        g = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + flat, mask=inside, other=0.0)
        x_hat = v * r[:, None]
        gw = g * w[None, :]
        mean = tl.sum(gw * x_hat, axis=1) / d
        dx = r[:, None] * (gw - x_hat * mean[:, None])
        if HAS_RESIDUAL:
            dx += tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc += tl.sum(g * x_hat, axis=0)
    tl.store(part_ptr + pid.to(tl.int64) * d + cols, acc, mask=live)


@triton.jit
def group_sums_kernel(
    part_ptr, rows_ptr, out_ptr, b, chunks, d, ROWS: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr
):
    """Program (group g; column block): out[g, cols] = the sum of g's partials, CHUNKS partial
    rows a tile in order (fp32, rounded once to out's dtype). The rows are sorted by group (the
    one pass's order), so g's partials are one contiguous run, found from the count of rows
    before g and through g (one load of `rows`, ROWS >= b): no loop over the other groups' rows,
    whose serial loads bounded the form before it (12 us a norm at 1B, session 18's profile)."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < d
    r = tl.arange(0, ROWS)
    groups = tl.load(rows_ptr + r, mask=r < b, other=2147483647)
    first = tl.sum((groups < g).to(tl.int32)) * chunks
    end = tl.sum((groups <= g).to(tl.int32)) * chunks
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p0 in range(first, end, CHUNKS):
        p = p0 + tl.arange(0, CHUNKS)
        at = p.to(tl.int64)[:, None] * d + cols[None, :]
        acc += tl.sum(tl.load(part_ptr + at, mask=(p < end)[:, None] & live[None, :], other=0.0), axis=0)
    tl.store(out_ptr + g.to(tl.int64) * d + cols, acc.to(out_ptr.dtype.element_ty), mask=live)
