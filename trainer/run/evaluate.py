"""Per-domain validation loss through the same parallel layout as training."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from data.progress import Countdown
from data.store.batch import IGNORE_INDEX
from trainer.parallel.context import ParallelContext
from trainer.parallel.expert import uses_expert_parallel
from trainer.parallel.pipeline_schedule import broadcast_from_last_stage, forward_only


def _sequence_losses(
    stage: torch.nn.Module,
    batches_per_domain: list[list[dict]],
    pc: ParallelContext,
    autocast: contextlib.AbstractContextManager | None,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(domain, batch index, per-sequence loss sum [b] fp64, per-sequence label tokens [b] fp64)
    of the batches this rank evaluates, on the last pipeline stage only: batch j of a domain is
    evaluated by dp rank j % dp. Each sequence's sum is added in fp32 over its tokens. Rank 0
    reports the domains done on stderr (data/progress.py), throttled: a pass of many domains at
    scale is minutes."""
    was_training = stage.training
    stage.eval()
    # Expert-parallel blocks exchange tokens with their dp peers: every dp rank runs as many
    # forwards, the ones beyond its share on a batch whose losses are dropped.
    lockstep = uses_expert_parallel(stage)
    rows = max((int(b["labels"].shape[0]) for batches in batches_per_domain for b in batches), default=0)
    countdown = Countdown("eval: domain", len(batches_per_domain)) if pc.is_main else None
    try:
        for d, batches in enumerate(batches_per_domain):
            js = [j for j in range(len(batches)) if j % pc.dp == pc.dp_rank]
            mine = [batches[j] for j in js]
            padding = -(-len(batches) // pc.dp) - len(mine) if lockstep and batches else 0
            if mine or padding:
                with autocast or contextlib.nullcontext():
                    losses = forward_only(stage, [padded_rows(b, rows) for b in mine + [batches[0]] * padding], pc)
                if pc.is_last_stage:
                    for j, loss, b in zip(js, losses, mine):
                        mask = b["labels"] != IGNORE_INDEX
                        loss = loss[: mask.shape[0]]
                        yield d, j, (loss.float() * mask).sum(-1).to(torch.float64), mask.sum(-1).to(torch.float64)
            if countdown is not None:
                countdown.done(d + 1)
    finally:
        stage.train(was_training)


def padded_rows(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """`batch` grown to `rows` rows by repeating its first row with every label ignored, so that
    every evaluation forward has one shape: a compiled model then runs one graph instead of
    recompiling for each domain's last, partial batch (past torch's recompile limit it would
    fall back to eager). The caller drops the extra rows' losses; the real rows' are unchanged."""
    extra = rows - int(batch["labels"].shape[0])
    if extra <= 0:
        return batch
    out = {}
    for key, value in batch.items():
        fill = value[:1].expand(extra, *value.shape[1:])
        if key == "labels":
            fill = torch.full_like(fill, IGNORE_INDEX)
        out[key] = torch.cat([value, fill])
    return out


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
    for d, _, per_seq, count in _sequence_losses(stage, batches_per_domain, pc, autocast):
        means = per_seq[count > 0] / count[count > 0]
        sums[0, d] += per_seq.sum()
        sums[1, d] += count.sum()
        sums[2, d] += means.sum()
        sums[3, d] += (means**2).sum()
        sums[4, d] += means.numel()
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


def evaluate_sequences(
    stage: torch.nn.Module,
    batches_per_domain: list[list[dict]],
    pc: ParallelContext,
    autocast: contextlib.AbstractContextManager | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per domain, (loss sum [n] fp64, label tokens [n] int64) of each of its n sequences in
    batch order, identical on every rank whatever the layout: each sequence's sum is computed on
    one rank and the others add zeros (exact), so that standard errors can be clustered by
    document (docs/design.md 3b)."""
    sizes = [[int(b["labels"].shape[0]) for b in batches] for batches in batches_per_domain]
    starts = [np.concatenate([[0], np.cumsum(s, dtype=np.int64)]) for s in sizes]
    flat = torch.zeros(2, int(sum(s[-1] for s in starts)), dtype=torch.float64, device=pc.device)
    base = np.concatenate([[0], np.cumsum([s[-1] for s in starts])])
    for d, j, per_seq, count in _sequence_losses(stage, batches_per_domain, pc, autocast):
        at = int(base[d] + starts[d][j])
        flat[0, at : at + per_seq.numel()] = per_seq
        flat[1, at : at + per_seq.numel()] = count
    if pc.is_last_stage and pc.dp > 1:
        dist.all_reduce(flat, group=pc.dp_group)
    flat = broadcast_from_last_stage(flat, pc).cpu().numpy()
    return [
        (flat[0, base[d] : base[d + 1]].copy(), flat[1, base[d] : base[d + 1]].astype(np.int64))
        for d in range(len(sizes))
    ]


def sequence_means(per_sequence: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Mean per-token loss of each domain [k] from `evaluate_sequences`' sums, each added exactly
    (math.fsum), so that the per-sequence file reproduces the logged loss to the last bit."""
    return np.array(
        [math.fsum(loss) / math.fsum(tokens) if tokens.sum() else math.nan for loss, tokens in per_sequence]
    )
