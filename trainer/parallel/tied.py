"""Tied embeddings (`model.tie_embeddings`): the LM head is the embedding matrix.

The one tied parameter is `embed.weight` (`TIED_WEIGHT`); with tying there is no `head.weight`
(`holds_head`, `head_weight`). The first pipeline stage needs the matrix for the embedding lookup
and the last for the head, so with pp > 1 each of them holds a copy (`holds_embedding`,
`trainer.parallel.context.tied_stages`). The copies stay equal because they start equal (`trainer.model.init` draws every
parameter from its name, so both copies draw the same tensor) and receive the same gradient:
`sync_tied_grads` sums the two stages' gradients over the group of the first and last stage of
each (dp, tp) position (`ParallelContext.tied_group`, built from `tied_stages`). The last
stage's copy is the duplicate (`is_tied_duplicate`): gradient clipping does not count it again
and checkpoints do not write it; loading fills it by name from the first stage's copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.parallel.context import ParallelContext
from trainer.parallel.main_grad import grad_of

TIED_WEIGHT = "embed.weight"


def holds_embedding(tie_embeddings: bool, is_first: bool, is_last: bool) -> bool:
    """Whether a stage holds `embed.weight`: the first for the lookup, the last as its head when tied."""
    return is_first or (is_last and tie_embeddings)


def holds_head(tie_embeddings: bool, is_last: bool) -> bool:
    """Whether a stage holds a `head.weight` of its own: the last, when the head is not tied."""
    return is_last and not tie_embeddings


def head_weight(stage: nn.Module) -> torch.Tensor:
    """The LM head's weight of the last stage: the embedding matrix when tied."""
    return stage.embed.weight if stage.tie_embeddings else stage.head.weight


def is_tied_duplicate(name: str, pc: ParallelContext) -> bool:
    """The last stage's copy of the tied embedding (pp > 1): a duplicate of the first stage's."""
    return name == TIED_WEIGHT and pc.pp > 1 and not pc.is_first_stage


def sync_tied_grads(stage: nn.Module, pc: ParallelContext) -> None:
    """With tied embeddings and pp > 1 both copies get the sum of the two gradients (`grad_of`),
    so that the first and last stages take the same update. A no-op otherwise."""
    if pc.pp == 1 or not getattr(stage, "tie_embeddings", False):
        return
    if not (pc.is_first_stage or pc.is_last_stage):
        return
    weight = stage.embed.weight
    if grad_of(weight) is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(grad_of(weight), group=pc.tied_group)
