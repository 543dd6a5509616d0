"""One Triton launch over a list of tensors (the gradients autograd left, one per parameter):
each program covers one block of one tensor, found through a device table of the tensors'
addresses. What torch's `_foreach` kernels do for their own ops (multi-tensor apply), for
ours: the AdamW update (`trainer.adamw_update`). (Sums of squares for the gradient norm in
the same way measured no faster than `_foreach_norm`: experiments/PERFORMANCE.md, run 10.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch


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

    @classmethod
    def build(cls, offsets: Sequence[int], numels: Sequence[int], device: torch.device,
              block: int) -> "TensorBlocks":
        tensor, start = [], []
        for i, n in enumerate(numels):
            for s in range(0, n, block):
                tensor.append(i)
                start.append(s)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.tensor(list(offsets), **i64), torch.tensor(list(numels), **i64),
                   torch.tensor(tensor, dtype=torch.int32, device=device), torch.tensor(start, **i64))


def tensor_pointers(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 [tensors] of the tensors' addresses, on `device`: from pinned memory without blocking
    on CUDA (the caching host allocator keeps the pinned block until the copy has run)."""
    ptrs = [t.data_ptr() for t in tensors]
    if device.type != "cuda":
        return torch.tensor(ptrs, dtype=torch.int64)
    return torch.tensor(ptrs, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
