"""The forwards and backwards of one optimizer step, under any (tp, pp, dp) layout, and the
step's statistics over the global batch, identical on every rank.

`forward_backward` runs the micro-batch schedule (`trainer.parallel.pipeline_schedule`). The rest
of a step is `trainer.run.loop.Trainer.train_step`'s, in a fixed order: tp and tied gradient syncs ->
dp reduction (inside the optimizer, once per step) -> clipping over all groups -> update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from data.store.batch import IGNORE_INDEX
from trainer.feed.domains import domain_sums
from trainer.parallel.context import ParallelContext
from trainer.parallel.pipeline_schedule import LossWeighting, broadcast_from_last_stage, train_schedule


@dataclass
class StepStats:
    """Global-batch statistics, tensors on the device (no host sync until someone reads them)."""

    loss: torch.Tensor  # mean per-token loss over the global batch
    tokens: torch.Tensor  # non-masked tokens in the global batch
    domain_loss_sum: torch.Tensor  # [k]
    domain_tokens: torch.Tensor  # [k]
    grad_norm: torch.Tensor | None = None
    #: Detached per-token losses of this rank's micro-batches (last pipeline stage; [] elsewhere).
    local_losses: list[torch.Tensor] = field(default_factory=list)

    @property
    def domain_loss(self) -> torch.Tensor:
        return self.domain_loss_sum / self.domain_tokens.clamp_min(1)


def all_reduce_dp(t: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    if pc.dp > 1:
        dist.all_reduce(t, group=pc.dp_group)
    return t


def domain_token_counts(micro_batches: list[dict], k: int, pc: ParallelContext) -> torch.Tensor:
    """Non-masked tokens per domain over the global batch, known from labels before the step."""
    counts = torch.zeros(k, dtype=torch.float64, device=pc.device)
    for b in micro_batches:
        mask = b["labels"] != IGNORE_INDEX
        counts += domain_sums(mask, b["domain_ids"], mask, k)[1]
    return all_reduce_dp(counts, pc)


def global_stats(losses: list[torch.Tensor], micro_batches: list[dict], k: int, pc: ParallelContext) -> StepStats:
    """Per-domain loss sums and token counts over the global batch, on every rank.

    The per-token losses live on the last pipeline stage; they are summed there, reduced over
    dp, then broadcast to the other stages so the logged loss is right everywhere."""
    sums = torch.zeros(2, k, dtype=torch.float64, device=pc.device)
    if pc.is_last_stage:
        for loss, b in zip(losses, micro_batches):
            total, count = domain_sums(loss.detach().double(), b["domain_ids"], b["labels"] != IGNORE_INDEX, k)
            sums[0] += total
            sums[1] += count
        all_reduce_dp(sums, pc)
    sums = broadcast_from_last_stage(sums, pc)
    tokens = sums[1].sum()
    return StepStats(
        loss=sums[0].sum() / tokens.clamp_min(1),
        tokens=tokens,
        domain_loss_sum=sums[0],
        domain_tokens=sums[1],
        local_losses=losses,
    )


def forward_backward(
    stage: torch.nn.Module,
    micro_batches: list[dict],
    weighting: LossWeighting,
    pc: ParallelContext,
    schedule: str,
    k: int,
) -> StepStats:
    losses = train_schedule(stage, micro_batches, pc, schedule, weighting)
    return global_stats(losses, micro_batches, k, pc)
