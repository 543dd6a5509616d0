"""Packed sequences -> the trainer's batch: input_ids, labels (-100 = no target), domain_ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.dataset import PAD, PackedDomains

IGNORE_INDEX = -100


def collate(dataset: PackedDomains, items: list[tuple[int, int]], device: Any = None) -> dict[str, torch.Tensor]:
    """`items`: (domain index, sequence index) pairs, one row each."""
    rows = np.stack([dataset.sequence(d, i) for d, i in items]) if items else np.zeros((0, dataset.seq_len + 1), np.int64)
    inputs, labels = rows[:, :-1].copy(), rows[:, 1:].copy()
    inputs[inputs == PAD] = dataset.eos_id
    labels[labels == PAD] = IGNORE_INDEX
    batch = {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
             "domain_ids": torch.tensor([d for d, _ in items], dtype=torch.int64)}
    if device is not None:
        dev = torch.device(device)
        pin = dev.type == "cuda"
        batch = {k: (v.pin_memory() if pin else v).to(dev, non_blocking=pin) for k, v in batch.items()}
    return batch
