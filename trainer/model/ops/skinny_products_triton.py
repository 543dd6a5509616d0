"""Skinny products out[i, j] = sum_c X[i, c] Y[j, c] in fp32, for X [r, n] and Y [s, n] with a few
rows (r, s <= `MAX_ROWS`) and n up to tens of millions: the Gram matrix of the rows of DoGE's
per-parameter gradients G [k + 1, n] (`trainer.run.alignment.rows_gram`, Y = X; summed over all
parameters with one buffer, `summed_gram`, for `group_gram`) and their products with the target
gradient (`rows_dot`, s = 1).

Why a kernel of our own: the one-pass DoGE step took that Gram as one
`torch.mm(flat, flat.t(), out_dtype=torch.float32)` per parameter, and on one H100 (1B,
method_bench `doge-1p`) the profiler showed it running as `cutlass::Kernel2<cutlass_75_tensorop_
s1688gemm...>`: 99 calls, 71.5 ms per step, 722 us each, about 10x slower than reading G once at
the card's bandwidth (G is about 11 GB in bf16, ~3.3 ms per read at 3.35 TB/s). cuBLAS/CUTLASS
pick a poor kernel for an [r, n] x [n, r] GEMM with n in the tens of millions: with M = N = r there
is one output tile, all the parallelism must come from splitting a K that long, and their
heuristics do not pick a kernel that reads at the card's bandwidth.

Why tensor cores: the first version of this kernel computed the r x s products elementwise on
the CUDA cores over a padded [RP, SP, sub] fp32 tile (8 x 8 x 256 for r = 5: 64 FMAs per column
for 10 bytes read) and loaded Y separately even when Y is X. At 1B on one H100
(`python experiments/tools/bench/method_bench.py --presets 1b --variants plain,doge-1p,doge-1p-rows
--profile doge-1p,doge-1p-rows`) it took 18.6 ms a step over 99 calls (188 us each) for about
11 GB of bf16 G: ~590 GB/s, a sixth of the card's 3.35 TB/s, bound by those FMAs, not the reads.
Each program walks its range of `block` columns in tiles of `chunks(r, s)` x `sub` columns: it
loads X's tile [16, sub] whose row c r + i holds row i at the step's c-th chunk of `sub` columns
(rows past the last chunk masked to 0, never read from memory) and, unless Y is X (`SAME`, then
the loaded tile serves as both), Y's likewise, and accumulates `tl.dot(x, y^T)` into a [16, 16]
fp32 accumulator on the tensor cores, the loop's loads pipelined; the dot's diagonal blocks
[c r + i, c s + j] are the wanted products, the rest is not stored. bf16 and fp16 inputs go to
the dot as they are (their products are exact in fp32, accumulated in fp32); fp32 inputs, and
mixed dtypes (cast to fp32 in registers), take the dot with `input_precision="ieee"` (fp32 FMAs:
never truncated to tf32's 10-bit mantissa).

Why packed chunks and tuned warps: with one chunk a tile (r of 16 rows live) the 16th session's
profile (1B, one H100, k + 1 = 5 rows; experiments/results/gpu_session16) had the Gram at
10.6 ms a step for about 11 GB, about 1.05 TB/s in every launch whatever its size, a third of
the card's. The reading of it (not yet timed apart: experiments/tools/bench/doge_kernels_bench.py
does): each step moves a [16, sub] tile through shared memory three times (stored, then read as
both operands), 9.6 bytes of shared-memory traffic per byte read from memory at r = 5, and at 4
warps the [16, 16] output (one row of m16n8k16 tiles) is split at most 2 ways, so the other
warps repeat it; the shared memory, not the memory bus, would bound it. Three chunks make 15 of
16 rows live (3.2 bytes per byte read), and the warps and pipeline stages are timed at the first
launch of each kind (`tuned_kernel`): the sums' order does not depend on them.

The partial sums of each program go to a buffer [programs, chunks, r, s] that one torch `.sum`
adds up (`summed_gram`: one buffer for all tensors, summed in fp64). No atomics: the result is
bitwise the same on every call (the project's runs are bitwise repeatable). A Gram (Y is X) is
returned bitwise symmetric by construction: its upper triangle mirrored
(`out.triu() + out.triu(1).t()`), since the tensor cores' dot does not promise out[i, j] and
out[j, i] the same order of additions.

Imported only through `trainer.model.ops.dispatch.triton_kernels_of`, on first use (Triton is
optional; TRITON_INTERPRET=1, the tests' CPU mode, is read when the kernel is built).
"""

from __future__ import annotations

import functools
import itertools
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

#: The most rows of X or of Y: the dot's tile has 16 rows (the tensor cores' smallest, tl.dot's
#: least M and N); 16 rows take DoGE's Gram to 15 domains (the study's corpus has 12).
MAX_ROWS = 16

