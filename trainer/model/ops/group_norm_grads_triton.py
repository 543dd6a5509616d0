"""The Triton programs of `trainer.model.ops.group_norm_grads`; imported only through its
`triton_kernels`, on first use (Triton optional; TRITON_INTERPRET=1 read when they are made)."""

import triton
import triton.language as tl


@triton.jit
def row_chunk_sums_kernel(dy_ptr, x_ptr, rstd_ptr, part_ptr, s, d, chunks, TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row r, chunk c; column block): part[r, c, cols] = the sum over the chunk's
    TOKENS tokens of dy (x rstd) in fp32, from one [TOKENS, BLOCK] tile of each (dy, x [b, s, d]
    and rstd [b, s] contiguous)."""
    pid = tl.program_id(0)
    row = pid // chunks
    toks = (pid % chunks) * TOKENS + tl.arange(0, TOKENS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = toks < s
    at = (row.to(tl.int64) * s + toks)[:, None] * d + cols[None, :]
    mask = inside[:, None] & (cols < d)[None, :]
    g = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(rstd_ptr + row.to(tl.int64) * s + toks, mask=inside, other=0.0)
    tl.store(part_ptr + pid.to(tl.int64) * d + cols, tl.sum(g * (v * r[:, None]), axis=0), mask=cols < d)


@triton.jit
def group_sums_kernel(part_ptr, rows_ptr, out_ptr, b, chunks, d, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (group g; column block): out[g, cols] = the sum of the partials of g's rows, row
    by row, CHUNKS chunks a tile (fp32, rounded once to out's dtype)."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < d
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(b):
        mine = tl.where(tl.load(rows_ptr + i) == g, chunks, 0)  # the row's chunks if it is g's, else none
        for c0 in range(0, chunks, CHUNKS):
            c = c0 + tl.arange(0, CHUNKS)
            at = (i * chunks + c).to(tl.int64)[:, None] * d + cols[None, :]
            tile = tl.load(part_ptr + at, mask=(c < mine)[:, None] & live[None, :], other=0.0)
            acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + g.to(tl.int64) * d + cols, acc.to(out_ptr.dtype.element_ty), mask=live)
