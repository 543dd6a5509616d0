"""One Triton kernel over a list of tensors (the gradients autograd left, one per parameter):
each program covers one block of one tensor, found through a device table of the tensors'
addresses. What torch's `_foreach` kernels do for their own ops (multi-tensor apply), for
ours: the AdamW update (`trainer.optim.adamw_update`) and the gradient's sums of squares
(`sums_of_squares`, for `trainer.optim.clip`).

A kernel runs as two launches (`launch`): the blocks that lie wholly inside their tensor, whose
loads and stores the compiler can vectorise (it is told that block starts, buffer offsets and
the tensors' addresses are aligned), and each tensor's partial last block, masked. In one
launch with a runtime mask every element was its own 2- or 4-byte access: the AdamW update ran
6% below inductor's kernel for the same bytes (experiments/notes/PERFORMANCE.md).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.model.ops.dispatch import triton_kernels_of

#: Bytes to which every tensor's address must be aligned (the kernels assume it; the caching
#: allocator gives 512).
ADDRESS_ALIGN = 16

#: Elements per program of `sums_of_squares`.
SQUARES_BLOCK = 8192


def triton_runs_on(device: torch.device) -> bool:
    """Triton kernels run on CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1,
    the tests' mode)."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


@dataclass(frozen=True)
class Programs:
    """Which tensor, and which of its elements first, each program of one launch covers."""

    tensor: torch.Tensor  # int32 [programs]
    start: torch.Tensor  # int64 [programs]

    def __len__(self) -> int:
        return self.tensor.numel()


