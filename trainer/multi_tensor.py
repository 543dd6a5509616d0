"""One Triton launch over a list of tensors (the gradients autograd left, one per parameter):
each program covers one block of one tensor, found through a device table of the tensors'
addresses. What torch's `_foreach` kernels do for their own ops (multi-tensor apply), for
ours: the AdamW update (`trainer.adamw_update`) and the gradient's sums of squares
(`sums_of_squares`, for `trainer.parallel.clip`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Sequence

import torch

#: Elements per program of `sums_of_squares`.
SQUARES_BLOCK = 8192


def triton_runs_on(device: torch.device) -> bool:
    """Triton kernels run on CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1,
    the tests' mode)."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


@dataclass(frozen=True)
class TensorBlocks:
    """Where each tensor lies in flat buffers (if any) and which (tensor, first element) each
    Triton program covers, `block` elements at a time: built once per set of shapes."""

    offsets: torch.Tensor  # int64 [tensors]: first element in the flat buffers
    numels: torch.Tensor  # int64 [tensors]
    block_tensor: torch.Tensor  # int32 [blocks]
    block_start: torch.Tensor  # int64 [blocks]: first element within its tensor
    first_block: torch.Tensor  # int64 [tensors + 1]: each tensor's blocks are [first[t], first[t + 1])

    @classmethod
    def build(cls, offsets: Sequence[int], numels: Sequence[int], device: torch.device,
              block: int) -> "TensorBlocks":
        tensor, start, first = [], [], [0]
        for i, n in enumerate(numels):
            for s in range(0, n, block):
                tensor.append(i)
                start.append(s)
            first.append(len(tensor))
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.tensor(list(offsets), **i64), torch.tensor(list(numels), **i64),
                   torch.tensor(tensor, dtype=torch.int32, device=device), torch.tensor(start, **i64),
                   torch.tensor(first, **i64))



def tensor_pointers(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 [tensors] of the tensors' addresses, on `device`: from pinned memory without blocking
    on CUDA (the caching host allocator keeps the pinned block until the copy has run)."""
    ptrs = [t.data_ptr() for t in tensors]
    if device.type != "cuda":
        return torch.tensor(ptrs, dtype=torch.int64)
    return torch.tensor(ptrs, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


@functools.cache
def _squares_blocks(numels: tuple[int, ...], device: torch.device) -> TensorBlocks:
    return TensorBlocks.build([0] * len(numels), numels, device, SQUARES_BLOCK)


@functools.cache
def squares_kernels():
    """(per-block, per-tensor) Triton kernels of `sums_of_squares`, or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def block_squares_kernel(ptrs, block_tensor, block_start, numels, partials, DTYPE: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        idx = tl.load(block_start + pid) + tl.arange(0, BLOCK_SIZE)
        x = tl.load(tl.load(ptrs + t).to(tl.pointer_type(DTYPE)) + idx, mask=idx < tl.load(numels + t), other=0.0)
        x = x.to(tl.float32)
        tl.store(partials + pid, tl.sum(x * x, axis=0))

    @triton.jit
    def tensor_sums_kernel(partials, first_block, out, CHUNK: tl.constexpr):
        t = tl.program_id(0)
        lo = tl.load(first_block + t)
        hi = tl.load(first_block + t + 1)
        acc = tl.zeros([CHUNK], tl.float32)
        for at in range(lo, hi, CHUNK):
            i = at + tl.arange(0, CHUNK)
            acc += tl.load(partials + i, mask=i < hi, other=0.0)
        tl.store(out + t, tl.sum(acc, axis=0))

    return block_squares_kernel, tensor_sums_kernel


def uses_triton_squares(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `sums_of_squares` runs its Triton kernels for these tensors: one device, one
    dtype, contiguous, where Triton runs."""
    if not tensors or squares_kernels() is None or not triton_runs_on(tensors[0].device):
        return False
    first = tensors[0]
    return all(t.device == first.device and t.dtype == first.dtype and t.is_contiguous() for t in tensors)


def sums_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor's sum of squares in fp32, [len(tensors)], in two launches: per-block partial
    sums, then per tensor over its blocks in order (deterministic: no atomics). See
    `uses_triton_squares` for what the tensors must be."""
    import triton.language as tl

    device = tensors[0].device
    blocks = _squares_blocks(tuple(t.numel() for t in tensors), device)
    n_blocks = blocks.block_tensor.numel()
    partials = torch.empty(max(n_blocks, 1), dtype=torch.float32, device=device)
    out = torch.empty(len(tensors), dtype=torch.float32, device=device)
    block_kernel, sums_kernel = squares_kernels()
    dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[tensors[0].dtype]
    if n_blocks:
        block_kernel[(n_blocks,)](tensor_pointers(tensors, device), blocks.block_tensor, blocks.block_start,
                                  blocks.numels, partials, DTYPE=dtype, BLOCK_SIZE=SQUARES_BLOCK, num_warps=8)
    sums_kernel[(len(tensors),)](partials, blocks.first_block, out, CHUNK=1024)
    return out
