"""Packed sequences -> the trainer's batch: input_ids, labels (-100 = no target), domain_ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.store.dataset import PAD, PackedDomains

IGNORE_INDEX = -100


def collate(dataset: PackedDomains, items: list[tuple[int, int]], device: Any = None) -> dict[str, torch.Tensor]:
    """`items`: (domain index, sequence index) pairs, one row each. The batch also carries
    `sequence_ids` [b] (on `device`) and `items` [b, 2] kept on the host, for per-sequence
    look-ups (cached reference losses) without a device-to-host copy."""
    rows = (
        np.stack([dataset.sequence(d, i) for d, i in items]) if items else np.zeros((0, dataset.seq_len + 1), np.int64)
    )
    inputs, labels = rows[:, :-1].copy(), rows[:, 1:].copy()
    inputs[inputs == PAD] = dataset.eos_id
    labels[labels == PAD] = IGNORE_INDEX
    batch = {
        "input_ids": torch.from_numpy(inputs),
        "labels": torch.from_numpy(labels),
        "domain_ids": torch.tensor([d for d, _ in items], dtype=torch.int64),
        "sequence_ids": torch.tensor([i for _, i in items], dtype=torch.int64),
    }
    if device is not None:
        batch = to_device(batch, torch.device(device))
    batch["items"] = torch.tensor(items, dtype=torch.int64).reshape(-1, 2)
    return batch


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host tensors to `device`; through pinned memory and without a sync on CUDA."""
    pin = device.type == "cuda"
    return {k: (v.pin_memory() if pin else v).to(device, non_blocking=pin) for k, v in batch.items()}
