"""Reused scratch memory for tensor-parallel all-gathers.

With sequence parallel, a column-parallel linear needs the all-gathered (full-sequence) input
for its matmul in forward and for its weight gradient in backward. Megatron-LM and the
nanotron activation-memory fix (docs/design.md section 9) gather into one recycled buffer instead of
allocating (and, worse, keeping alive until backward) a fresh tensor per layer. Here the buffer
is an explicit object, one per pipeline stage, handed to the layers that use it.

A buffer is keyed by a purpose name (e.g. "input", "grad"), dtype and device; it grows to the
largest request and is reused for every later request of that key. Callers must be done with a
view before the next request of the same key, which holds because layers run one at a time in
forward and in backward.
"""

from __future__ import annotations

import math

import torch


class GatherBuffer:
    def __init__(self) -> None:
        self._store: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.allocations = 0

    def get(
        self, key: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A tensor of `shape` viewing the buffer `key`; its contents are undefined."""
        n = math.prod(shape)
        k = (key, dtype, torch.device(device))
        buf = self._store.get(k)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._store[k] = buf
            self.allocations += 1
        return buf[:n].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._store.values())

    def clear(self) -> None:
        self._store.clear()