@dataclass(frozen=True)
class TensorBlocks:
    """Tensors cut into blocks of `block` elements: where each lies in flat buffers (if any), and
    the programs of the two launches (whole blocks, then partial last blocks). Built once per
    set of shapes."""

    block: int
    align: int  # a power of two (<= 64) that divides every offset
    offsets: torch.Tensor  # int64 [tensors]: first element in the flat buffers
    numels: torch.Tensor  # int64 [tensors]
    first_block: torch.Tensor  # int64 [tensors + 1]: tensor t's blocks are [first[t], first[t + 1])
    whole: Programs
    tails: Programs

    @classmethod
    def build(cls, offsets: Sequence[int], numels: Sequence[int], device: torch.device, block: int) -> TensorBlocks:
        whole: tuple[list[int], list[int]] = ([], [])
        tails: tuple[list[int], list[int]] = ([], [])
        first = [0]
        for i, n in enumerate(numels):
            for s in range(0, n, block):
                part = whole if s + block <= n else tails
                part[0].append(i)
                part[1].append(s)
            first.append(first[-1] + -(-n // block))
        align = math.gcd(64, *offsets)
        i64 = dict(dtype=torch.int64, device=device)

        def programs(part: tuple[list[int], list[int]]) -> Programs:
            return Programs(torch.tensor(part[0], dtype=torch.int32, device=device), torch.tensor(part[1], **i64))

        return cls(
            block,
            align,
            torch.tensor(list(offsets), **i64),
            torch.tensor(list(numels), **i64),
            torch.tensor(first, **i64),
            programs(whole),
            programs(tails),
        )

    @property
    def n_blocks(self) -> int:
        return len(self.whole) + len(self.tails)


def aligned(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor's address is ADDRESS_ALIGN-aligned, as the kernels assume."""
    return all(t.data_ptr() % ADDRESS_ALIGN == 0 for t in tensors)


def tensor_pointers(tensors: Sequence[torch.Tensor], device: torch.device, rows: int = 1) -> torch.Tensor:
    """int64 [rows * tensors] of the addresses of the tensors' rows, row-major (row r of tensor t
    at r * tensors + t; `rows` = 1: the tensors' addresses), on `device`: from pinned memory
    without blocking on CUDA (the caching host allocator keeps the pinned block until the copy
    has run). The rows' addresses are one broadcast add, not one Python object per row."""
    pin = device.type == "cuda"
    ptrs = [t.data_ptr() for t in tensors]
    if rows == 1:
        host = torch.tensor(ptrs, dtype=torch.int64, pin_memory=pin)
    else:
        row_bytes = torch.tensor([t.numel() // rows * t.element_size() for t in tensors], dtype=torch.int64)
        host = torch.empty(rows, len(ptrs), dtype=torch.int64, pin_memory=pin)
        starts = torch.arange(rows, dtype=torch.int64).view(-1, 1) * row_bytes
        torch.add(torch.tensor(ptrs, dtype=torch.int64), starts, out=host)
        host = host.view(-1)
    return host.to(device, non_blocking=True) if pin else host


def launch(kernel: Any, blocks: TensorBlocks, *args: Any, **meta: Any) -> None:
    """Run `kernel(block_tensor, block_start, *args, BLOCK_SIZE=, MASKED=, **meta)` over the
    whole blocks, then over the partial last blocks. Each kernel begins the same way
    (`multi_tensor_triton._block`): its tensor t = block_tensor[pid], start =
    multiple_of(block_start[pid], BLOCK_SIZE), elements idx = start + arange(BLOCK_SIZE), and
    mask = idx < numels[t] if MASKED else idx < start + BLOCK_SIZE (all true, and known to be
    constant over the block, so that it does not stop vectorisation)."""
    for programs, masked in ((blocks.whole, False), (blocks.tails, True)):
        if len(programs):
            kernel[(len(programs),)](
                programs.tensor, programs.start, *args, BLOCK_SIZE=blocks.block, MASKED=masked, **meta
            )


@functools.cache
def squares_kernels():
    """(per-block, per-tensor) Triton kernels of `sums_of_squares` (`trainer.optim.multi_tensor_triton`),
    or None without Triton."""
    return triton_kernels_of("trainer.optim.multi_tensor_triton", "block_squares_kernel", "tensor_sums_kernel")


_TRITON_DTYPES = ("bfloat16", "float16", "float32")


def uses_triton_squares(tensors: Sequence[torch.Tensor], rows: int = 1) -> bool:
    """Whether `sums_of_squares` runs its Triton kernels for these tensors (cut into `rows` equal
    rows): one device and one floating dtype, contiguous, each row's address aligned, where
    Triton runs."""
    if not tensors or not triton_runs_on(tensors[0].device) or squares_kernels() is None:
        return False
    first = tensors[0]
    return (
        str(first.dtype).removeprefix("torch.") in _TRITON_DTYPES
        and aligned(tensors)
        and all(t.device == first.device and t.dtype == first.dtype and t.is_contiguous() for t in tensors)
        and (
            rows == 1
            or all(t.numel() % rows == 0 and t.numel() // rows * t.element_size() % ADDRESS_ALIGN == 0 for t in tensors)
        )
    )


@functools.cache
def _squares_blocks(numels: tuple[int, ...], device: torch.device) -> TensorBlocks:
    return TensorBlocks.build([0] * len(numels), numels, device, SQUARES_BLOCK)


def sums_of_squares(tensors: Sequence[torch.Tensor], rows: int = 1) -> torch.Tensor:
    """Each tensor's sum of squares in fp32, [len(tensors)]: per-block partial sums, then per
    tensor over its blocks in order (deterministic: no atomics). With `rows` > 1, each tensor
    is cut into `rows` equal contiguous rows (a stacked gradient's per-model slices,
    `trainer.stacked.optim`) and the result is [rows * len(tensors)], row-major: each row's sum
    exactly the one this function gives for that row passed alone, from one launch whatever
    `rows` is. See `uses_triton_squares` for what the tensors must be."""
    import triton.language as tl

    device = tensors[0].device
    blocks = _squares_blocks(tuple(t.numel() // rows for t in tensors) * rows, device)
    partials = torch.empty(max(blocks.n_blocks, 1), dtype=torch.float32, device=device)
    out = torch.empty(rows * len(tensors), dtype=torch.float32, device=device)
    block_kernel, sums_kernel = squares_kernels()
    dtype = getattr(tl, str(tensors[0].dtype).removeprefix("torch."))
    launch(
        block_kernel,
        blocks,
        tensor_pointers(tensors, device, rows),
        blocks.numels,
        blocks.first_block,
        partials,
        DTYPE=dtype,
        num_warps=4,
    )
    sums_kernel[(rows * len(tensors),)](partials, blocks.first_block, out, CHUNK=1024)
    return out
