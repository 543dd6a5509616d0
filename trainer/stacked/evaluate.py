"""Per-domain validation loss of every stacked model on the same validation batches.

The batches are `trainer.feed.data_feed.DataFeed.validation`'s (the same sequences whatever the run), each
shown to all M models at once (an expanded view, no copy), and the sums are those of
`trainer.run.evaluate.evaluate_domains`: per sequence the fp32 sum of its token losses, added in
fp64; the loss of domain d is its sum over its non-masked token count.
"""

from __future__ import annotations

import contextlib

import torch

from data.store.batch import IGNORE_INDEX
from trainer.stacked.model import StackedLlama


@torch.no_grad()
def evaluate_stacked(
    model: StackedLlama,
    batches_per_domain: list[list[dict]],
    autocast: contextlib.AbstractContextManager | None = None,
) -> torch.Tensor:
    """[M, k] fp64: the mean per-token validation loss of each model on each domain (NaN for a
    domain without validation tokens)."""
    m, k = model.models, len(batches_per_domain)
    device = model.rope_cos.device
    sums = torch.zeros(2, m, k, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    for d, batches in enumerate(batches_per_domain):
        for b in batches:
            ids, labels = b["input_ids"], b["labels"]
            stacked = {"input_ids": ids.expand(m, *ids.shape), "labels": labels.expand(m, *labels.shape)}
            with autocast or contextlib.nullcontext():
                losses = model(stacked)
            mask = labels != IGNORE_INDEX
            sums[0, :, d] += (losses.float() * mask).sum(-1).to(torch.float64).sum(-1)
            sums[1, :, d] += mask.sum().to(torch.float64)
    model.train(was_training)
    return torch.where(sums[1] > 0, sums[0] / sums[1].clamp_min(1), torch.nan)
