"""Skinny products out[i, j] = sum_c X[i, c] Y[j, c] in fp32, for X [r, n] and Y [s, n] with a few
rows (r, s <= `MAX_ROWS`) and n up to tens of millions: the Gram matrix of the rows of DoGE's
per-parameter gradients G [k + 1, n] (`trainer.run.alignment.rows_gram`, Y = X) and their
products with the target gradient (`rows_dot`, s = 1).

Why a kernel of our own: the one-pass DoGE step took that Gram as one
`torch.mm(flat, flat.t(), out_dtype=torch.float32)` per parameter, and on one H100 (1B,
method_bench `doge-1p`) the profiler showed it running as `cutlass::Kernel2<cutlass_75_tensorop_
s1688gemm...>`: 99 calls, 71.5 ms per step, 722 us each, about 10x slower than reading G once at
the card's bandwidth (G is about 11 GB in bf16, ~3.3 ms per read at 3.35 TB/s). cuBLAS/CUTLASS
pick a poor kernel for an [r, n] x [n, r] GEMM with n in the tens of millions: with M = N = r there
is one output tile, all the parallelism must come from splitting a K that long, and their
heuristics do not pick a kernel that reads at the card's bandwidth. Here each program
reads one block of `block` columns of every row of X and Y once (upcast to fp32 in registers),
keeps the r x s products elementwise over a sub-block of columns and sums them at its end; its
r x s partial sums go to a buffer [programs, r, s] that one torch `.sum(0)` adds up. No atomics:
the result is bitwise the same on every call (the project's runs are bitwise repeatable), and
for Y = X bitwise symmetric (each pair's products are the same fp32 numbers in the same order).

Imported only through `trainer.model.ops.dispatch.triton_kernels_of`, on first use (Triton is
optional; TRITON_INTERPRET=1, the tests' CPU mode, is read when the kernel is built).
Untuned on a GPU: the tile (`tile`) is chosen for bandwidth on paper, and the next GPU profile
should say whether the padded r x s tile's FMAs, not the reads, bind.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: The most rows of X or of Y: the program's accumulator is [RP, SP, sub] fp32 (RP, SP the rows
#: rounded up to a power of two), held at 16384 values (`tile`); 16 rows take DoGE's Gram to 15
#: domains (the study's corpus has 12).
MAX_ROWS = 16

#: The input dtypes the kernel loads (each upcast to fp32 as loaded).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: Warps per program: 256 threads, 64 fp32 accumulator registers each at the largest tile.
NUM_WARPS = 8

#: Sub-blocks of columns per program (a program covers `SUBS_PER_PROGRAM * sub` columns).
SUBS_PER_PROGRAM = 16


@triton.jit
def skinny_products_kernel(
    x_ptr,
    y_ptr,
    part_ptr,
    n,
    x_row_stride,
    y_row_stride,
    R: tl.constexpr,
    S: tl.constexpr,
    RP: tl.constexpr,
    SP: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    rx = tl.arange(0, RP)
    ry = tl.arange(0, SP)
    sub = tl.arange(0, SUB)
    x_rows = x_ptr + rx.to(tl.int64)[:, None] * x_row_stride
    y_rows = y_ptr + ry.to(tl.int64)[:, None] * y_row_stride
    acc = tl.zeros((RP, SP, SUB), dtype=tl.float32)
    for off in range(0, BLOCK, SUB):
        cols = start + off + sub
        inside = cols < n
        x = tl.load(x_rows + cols[None, :], mask=(rx[:, None] < R) & inside[None, :], other=0.0).to(tl.float32)
        y = tl.load(y_rows + cols[None, :], mask=(ry[:, None] < S) & inside[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * y[None, :, :]
    part = tl.sum(acc, axis=2)
    out = part_ptr + pid.to(tl.int64) * (R * S) + rx[:, None] * S + ry[None, :]
    tl.store(out, part, mask=(rx[:, None] < R) & (ry[None, :] < S))


@triton.jit
def weighted_rows_kernel(x_ptr, w_ptr, out_ptr, n, x_row_stride, R: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(R):
        w = tl.load(w_ptr + i)
        acc += w * tl.load(x_ptr + i * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


#: Columns per program of `weighted_rows` (4 warps, 16 values a thread a row).
WEIGHTED_BLOCK = 2048


def weighted_rows(w: torch.Tensor, x: torch.Tensor, *, block: int = WEIGHTED_BLOCK) -> torch.Tensor:
    """sum_i w[i] x[i] for x [r, n] (bf16, fp16 or fp32; rows of any stride, columns contiguous)
    and fp32 weights w [r], accumulated in fp32 and rounded once to x's dtype: DoGE's update
    sum_d w_d G[d] (`trainer.run.alignment.combine`). As `torch.mv(x.t(), w)` it ran as cuBLAS
    GEMV kernels (`aten::addmv_`), 10.1 ms a step at 1B (one H100, 99 parameters, k = 4), about
    3x one read of G[0..k-1] and one write of the update; this reads each row once and writes
    the result once."""
    if x.dim() != 2 or w.shape != (x.shape[0],) or not 1 <= x.shape[0] <= 64:
        raise ValueError(
            f"weighted_rows: expected x [r, n] with 1 <= r <= 64 and w [r], got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    if x.dtype not in DTYPES:
        raise TypeError(f"weighted_rows: dtypes must be among {DTYPES}, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    r, n = x.shape
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    w = w.to(device=x.device, dtype=torch.float32).contiguous()
    weighted_rows_kernel[(triton.cdiv(n, block),)](x, w, out, n, x.stride(0), R=r, BLOCK=block, num_warps=4)
    return out


def tile(r: int, s: int) -> tuple[int, int]:
    """(block, sub): columns per program and per step of its loop, for r x s rows. The
    accumulator [RP, SP, sub] is held at 16384 fp32 values (64 registers a thread at
    `NUM_WARPS` 8), sub at most 1024; a program covers `SUBS_PER_PROGRAM` steps."""
    rp, sp = triton.next_power_of_2(r), triton.next_power_of_2(s)
    sub = min(1024, 16384 // (rp * sp))
    return SUBS_PER_PROGRAM * sub, sub


def skinny_products(
    x: torch.Tensor, y: torch.Tensor, *, block: int | None = None, sub: int | None = None
) -> torch.Tensor:
    """x [r, n] @ y[s, n]^T as fp32 [r, s], accumulated in fp32 (inputs bf16, fp16 or fp32, each
    upcast as loaded), for 1 <= r, s <= `MAX_ROWS`; rows may have any stride, columns are made
    contiguous. `block` and `sub` (powers of two, sub dividing block) override `tile` (tests)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"skinny_products: expected x [r, n] and y [s, n], got {tuple(x.shape)} and {tuple(y.shape)}")
    r, s, n = x.shape[0], y.shape[0], x.shape[1]
    if not (1 <= r <= MAX_ROWS and 1 <= s <= MAX_ROWS):
        raise ValueError(f"skinny_products: rows must be 1 to {MAX_ROWS} (the kernel's register tile), got {r} and {s}")
    if x.dtype not in DTYPES or y.dtype not in DTYPES:
        raise TypeError(f"skinny_products: dtypes must be among {DTYPES}, got {x.dtype} and {y.dtype}")
    if x.device != y.device:
        raise ValueError(f"skinny_products: x on {x.device}, y on {y.device}")
    if n == 0:
        return torch.zeros(r, s, dtype=torch.float32, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if y.stride(1) != 1:
        y = y.contiguous()
    default_block, default_sub = tile(r, s)
    block, sub = block or default_block, sub or default_sub
    programs = triton.cdiv(n, block)
    partials = torch.empty(programs, r, s, dtype=torch.float32, device=x.device)
    skinny_products_kernel[(programs,)](
        x,
        y,
        partials,
        n,
        x.stride(0),
        y.stride(0),
        R=r,
        S=s,
        RP=triton.next_power_of_2(r),
        SP=triton.next_power_of_2(s),
        BLOCK=block,
        SUB=sub,
        num_warps=NUM_WARPS,
    )
    return partials.sum(0)
