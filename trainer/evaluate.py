"""Per-domain validation loss through the same parallel layout as training."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from trainer.parallel.context import ParallelContext
from trainer.parallel.pipeline import broadcast_from_last_stage, forward_only
from trainer.weighting import IGNORE_INDEX


def evaluate_domains(stage: torch.nn.Module, batches_per_domain: list[list[dict]], pc: ParallelContext,
                     autocast: contextlib.AbstractContextManager | None = None) -> torch.Tensor:
    """Mean per-token validation loss of each domain [k] (fp64, NaN for a domain without
    validation tokens), identical on every rank.

    Batch j of a domain is evaluated by dp rank j % dp; sums are reduced over dp and broadcast
    from the last pipeline stage."""
    k = len(batches_per_domain)
    sums = torch.zeros(2, k, dtype=torch.float64, device=pc.device)
    was_training = stage.training
    stage.eval()
    for d, batches in enumerate(batches_per_domain):
        mine = [b for j, b in enumerate(batches) if j % pc.dp == pc.dp_rank]
        if not mine:
            continue
        with autocast or contextlib.nullcontext():
            losses = forward_only(stage, mine, pc)
        if pc.is_last_stage:
            for loss, b in zip(losses, mine):
                mask = b["labels"] != IGNORE_INDEX
                sums[0, d] += (loss.float() * mask).sum().to(torch.float64)
                sums[1, d] += mask.sum().to(torch.float64)
    stage.train(was_training)
    if pc.is_last_stage and pc.dp > 1:
        dist.all_reduce(sums, group=pc.dp_group)
    sums = broadcast_from_last_stage(sums, pc)
    return torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(1), torch.nan)