#: The input dtypes the kernel loads.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: Columns of a chunk (the dot's K): a [16, 256] bf16 tile is 8 KB of shared memory a stage.
SUB = 256

#: Programs per launch at most: a program covers `tile(n)[0]` columns, a multiple of a loop step
#: chosen so that n's columns need at most this many programs. A constant, not the SM count: the
#: partial sums, so the result's bits, do not depend on the card.
MAX_PROGRAMS = 1024

#: Warps per program and stages of the loop's load pipeline where a launch names none and no tuning
#: runs (Triton's interpreter, the tests).
NUM_WARPS = 4
NUM_STAGES = 4

#: The (warps, stages) `tuned_kernel` times. The 16th session's profile (1B, one H100) had the
#: 4-warp, 4-stage launch at about 1 TB/s: a [16, 16] output is one m16n8k16 row of tiles, which
#: 4 warps split at most 2 ways, so the others would repeat it, each re-reading the tile.
CHOICES = tuple(itertools.product((1, 2, 4), (2, 3, 4)))


@triton.jit(do_not_specialize=["base", "n_key"])
def skinny_products_kernel(
    x_ptr,
    y_ptr,
    part_ptr,
    base,
    n,
    block,
    x_row_stride,
    y_row_stride,
    n_key,
    R: tl.constexpr,
    S: tl.constexpr,
    C: tl.constexpr,
    SAME: tl.constexpr,
    FP32: tl.constexpr,
    SUB: tl.constexpr,
):
    """Program `pid` adds up columns [pid block, (pid + 1) block) in steps of C x SUB: tile row
    c R + i holds X's row i at the step's c-th SUB columns (Y's likewise with S), so the [16, 16]
    dot's diagonal blocks [c R + i, c S + j] are the wanted products of chunk c, the rest unused.
    Writes part[base + pid, c, i, j]. `n_key` only keys the launch choices' tuning."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * block
    end = tl.minimum(start + block, n)
    rows = tl.arange(0, 16)
    sub = tl.arange(0, SUB)
    x_chunk = rows // R
    y_chunk = rows // S
    x_live = rows < C * R
    y_live = rows < C * S
    x_rows = x_ptr + (rows % R).to(tl.int64)[:, None] * x_row_stride + (x_chunk * SUB)[:, None]
    y_rows = y_ptr + (rows % S).to(tl.int64)[:, None] * y_row_stride + (y_chunk * SUB)[:, None]
    acc = tl.zeros((16, 16), dtype=tl.float32)
    for off in range(0, block, C * SUB):
        at = start + off + sub[None, :]
        x = tl.load(x_rows + at, mask=x_live[:, None] & (at + (x_chunk * SUB)[:, None] < end), other=0.0)
        if SAME:
            y = x
        else:
            y = tl.load(y_rows + at, mask=y_live[:, None] & (at + (y_chunk * SUB)[:, None] < end), other=0.0)
        if FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(y.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(y), acc)
    i = rows[:, None]
    j = rows[None, :]
    wanted = (i // R == j // S) & (i < C * R) & (j < C * S)
    out = part_ptr + (base + pid).to(tl.int64) * (C * R * S) + (i // R) * (R * S) + (i % R) * S + j % S
    tl.store(out, acc, mask=wanted)


@triton.jit
def weighted_rows_kernel(x_ptr, w_ptr, out_ptr, n, x_row_stride, R: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(R):
        w = tl.load(w_ptr + i).to(tl.float32)
        acc += w * tl.load(x_ptr + i * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


#: Columns per program of `weighted_rows` (4 warps, 16 values a thread a row).
WEIGHTED_BLOCK = 2048


def weighted_rows(w: torch.Tensor, x: torch.Tensor, *, block: int = WEIGHTED_BLOCK, warps: int = 4) -> torch.Tensor:
    """sum_i w[i] x[i] for x [r, n] (bf16, fp16 or fp32; rows of any stride, columns contiguous)
    and weights w [r] (any of those dtypes, upcast in the kernel: no conversion launched a call),
    accumulated in fp32 and rounded once to x's dtype: DoGE's update
    sum_d w_d G[d] (`trainer.run.alignment.combine`). As `torch.mv(x.t(), w)` it ran as cuBLAS
    GEMV kernels (`aten::addmv_`), 10.1 ms a step at 1B (one H100, 99 parameters, k = 4), about
    3x one read of G[0..k-1] and one write of the update; this reads each row once and writes
    the result once. `block` and `warps` override the launch's (experiments/tools/bench/doge_kernels_bench.py
    times the choices)."""
    if x.dim() != 2 or w.shape != (x.shape[0],) or not 1 <= x.shape[0] <= 64:
        raise ValueError(
            f"weighted_rows: expected x [r, n] with 1 <= r <= 64 and w [r], got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    if x.dtype not in DTYPES or w.dtype not in DTYPES:
        raise TypeError(f"weighted_rows: dtypes must be among {DTYPES}, got {x.dtype} and {w.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    r, n = x.shape
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    w = w.to(device=x.device).contiguous()
    weighted_rows_kernel[(triton.cdiv(n, block),)](x, w, out, n, x.stride(0), R=r, BLOCK=block, num_warps=warps)
    return out


def chunks(r: int, s: int) -> int:
    """Column chunks a [16, sub] tile packs: rows c r + i hold X's row i at the c-th chunk, so
    that at most 16 rows of the dot tile are zeros the tensor cores multiply (3 chunks for DoGE's
    r = 5: 15 of 16 rows live, against 5 of 16 when one chunk filled the tile)."""
    return 16 // max(r, s)


def tile(
    n: int, r: int = 1, s: int = 1, *, block: int | None = None, sub: int | None = None, programs: int | None = None
) -> tuple[int, int]:
    """(block, sub) for rows n columns long: columns per program and per chunk of a step of its
    loop (the dot's K, `SUB`), block the fewest multiple of a step (`chunks(r, s)` x sub columns)
    that covers n in at most `programs` (`MAX_PROGRAMS`) programs (one program for n within a
    step). `block` and `sub` override them (tests: small tiles keep the interpreter fast); sub a
    power of two >= 16 (tl.dot's least K), block a multiple of sub (a program's last step is
    masked at its block's end)."""
    sub = sub or SUB
    step = chunks(r, s) * sub
    if block is None:
        block = step * max(1, triton.cdiv(triton.cdiv(n, step), programs or MAX_PROGRAMS))
    if sub < 16 or sub & (sub - 1) or block % sub:
        raise ValueError(f"skinny_products: sub must be a power of two >= 16 dividing block, got {block}, {sub}")
    return block, sub


def _check(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"skinny_products: expected x [r, n] and y [s, n], got {tuple(x.shape)} and {tuple(y.shape)}")
    r, s = x.shape[0], y.shape[0]
    if not (1 <= r <= MAX_ROWS and 1 <= s <= MAX_ROWS):
        raise ValueError(f"skinny_products: rows must be 1 to {MAX_ROWS} (the kernel's dot tile), got {r} and {s}")
    if x.dtype not in DTYPES or y.dtype not in DTYPES:
        raise TypeError(f"skinny_products: dtypes must be among {DTYPES}, got {x.dtype} and {y.dtype}")
    if x.device != y.device:
        raise ValueError(f"skinny_products: x on {x.device}, y on {y.device}")


def _launch(
    x: torch.Tensor,
    y: torch.Tensor,
    same: bool,
    partials: torch.Tensor,
    base: int,
    block: int,
    sub: int,
    warps: int | None = None,
    stages: int | None = None,
) -> None:
    """The kernel's programs over x, y (columns contiguous) writing partials[base : base +
    cdiv(n, block)] ([programs, chunks, r, s]). Tensor cores take bf16 or fp16 as they are where
    x and y share the dtype; any fp32 or a mix of dtypes is cast to fp32 and taken exactly
    (ieee). `warps` and `stages` given (or Triton's interpreter): that launch; else the tuned one
    (`tuned_kernel`)."""
    n = x.shape[1]
    args = (x, y, partials, base, n, block, x.stride(0), y.stride(0), block.bit_length())
    meta = {
        "R": x.shape[0],
        "S": y.shape[0],
        "C": chunks(x.shape[0], y.shape[0]),
        "SAME": same,
        "FP32": x.dtype == torch.float32 or y.dtype != x.dtype,
        "SUB": sub,
    }
    grid = (triton.cdiv(n, block),)
    if warps is None and stages is None and not _interpreted() and not TUNING_FAILED:
        try:
            tuned_kernel()[grid](*args, **meta)
            return
        except Exception as e:  # noqa: BLE001 - the fixed launch serves; said once, kept for the reports
            TUNING_FAILED.append(f"{type(e).__name__}: {str(e)[:300]}")
            warnings.warn(
                f"skinny products: the tuned launch failed ({TUNING_FAILED[0]}); the fixed one serves", stacklevel=3
            )
    skinny_products_kernel[grid](*args, **meta, num_warps=warps or NUM_WARPS, num_stages=stages or NUM_STAGES)


#: Why the tuned launch failed in this process, if it did (then the fixed one serves from there on).
TUNING_FAILED: list[str] = []


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def tuned_kernel() -> Any:
    """`skinny_products_kernel` with its warps and pipeline stages chosen by timing `CHOICES` at
    the first launch of each kind (rows, dtypes, columns a program to the power of two: Triton's
    autotune, a few seconds once a process). Only the launch varies: each output's sum runs
    through the same chunks in the same order whatever the choice, so the bits do not depend on
    it (tests/test_gpu.py checks that every choice gives the same bits)."""
    configs = [triton.Config({}, num_warps=w, num_stages=st) for w, st in CHOICES]
    return triton.autotune(configs, key=["R", "S", "SAME", "FP32", "n_key"])(skinny_products_kernel)


def tuned_choices() -> dict[str, tuple[int, int]]:
    """The (warps, stages) the tuning chose, by its key (experiments' reports)."""
    if tuned_kernel.cache_info().currsize == 0:
        return {}
    return {str(key): (c.num_warps, c.num_stages) for key, c in tuned_kernel().cache.items()}


def _mirrored(out: torch.Tensor) -> torch.Tensor:
    """A Gram's upper triangle mirrored below its diagonal: bitwise symmetric."""
    return out.triu() + out.triu(1).t()


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """y is x, or a view of the same elements: the product is a Gram."""
    return y is x or (
        y.shape == x.shape
        and y.stride() == x.stride()
        and y.dtype == x.dtype
        and y.device == x.device
        and y.data_ptr() == x.data_ptr()
    )


def skinny_products(
    x: torch.Tensor, y: torch.Tensor, *, block: int | None = None, sub: int | None = None
) -> torch.Tensor:
    """x [r, n] @ y[s, n]^T as fp32 [r, s], accumulated in fp32 (inputs bf16, fp16 or fp32; fp32
    products exact, not tf32), for 1 <= r, s <= `MAX_ROWS`; rows may have any stride, columns
    are made contiguous. Where y is x (a Gram: x's tile is loaded once for both operands) the
    upper triangle is mirrored, so the result is bitwise symmetric. `block` and `sub` override
    `tile` (tests)."""
    _check(x, y)
    same = _same(x, y)
    r, s, n = x.shape[0], y.shape[0], x.shape[1]
    if n == 0:
        return torch.zeros(r, s, dtype=torch.float32, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = x if same else y if y.stride(1) == 1 else y.contiguous()
    block, sub = tile(n, r, s, block=block, sub=sub)
    partials = torch.empty(triton.cdiv(n, block), chunks(r, s), r, s, dtype=torch.float32, device=x.device)
    _launch(x, y, same, partials, 0, block, sub)
    out = partials.view(-1, r, s).sum(0)
    return _mirrored(out) if same else out


def summed_gram(
    xs: Sequence[torch.Tensor],
    *,
    block: int | None = None,
    sub: int | None = None,
    warps: int | None = None,
    stages: int | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """sum_t x_t @ x_t^T as fp64 [r, r] over tensors x_t [r, n_t] (the same r, 1 <= r <=
    `MAX_ROWS`; any n_t, dtypes among `DTYPES`, one device): DoGE's Gram of G's rows summed over
    the parameters (`trainer.run.alignment.group_gram`). One kernel launch a tensor, each writing
    its programs' fp32 partial sums into its own consecutive slice of ONE buffer [programs, r, r],
    then one `.sum(0)` in fp64 and the upper triangle mirrored: no torch op a tensor beyond the
    launch, no atomics, bitwise repeatable and symmetric. `block`, `sub` and `programs` override
    `tile`, `warps` and `stages` the launch (experiments/tools/bench/doge_kernels_bench.py times
    the choices; the partial sums, so the bits, depend on block and sub)."""
    if not xs:
        raise ValueError("summed_gram: no tensors")
    _check(xs[0], xs[0])
    r, device = xs[0].shape[0], xs[0].device
    todo = []
    for x in xs:
        _check(x, x)
        if x.shape[0] != r or x.device != device:
            raise ValueError(f"summed_gram: expected tensors [{r}, n] on {device}, got {tuple(x.shape)} on {x.device}")
        n = x.shape[1]
        if n:
            todo.append(
                (x if x.stride(1) == 1 else x.contiguous(), *tile(n, r, r, block=block, sub=sub, programs=programs))
            )
    total = sum(triton.cdiv(x.shape[1], b) for x, b, _ in todo)
    if total == 0:
        return torch.zeros(r, r, dtype=torch.float64, device=device)
    partials = torch.empty(total, chunks(r, r), r, r, dtype=torch.float32, device=device)
    base = 0
    for x, b, s in todo:
        _launch(x, x, True, partials, base, b, s, warps, stages)
        base += triton.cdiv(x.shape[1], b)
    return _mirrored(partials.view(-1, r, r).sum(0, dtype=torch.float64))
