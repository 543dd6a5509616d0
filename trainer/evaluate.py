"""Per-domain validation loss through the same parallel layout as training."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from data.batch import IGNORE_INDEX
from trainer.parallel.context import ParallelContext
from trainer.parallel.expert import uses_expert_parallel
from trainer.parallel.pipeline_schedule import broadcast_from_last_stage, forward_only


def _domain_sums(
    stage: torch.nn.Module,
    batches_per_domain: list[list[dict]],
    pc: ParallelContext,
    autocast: contextlib.AbstractContextManager | None,
) -> torch.Tensor:
    """[5, k] fp64, identical on every rank: per domain the loss sum and token count, and over
    its sequences the sum and the sum of squares of each sequence's mean loss and their number
    (the spread that a standard error needs). Batch j of a domain is evaluated by dp rank j % dp; sums are
    reduced over dp and broadcast from the last pipeline stage."""
    k = len(batches_per_domain)
    sums = torch.zeros(5, k, dtype=torch.float64, device=pc.device)
    was_training = stage.training
    stage.eval()
    # Expert-parallel blocks exchange tokens with their dp peers: every dp rank runs as many
    # forwards, the ones beyond its share on a batch whose losses are dropped.
    lockstep = uses_expert_parallel(stage)
    for d, batches in enumerate(batches_per_domain):
        mine = [b for j, b in enumerate(batches) if j % pc.dp == pc.dp_rank]
        padding = -(-len(batches) // pc.dp) - len(mine) if lockstep and batches else 0
        if not mine and not padding:
            continue
        with autocast or contextlib.nullcontext():
            losses = forward_only(stage, mine + [batches[0]] * padding, pc)[: len(mine)]
        if pc.is_last_stage:
            for loss, b in zip(losses, mine):
                mask = b["labels"] != IGNORE_INDEX
                per_seq = (loss.float() * mask).sum(-1).to(torch.float64)
                count = mask.sum(-1).to(torch.float64)
                means = per_seq[count > 0] / count[count > 0]
                sums[0, d] += per_seq.sum()
                sums[1, d] += count.sum()
                sums[2, d] += means.sum()
                sums[3, d] += (means**2).sum()
                sums[4, d] += means.numel()
    stage.train(was_training)
    if pc.is_last_stage and pc.dp > 1:
        dist.all_reduce(sums, group=pc.dp_group)
    return broadcast_from_last_stage(sums, pc)


def evaluate_domains(
    stage: torch.nn.Module,
    batches_per_domain: list[list[dict]],
    pc: ParallelContext,
    autocast: contextlib.AbstractContextManager | None = None,
) -> torch.Tensor:
    """Mean per-token validation loss of each domain [k] (fp64, NaN for a domain without
    validation tokens), identical on every rank."""
    sums = _domain_sums(stage, batches_per_domain, pc, autocast)
    return torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(1), torch.nan)


def evaluate_domains_with_error(
    stage: torch.nn.Module,
    batches_per_domain: list[list[dict]],
    pc: ParallelContext,
    autocast: contextlib.AbstractContextManager | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean per-token loss [k], its standard error [k]): the sample standard deviation of the
    sequences' mean losses over sqrt(number of sequences); NaN with fewer than 2 sequences. A
    difference of two such means (memorisation: held-out minus seen) is only as exact as this."""
    sums = _domain_sums(stage, batches_per_domain, pc, autocast)
    mean = torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(1), torch.nan)
    n = sums[4]
    var = (sums[3] - sums[2] ** 2 / n.clamp_min(1)) / (n - 1).clamp_min(1)
    se = torch.where(n > 1, (var.clamp_min(0) / n.clamp_min(1)).sqrt(), torch.nan)
    return mean, se
