"""Per-domain validation batches: every sequence of the domain in order, no shuffling."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from data.store.batch import collate
from data.store.dataset import PackedDomains


def validation_items(
    num_sequences: int, domain_index: int, batch_size: int, max_batches: int | None = None
) -> Iterator[list[tuple[int, int]]]:
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    for b, start in enumerate(range(0, num_sequences, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        yield [(domain_index, i) for i in range(start, min(start + batch_size, num_sequences))]


def validation_batches(
    dataset_val: PackedDomains, domain_index: int, batch_size: int, max_batches: int | None = None, device: Any = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of `batch_size` sequences (the last may be smaller), at most `max_batches`."""
    for items in validation_items(dataset_val.num_sequences(domain_index), domain_index, batch_size, max_batches):
        yield collate(dataset_val, items, device)
