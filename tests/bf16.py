"""The bf16 parameter that `trainer.optim.adamw_update.split_fp32` makes of an fp32 master, computed
another way: round to nearest, ties away from zero (torch's `.bfloat16()` breaks ties to even)."""

from __future__ import annotations

import torch


def rounded_half_away(master: torch.Tensor) -> torch.Tensor:
    tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
    return torch.where(tie, torch.nextafter(master, 2 * master), master).bfloat16()
