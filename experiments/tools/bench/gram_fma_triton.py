"""A Gram candidate on the CUDA cores, for `doge_kernels_bench.py`'s `gram` part only: each
program loads its columns of the r rows once as a [RP, BLOCK] tile (RP = r to the power of two,
rows >= r masked) and, in the same step, for each shift t = 0 .. r // 2 the tile's rows rolled by
t (the same addresses again: an L1 hit, not a second read from memory), and accumulates tile x
rolled elementwise in fp32: the shift-t products <x_i, x_(i+t) mod r> of every row i, no shared memory,
no tensor cores and no layout conversion, at r // 2 + 1 FMAs a loaded element. Against the
product kernel's packed tensor-core tile (trainer/model/ops/skinny_products_triton.py), timed
side by side; not used by the trainer."""

import torch
import triton
import triton.language as tl


@triton.jit
def shifted_products_kernel(
    x_ptr,
    part_ptr,
    n,
    block,
    row_stride,
    R: tl.constexpr,
    RP: tl.constexpr,
    SHIFTS: tl.constexpr,
    SP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * block
    end = tl.minimum(start + block, n)
    rows = tl.arange(0, RP)
    shifts = tl.arange(0, SP)
    cols = tl.arange(0, BLOCK)
    live = rows < R
    other = (rows[None, :] + shifts[:, None]) % R  # [SP, RP]: row i's partner at shift t
    both = (shifts[:, None] < SHIFTS) & live[None, :]
    acc = tl.zeros((SP, RP, BLOCK), dtype=tl.float32)
    for off in range(0, block, BLOCK):
        at = start + off + cols
        inside = at < end
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * row_stride + at[None, :],
            mask=live[:, None] & inside[None, :],
            other=0.0,
        )
        y = tl.load(
            x_ptr + other.to(tl.int64)[:, :, None] * row_stride + at[None, None, :],
            mask=both[:, :, None] & inside[None, None, :],
            other=0.0,
        )
        acc += x.to(tl.float32)[None, :, :] * y.to(tl.float32)
    out = part_ptr + (pid.to(tl.int64) * SP + shifts[:, None]) * RP + rows[None, :]
    tl.store(out, tl.sum(acc, axis=2), mask=both)


def shifted_gram(xs: list[torch.Tensor], block_cols: int = 1024, programs: int = 1024, warps: int = 4) -> torch.Tensor:
    """sum_t x_t x_t^T as fp64 [r, r] by `shifted_products_kernel`, one launch a tensor."""
    r = xs[0].shape[0]
    rp = triton.next_power_of_2(r)
    shifts = r // 2 + 1
    sp = triton.next_power_of_2(shifts)
    out = torch.zeros(r, r, dtype=torch.float64, device=xs[0].device)
    for x in xs:
        n = x.shape[1]
        if n == 0:
            continue
        block = block_cols * max(1, triton.cdiv(triton.cdiv(n, block_cols), programs))
        grid = triton.cdiv(n, block)
        part = torch.zeros(grid, sp, rp, dtype=torch.float32, device=x.device)
        shifted_products_kernel[(grid,)](
            x, part, n, block, x.stride(0), R=r, RP=rp, SHIFTS=shifts, SP=sp, BLOCK=block_cols, num_warps=warps
        )
        sums = part.sum(0, dtype=torch.float64)  # [shifts, rp]
        for t in range(shifts):
            i = torch.arange(r, device=x.device)
            j = (i + t) % r
            out[i, j] += sums[t, :r]
            if t and 2 * t != r:  # the mirrored entry, unless the shift is its own mirror
                out[j, i] += sums[t, :r]
    return out
