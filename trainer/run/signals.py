"""The signals of `trainer.run.hooks.Needs`, computed over the global batch for a mixing method,
and the loss weighting that asks the method for this step's weights.

Per-token statistics are summed per domain on the last pipeline stage (where the losses are),
added over micro-batches in fp64, all-reduced over data parallel and broadcast to the other
stages: every rank hands the method the same numbers, whatever the layout.
"""

from __future__ import annotations

import torch

from data.store.batch import IGNORE_INDEX
from trainer.feed.domains import domain_sums
from trainer.feed.weighting import DomainWeights, MeanTokenLoss
from trainer.parallel.context import ParallelContext
from trainer.parallel.pipeline_schedule import LossWeighting, broadcast_from_last_stage
from trainer.run.hooks import MixingHook, StepSignals
from trainer.run.step import all_reduce_dp


def token_stat_sums(
    hook: MixingHook, losses: list[torch.Tensor], batches: list[dict], k: int, pc: ParallelContext
) -> torch.Tensor:
    """[m, k] fp64: per-domain sums of the hook's per-token statistics over the global batch
    (last pipeline stage; call it on every rank of the last stage: it all-reduces over dp)."""
    sums = torch.zeros(hook.needs.token_stats, k, dtype=torch.float64, device=pc.device)
    for loss, b in zip(losses, batches):
        mask = b["labels"] != IGNORE_INDEX
        for j, values in enumerate(hook.token_stats(loss.detach(), b)):
            sums[j] += domain_sums(values, b["domain_ids"], mask, k)[0].to(torch.float64)
    return all_reduce_dp(sums, pc)


def weighting_of(weights: torch.Tensor | None, domain_tokens: torch.Tensor) -> LossWeighting:
    return MeanTokenLoss(domain_tokens.sum()) if weights is None else DomainWeights(weights, domain_tokens)


class MethodWeighting:
    """This step's `LossWeighting`, from the method's `loss_weights`: asked before the step, or,
    when the method reads this step's statistics, in `prepare` after every forward."""

    def __init__(self, hook: MixingHook, step: int, signals: StepSignals, pc: ParallelContext, k: int):
        self.hook, self.step, self.signals, self.pc, self.k = hook, step, signals, pc, k
        self.needs_forward_losses = hook.needs.stats_before_backward
        self.inner: LossWeighting | None = None
        if not self.needs_forward_losses:
            self.inner = weighting_of(hook.loss_weights(step, None), signals.tokens)

    def prepare(self, losses: list[torch.Tensor], batches: list[dict]) -> None:
        self.signals.stats = token_stat_sums(self.hook, losses, batches, self.k, self.pc)
        self.inner = weighting_of(self.hook.loss_weights(self.step, self.signals), self.signals.tokens)

    def token_weights(self, index: int, batch: dict) -> torch.Tensor:
        assert self.inner is not None, "prepare was not called before the backward"
        return self.inner.token_weights(index, batch)

    def finish(self, losses: list[torch.Tensor], batches: list[dict]) -> None:
        """After the schedule, on every rank: the statistics on every stage, and the method's
        `loss_weights` for this step on the stages that did not call `prepare`."""
        hook, pc = self.hook, self.pc
        if not hook.needs.token_stats:
            return
        had = self.signals.stats is not None
        if pc.is_last_stage and not had:
            self.signals.stats = token_stat_sums(hook, losses, batches, self.k, pc)
        if self.signals.stats is None:
            self.signals.stats = torch.zeros(hook.needs.token_stats, self.k, dtype=torch.float64, device=pc.device)
        self.signals.stats = broadcast_from_last_stage(self.signals.stats, pc)
        if self.needs_forward_losses and not had:
            hook.loss_weights(self.step, self.signals)
