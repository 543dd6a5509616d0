"""One training step with per-domain gradients weighted by their alignment with a target
gradient (DoGE, Fan, Pagliardini and Jaggi 2024, Algorithm 1), for a method that declares
`Needs.alignment` (trainer/run/hooks.py).

    g_T  = gradient of the mean loss on a target batch (validation sequences of the target mixture)
    g_i  = gradient of the mean loss over domain i's tokens in the global batch
    a_i  = <g_i, g_T>
    update direction  sum_i m_i g_i / sum_i m_i,   m_i = hook.alignment_weight(t, i, a_i, lr_t)

The method sees a_i and returns m_i one domain at a time, so one gradient of the whole model is
kept besides the step's own: the target gradient g_T (all-reduced over dp, so that every rank's
partial dot products add up to the full one) and the running sum of m_i g_i. Each domain's
gradient is computed into the model's gradient buffers by the ordinary micro-batch schedule
over that domain's sequences of this rank (regrouped by domain, in micro-batches of the run's
size), its tp and tied syncs applied, its inner product with g_T taken parameter by parameter in
fp32 (added over parameters in fp64) on the ranks that count each element once (`trainer.optim.clip.counts_here`, less the
dp owner: before the dp reduction every rank's gradient is a partial sum) and summed over the
world as one number: no gradient is flattened or copied to the host. A domain absent from the
batch has gradient 0, so a_i = 0. g_T and the running sum are kept in the gradients' dtype (fp32
main grads, or bf16 gradients of a bf16 model at one micro-batch: two gradient copies of that
size); only the dot products are always accumulated in fp32 (`fp32_dot`).

Deferred (`Alignment.deferred`, DoGE's released code, doremi/methods/doge/method.py): the weights need
every domain's gradient first (the scores are divided by the domains' mean gradient norm), so
each domain's gradient is kept: summed over dp (its norm is not a sum of partial norms), clipped
to `Alignment.domain_clip` like `torch.nn.utils.clip_grad_norm_` (as is g_T), its norm and its
inner product with g_T taken on dp rank 0 of the counting ranks. Then
`hook.alignment_weights(t, a, norms, lr_t)` gives w [k] and the update is sum_i w_i g_i, not
renormalised. Memory: k + 2 gradient copies; communication: k + 1 dp all-reduces of the model's
gradient (the optimizer's own dp sum then adds the zeros of dp ranks other than 0 to rank 0's sum).

One pass (`Alignment.one_pass`, docs/design.md section 4c-iii): instead of the target's pass and
one pass per domain, ONE forward and backward of the rank's sequences sorted by domain, its target
sequences after them as group k, leaves every domain's gradient and the target's, G [k + 1, *shape]
per parameter (`trainer.run.group_grads`); the products, norms, clip coefficients, weights and the
update are then the same quantities taken from G, the products and norms from one Gram matrix per
parameter (`_one_pass`, `group_gram`). Memory as deferred: k + 2 gradient copies.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from data.store.batch import IGNORE_INDEX, collate
from trainer.feed.data_feed import DataFeed
from trainer.feed.weighting import DomainWeights, MeanTokenLoss
from trainer.model.ops.dispatch import triton_kernels_of
from trainer.optim.interface import Optimizer
from trainer.parallel.context import ParallelContext
from trainer.parallel.main_grad import grad_of, reset_main_grads
from trainer.parallel.pipeline_schedule import train_schedule
from trainer.parallel.shard import get_shard_spec
from trainer.parallel.tensor import sync_sequence_parallel_grads
from trainer.parallel.tied import is_tied_duplicate, sync_tied_grads
from trainer.run.group_grads import GroupGrads, group_offsets
from trainer.run.hooks import Alignment, MixingHook, StepSignals
from trainer.run.step import StepStats, global_stats


def counts_before_dp_reduction(name: str, param: torch.Tensor, pc: ParallelContext) -> bool:
    """Whether this rank's (unreduced) gradient of `param` enters a whole-model sum: not the
    tied duplicate, and sharded over tp or on tp rank 0; every dp rank holds its own part."""
    if is_tied_duplicate(name, pc):
        return False
    return pc.tp == 1 or get_shard_spec(param) is not None or pc.tp_rank == 0


#: Elements per chunk of a low-precision dot product (a bounded fp32 temporary, 64 MiB).
_DOT_CHUNK = 1 << 24


def fp32_dot(g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """<g, t> as an fp64 scalar, accumulated in fp32 whatever the gradients' dtype: bf16
    gradients (a bf16 model without fp32 main grads, one micro-batch) would otherwise give a
    bf16 dot, 3 significant digits. fp32 inputs take one BLAS dot; others are upcast chunk by
    chunk, so no temporary the size of the parameter is made."""
    g, t = g.reshape(-1), t.reshape(-1)
    if g.dtype == torch.float32 and t.dtype == torch.float32:
        return torch.dot(g, t).to(torch.float64)
    out = torch.zeros((), dtype=torch.float64, device=g.device)
    for gc, tc in zip(g.split(_DOT_CHUNK), t.split(_DOT_CHUNK)):
        out += torch.dot(gc.float(), tc.float()).to(torch.float64)
    return out


def _grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for p in params:
        g = grad_of(p)
        out.append(torch.zeros_like(p, dtype=torch.float32) if g is None else g)
    return out


def _clear(params: Sequence[torch.Tensor]) -> None:
    reset_main_grads(params)
    for p in params:
        p.grad = None


def _synced_grads(model: torch.nn.Module, params: Sequence[torch.Tensor], pc: ParallelContext) -> list[torch.Tensor]:
    sync_sequence_parallel_grads(model, pc)
    sync_tied_grads(model, pc)
    return _grads(params)


def _reduced_clone(grads: list[torch.Tensor], pc: ParallelContext) -> list[torch.Tensor]:
    """A copy of this step's gradients summed over dp: the same whole-batch gradient on every
    dp rank."""
    out = [g.detach().clone() for g in grads]
    if pc.dp > 1:
        for g in out:
            dist.all_reduce(g, group=pc.dp_group)
    return out


def _full_dot(a: list[torch.Tensor], b: list[torch.Tensor], counted: list[bool], pc: ParallelContext) -> torch.Tensor:
    """<a, b> over the whole model (fp64 0-dim) of two dp-reduced gradients: each element
    counted once, by dp rank 0 of the ranks that count it before the reduction."""
    dot = torch.zeros((), dtype=torch.float64, device=pc.device)
    if pc.dp_rank == 0:
        for x, y, c in zip(a, b, counted):
            if c:
                dot += fp32_dot(x, y)
    if pc.world_size > 1:
        dist.all_reduce(dot)
    return dot


def _clip(grads: list[torch.Tensor], max_norm: float, counted: list[bool], pc: ParallelContext) -> torch.Tensor:
    """Scales a dp-reduced gradient in place by `torch.nn.utils.clip_grad_norm_`'s coefficient
    min(1, max_norm / (norm + 1e-6)) when max_norm > 0; returns its norm after the clip (fp64)."""
    norm = _full_dot(grads, grads, counted, pc).sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        norm = norm * coef
    return norm


def aligned_step(
    model: torch.nn.Module,
    named_params: Sequence[tuple[str, torch.Tensor]],
    micro_batches: list[dict],
    signals: StepSignals,
    step: int,
    hook: MixingHook,
    feed: DataFeed,
    pc: ParallelContext,
    optimizer: Optimizer | None = None,
) -> StepStats:
    """Leaves sum_i m_i g_i / sum_i m_i in the gradient buffers (tp and tied syncs done, dp
    reduction not), or hands it unwritten to `optimizer` (`Optimizer.combine_gradients`, the
    folded one pass where it takes it), and fills `signals.alignment`; returns the step's
    statistics."""
    spec = hook.needs.alignment
    assert spec is not None
    k = feed.k
    params = [p for _, p in named_params]
    counted = [counts_before_dp_reduction(n, p, pc) for n, p in named_params]
    size = max(b["input_ids"].shape[0] for b in micro_batches)
    schedule = "afab" if pc.pp > 1 else "1f1b"
    by_domain = _by_domain(micro_batches, k)
    if spec.one_pass and FOLD_TARGET:
        return _one_pass(model, named_params, counted, by_domain, None, signals, step, hook, feed, size, pc, optimizer)
    g_target = _target_gradient(model, params, counted, spec, feed, step, size, schedule, pc)
    if spec.one_pass:
        return _one_pass(model, named_params, counted, by_domain, g_target, signals, step, hook, feed, size, pc)
    total = [torch.zeros_like(g) for g in g_target]
    norm = torch.zeros((), dtype=torch.float64, device=pc.device)
    alignment = torch.zeros(k, dtype=torch.float64, device=pc.device)
    norms = torch.zeros(k, dtype=torch.float64, device=pc.device)
    kept: list[list[torch.Tensor]] = []
    losses: list[torch.Tensor] = []
    batches: list[dict] = []
    for d in range(k):
        group = [
            collate(feed.train, by_domain[d][j : j + size], device=pc.device) for j in range(0, len(by_domain[d]), size)
        ]
        if group:
            losses += _domain_losses(model, group, d, k, schedule, signals, pc)
            batches += group
        grads = _synced_grads(model, params, pc)
        if spec.deferred:
            kept.append(_reduced_clone(grads, pc))
            norms[d] = _clip(kept[-1], spec.domain_clip, counted, pc)
            alignment[d] = _full_dot(kept[-1], g_target, counted, pc)
        else:
            dot = _partial_dot(grads, g_target, counted, pc)
            alignment[d] = dot
            m = hook.alignment_weight(step, d, dot, signals.lr).to(torch.float64)
            norm += m
            for acc, g in zip(total, grads):
                acc.addcmul_(g, m.to(acc.dtype))
        _clear(params)
    if spec.deferred:
        _add_deferred(hook, step, alignment, norms, kept, total, norm, signals, pc)
    _write_grads(params, total, norm)
    signals.alignment = alignment
    return global_stats(losses, batches, k, pc)


def _target_gradient(
    model: torch.nn.Module,
    params: list[torch.Tensor],
    counted: list[bool],
    spec: Alignment,
    feed: DataFeed,
    step: int,
    size: int,
    schedule: str,
    pc: ParallelContext,
) -> list[torch.Tensor]:
    """g_T: the gradient of the mean token loss on the target batch, summed over dp (every rank
    holds the whole-batch gradient) and clipped to `spec.domain_clip`; the buffers are left clear."""
    target = feed.target_batches(step, np.asarray(spec.weights, dtype=np.float64), spec.sequences, size)
    target_tokens = torch.zeros((), dtype=torch.float64, device=pc.device)
    for b in target:
        target_tokens += (b["labels"] != IGNORE_INDEX).sum()
    if pc.dp > 1:
        dist.all_reduce(target_tokens, group=pc.dp_group)
    _clear(params)
    if target:
        train_schedule(model, target, pc, schedule, MeanTokenLoss(target_tokens), few_ok=True)
    g_target = _reduced_clone(_synced_grads(model, params, pc), pc)
    if spec.domain_clip > 0:
        _clip(g_target, spec.domain_clip, counted, pc)
    _clear(params)
    return g_target


def _by_domain(micro_batches: list[dict], k: int) -> list[list[tuple[int, int]]]:
    """This rank's (domain, index) items of the step, regrouped by domain in batch order."""
    items = torch.cat([b["items"] for b in micro_batches]).tolist()
    by_domain: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    for d, i in items:
        by_domain[d].append((d, i))
    return by_domain


def _domain_losses(
    model: torch.nn.Module,
    group: list[dict],
    d: int,
    k: int,
    schedule: str,
    signals: StepSignals,
    pc: ParallelContext,
) -> list[torch.Tensor]:
    """Runs domain `d`'s micro-batches with only that domain weighted, leaving g_d in the buffers."""
    one_hot = torch.eye(k, dtype=torch.float64, device=pc.device)[d]  # `one_hot[d] = 1.0` would copy a host value
    return train_schedule(model, group, pc, schedule, DomainWeights(one_hot, signals.tokens), few_ok=True)


def _partial_dot(
    grads: list[torch.Tensor], g_target: list[torch.Tensor], counted: list[bool], pc: ParallelContext
) -> torch.Tensor:
    """<g, g_T> of an unreduced gradient and the dp-reduced g_T: every counting rank adds its
    partial part, summed over the world."""
    dot = torch.zeros((), dtype=torch.float64, device=pc.device)
    for g, t, c in zip(grads, g_target, counted):
        if c:  # fp32 dot per parameter (no temporary the size of the gradient), fp64 across them
            dot += fp32_dot(g, t)
    if pc.world_size > 1:
        dist.all_reduce(dot)
    return dot


def _add_deferred(
    hook: MixingHook,
    step: int,
    alignment: torch.Tensor,
    norms: torch.Tensor,
    kept: list[list[torch.Tensor]],
    total: list[torch.Tensor],
    norm: torch.Tensor,
    signals: StepSignals,
    pc: ParallelContext,
) -> None:
    """The deferred update sum_i w_i g_i into `total` (on dp rank 0 only), not renormalised."""
    w = hook.alignment_weights(step, alignment, norms, signals.lr).to(torch.float64)
    for d, grads in enumerate(kept):
        for acc, g in zip(total, grads):
            acc.addcmul_(g, w[d].to(acc.dtype))
    kept.clear()
    if pc.dp > 1 and pc.dp_rank != 0:  # every dp rank holds the reduced sum: the optimizer's
        for acc in total:  # dp sum of (total, 0, ..., 0) gives it back exactly
            acc.zero_()
    norm.fill_(1.0)
    signals.grad_norms = norms


def _one_pass(
    model: torch.nn.Module,
    named_params: Sequence[tuple[str, torch.Tensor]],
    counted: list[bool],
    by_domain: list[list[tuple[int, int]]],
    g_target: list[torch.Tensor] | None,
    signals: StepSignals,
    step: int,
    hook: MixingHook,
    feed: DataFeed,
    size: int,
    pc: ParallelContext,
    optimizer: Optimizer | None = None,
) -> StepStats:
    """`Alignment.one_pass`: every domain's gradient G[d] from ONE forward and backward of this
    rank's sequences sorted by domain (`trainer.run.group_grads`), under the objective sum_d
    (mean loss over domain d's tokens); then the k-pass step's products, norms, clip
    coefficients and weights from G in a few kernels per parameter (`group_gram`, `combine`).

    `g_target` None (`FOLD_TARGET`, docs/design.md 4c-iii): the target's sequences join the pass
    as group k (`_folded_batches`), g_T = G[k] (no pass of its own, no copy), its clip c_T from the
    Gram matrix, <G[d], c_T g_T> = c_T <G[d], g_T>; given, the target pass's clipped gradient.
    Deferred: G is summed over dp, domain d clipped by the coefficient c_d of its norm, a_d =
    c_d <G[d], g_T>, the update sum_d w_d c_d G[d] written on dp rank 0 (zeros elsewhere), as
    `_add_deferred` does; otherwise (g_T alone summed over dp) sum_d m_d G[d] / sum_d m_d on every
    rank, m_d = `alignment_weight` of the partial products (`_one_pass_scale`).

    Folded, on one process, the update is offered to `optimizer` unwritten
    (`Optimizer.combine_gradients`: its kernel sums the k rows of each G with the weights, and
    the clip reads the update's norm from the Gram matrix, sqrt(w^T Gram w) over the domain
    rows, of the exact sum rather than its rounding); where it declines, written as above."""
    spec = hook.needs.alignment
    assert spec is not None
    k = feed.k
    params = [p for _, p in named_params]
    items = [it for group in by_domain for it in group]
    if g_target is None:
        batches, offsets, train_rows, weighting = _folded_batches(feed, spec, step, items, size, signals.tokens, pc)
    else:
        batches, offsets, train_rows, weighting = _grouped_batches(feed, items, size, signals.tokens, pc)
    _clear(params)
    losses: list[torch.Tensor] = []
    with GroupGrads(model, named_params, k + 1 if g_target is None else k) as gg:
        for b, o in zip(batches, offsets):
            gg.announce(b, o)
        if batches:
            losses = train_schedule(model, batches, pc, "1f1b", weighting, few_ok=True)
    grads = gg.grads()
    _clear(params)
    if g_target is None:  # the target's rows close each micro-batch: the step's statistics are the rest's
        batches = [{"domain_ids": b["domain_ids"][:r], "labels": b["labels"][:r]} for b, r in zip(batches, train_rows)]
        losses = [loss[:r] for loss, r in zip(losses, train_rows)]
    if pc.dp > 1 and (spec.deferred or g_target is None):
        for g in grads:
            dist.all_reduce(g if spec.deferred else g[k:], group=pc.dp_group)
    dots, squares, target_square, gram = _alignment_products(grads, g_target, counted, k, spec.deferred, pc)
    c_target = clip_coefficients(target_square.sqrt(), spec.domain_clip) if g_target is None else 1.0
    alignment, scale = _one_pass_scale(hook, step, dots * c_target, squares, signals, k)
    signals.alignment = alignment
    if optimizer is not None and gram is not None and pc.world_size == 1 and len({g.dtype for g in grads}) == 1:
        weights = scale.to(grads[0].dtype)  # the update's weights as `combine` rounds them
        w = weights.to(torch.float64)
        norm = (w @ gram[:k, :k] @ w).clamp_min(0.0).sqrt()
        if optimizer.combine_gradients({id(p): g[:k] for p, g in zip(params, grads)}, weights, norm):
            return global_stats(losses, batches, k, pc)
    zero = spec.deferred and pc.dp > 1 and pc.dp_rank != 0
    total, rounded = [], {}  # the weights in each gradient dtype, converted once, not once a parameter
    while grads:  # each G freed once combined: at most k + 2 gradient copies at a time
        g = grads.pop(0)[:k]
        if zero:
            total.append(torch.zeros(g.shape[1:], dtype=g.dtype, device=g.device))
            continue
        if g.dtype not in rounded:
            rounded[g.dtype] = scale.to(g.dtype)
        total.append(combine(rounded[g.dtype], g))
    _write_grads(params, total, None)
    return global_stats(losses, batches, k, pc)


def _grouped_batches(
    feed: DataFeed, items: list[tuple[int, int]], size: int, tokens: torch.Tensor, pc: ParallelContext
) -> tuple[list[dict], list[tuple[int, ...]], list[int], DomainWeights]:
    """The one-pass step's micro-batches of this rank's (domain, sequence) items, sorted by
    domain, without the target (its gradient given): each with its group offsets, all rows
    training rows, every domain weighted 1 (the per-domain means of `GroupGrads`)."""
    chunks = [items[j : j + size] for j in range(0, len(items), size)]
    batches = [collate(feed.train, c, device=pc.device) for c in chunks]
    offsets = [group_offsets([d for d, _ in c], feed.k) for c in chunks]
    weighting = DomainWeights(torch.ones(feed.k, dtype=torch.float64, device=pc.device), tokens)
    return batches, offsets, [len(c) for c in chunks], weighting


def _one_pass_scale(
    hook: MixingHook, step: int, dots: torch.Tensor, squares: torch.Tensor, signals: StepSignals, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(alignment, scale of each G[d] in the update) from the products with the clipped target
    (`dots`) and the squared norms: deferred, each domain clipped by its coefficient c_d and the
    method's weights of the clipped alignments times c_d (the norms go to `signals`); otherwise
    the per-domain `alignment_weight`s normalised to sum 1 (docstring of `_one_pass`)."""
    if hook.needs.alignment.deferred:
        raw = squares.sqrt()
        coef = clip_coefficients(raw, hook.needs.alignment.domain_clip)
        norms, alignment = raw * coef, dots * coef
        signals.grad_norms = norms
        return alignment, hook.alignment_weights(step, alignment, norms, signals.lr).to(torch.float64) * coef
    m = torch.stack([hook.alignment_weight(step, d, dots[d], signals.lr).to(torch.float64) for d in range(k)])
    return dots, m / m.sum()


#: The one-pass step folds the target batch into its pass as group k#: The one-pass step folds the target batch into its pass as group k (docs/design.md section
#: 4c-iii). False runs the target's own pass first, the form before the fold: the reference
#: tests/test_doge_one_pass.py compares the folded step with; no config key selects it.
FOLD_TARGET = True


class _FoldedWeights:
    """The folded pass's objective: weight 1 / n_d on domain d's tokens (`DomainWeights` with
    all weights 1: the sum of the domains' mean losses) and 1 / N_T on the target's, group k
    (`MeanTokenLoss(N_T)`'s coefficient): each group's gradient is that of its own pass."""

    needs_forward_losses = False

    def __init__(self, k: int, domain_tokens: torch.Tensor, target_tokens: torch.Tensor):
        domains = DomainWeights(torch.ones(k, dtype=torch.float64, device=domain_tokens.device), domain_tokens)
        target = MeanTokenLoss(target_tokens).scale.to(domains.per_domain.device).reshape(1)
        self.per_group = torch.cat([domains.per_domain, target])

    def prepare(self, losses: list[torch.Tensor], batches: list[dict]) -> None:
        pass

    def token_weights(self, index: int, batch: dict) -> torch.Tensor:
        mask = batch["labels"] != IGNORE_INDEX
        return mask.to(torch.float32) * self.per_group.to(mask.device)[batch["domain_ids"]][:, None]


def _folded_batches(
    feed: DataFeed,
    spec: Alignment,
    step: int,
    items: list[tuple[int, int]],
    size: int,
    domain_tokens: torch.Tensor,
    pc: ParallelContext,
) -> tuple[list[dict], list[tuple[int, ...]], list[int], _FoldedWeights]:
    """This rank's training rows sorted by domain followed by its share of the target's
    sequences (`feed.target_batches`, as `_target_gradient` draws them) as group k, cut into the
    step's own number of micro-batches (ceil(rows / size), at least one) as equal as they can be,
    so a target of T sequences adds about T / m rows to each and no pass of its own (at 1B, one
    micro-batch of B + 1 rows). Returns the micro-batches, their group offsets [k + 2], each
    one's count of training rows (they come first) and the objective."""
    k = feed.k
    target = feed.target_batches(
        step, np.asarray(spec.weights, dtype=np.float64), spec.sequences, max(1, spec.sequences)
    )
    target_tokens = torch.zeros((), dtype=torch.float64, device=pc.device)
    for b in target:
        target_tokens += (b["labels"] != IGNORE_INDEX).sum()
    if pc.dp > 1:
        dist.all_reduce(target_tokens, group=pc.dp_group)
    weighting = _FoldedWeights(k, domain_tokens, target_tokens)
    parts = [collate(feed.train, items, device=pc.device)] if items else []
    parts += [{**b, "domain_ids": torch.full_like(b["domain_ids"], k)} for b in target]
    groups = [d for d, _ in items] + [k] * sum(b["input_ids"].shape[0] for b in target)
    if not groups:
        return [], [], [], weighting
    whole = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    m = max(1, -(-len(items) // size))
    cuts = [len(groups) * j // m for j in range(m + 1)]
    spans = [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
    batches = [{key: v[lo:hi] for key, v in whole.items()} for lo, hi in spans]
    offsets = [group_offsets(groups[lo:hi], k + 1) for lo, hi in spans]
    train_rows = [max(0, min(hi, len(items)) - lo) for lo, hi in spans]
    return batches, offsets, train_rows, weighting


def _alignment_products(
    grads: list[torch.Tensor],
    g_target: list[torch.Tensor] | None,
    counted: list[bool],
    k: int,
    deferred: bool,
    pc: ParallelContext,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(<G[d], g_T> [k], ||G[d]||^2 [k] (deferred), ||g_T||^2 (folded), the Gram matrix
    [k + 1, k + 1] (folded, one process; else None)) over the whole model, fp64, summed over the
    world. Deferred, G is dp-reduced: dp rank 0 counts it. Otherwise
    every rank's partial products add up; g_T (G[k]) is dp-reduced, so its norm is dp rank
    0's. Folded: one Gram matrix of [G[0..k-1]; g_T] per parameter (`group_gram`)."""
    if g_target is None:
        gram = group_gram(grads, counted, here=pc.dp_rank == 0 or not deferred)
        if not deferred and pc.dp_rank != 0:
            gram[k, k] = 0.0
        out = torch.cat([gram[:k, k], gram.diagonal()[:k], gram[k, k:]])
    else:
        gram = None
        prods = group_products(grads, g_target, counted, norms=deferred, here=pc.dp_rank == 0 or not deferred)
        out = torch.cat([prods.reshape(-1), prods.new_zeros(1)])
    if pc.world_size > 1:
        dist.all_reduce(out)
        gram = None
    return out[:k], out[k : 2 * k], out[2 * k], gram


def clip_coefficients(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`'s coefficient min(1, max_norm / (norm + 1e-6)) of each
    norm (as `_clip`), or ones when max_norm <= 0."""
    if max_norm <= 0:
        return torch.ones_like(norms)
    return torch.clamp(max_norm / (norms + 1e-6), max=1.0)


def group_products(
    grads: list[torch.Tensor], g_target: list[torch.Tensor], counted: list[bool], norms: bool, here: bool
) -> torch.Tensor:
    """[2, k] fp64: <G[d], g_T> and (`norms`) ||G[d]||^2 over the parameters this rank counts
    (zeros where not `here`): per parameter one GEMV of G viewed [k, n] with g_T (`rows_dot`)
    and one norm over its rows, each accumulated in fp32 whatever the gradients' dtype, added
    over parameters in fp64."""
    k = grads[0].shape[0] if grads else 0
    device = grads[0].device if grads else None
    out = torch.zeros(2, k, dtype=torch.float64, device=device)
    if not here:
        return out
    for g, t, c in zip(grads, g_target, counted):
        if c:
            flat = g.reshape(k, -1)
            out[0] += rows_dot(flat, t.reshape(-1)).to(torch.float64)
            if norms:
                out[1] += torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32).square().to(torch.float64)
    return out


def group_gram(grads: list[torch.Tensor], counted: list[bool], here: bool) -> torch.Tensor:
    """[r, r] fp64: the Gram matrix of the rows of G (G_p [r, *p.shape], here [G[0..k-1]; g_T])
    over the parameters this rank counts (zeros where not `here`): every <G[d], g_T>, ||G[d]||^2
    and ||g_T||^2 from one read of G, not once for the products and once more for the norms as
    `group_products` does (the same numbers to fp32 rounding); accumulated in fp32 whatever the
    gradients' dtype, added over parameters in fp64. On CUDA with Triton (r <= 16) one call of
    `trainer.model.ops.skinny_products_triton.summed_gram`: the tensor-core skinny-product kernel
    launched once a parameter, all writing fp32 partial sums into one buffer that one fp64
    `.sum(0)` adds up (no torch ops a parameter: with ~99 parameters at 1B the host's launches
    would bind once the kernel reads at the card's bandwidth), bitwise repeatable and symmetric.
    Elsewhere (CPU, no Triton, more rows, or the kernel failed) one `rows_gram` a parameter added
    in fp64, as before the kernel."""
    r = grads[0].shape[0] if grads else 0
    out = torch.zeros(r, r, dtype=torch.float64, device=grads[0].device if grads else None)
    if not here:
        return out
    flats = [g.reshape(r, -1) for g, c in zip(grads, counted) if c]
    if not flats:
        return out
    kernel = _triton_kernel(2, r, *flats)
    summed = None if kernel is None else _run_kernel(kernel, flats)
    if summed is not None:
        return summed
    for flat in flats:
        out += rows_gram(flat).to(torch.float64)
    return out


@functools.cache
def _skinny_kernels() -> tuple | None:
    """`skinny_products`, `weighted_rows`, `summed_gram`, `MAX_ROWS` and `DTYPES` of
    `trainer.model.ops.skinny_products_triton`, or None without Triton; imported on first use
    (trainer.model.ops.dispatch)."""
    return triton_kernels_of(
        "trainer.model.ops.skinny_products_triton",
        "skinny_products",
        "weighted_rows",
        "summed_gram",
        "MAX_ROWS",
        "DTYPES",
    )


def _triton_kernel(op: int, rows: int, *tensors: torch.Tensor) -> Any:
    """Kernel `op` (0: `skinny_products`, 1: `weighted_rows`, 2: `summed_gram`) of
    `_skinny_kernels` where it applies to `tensors`: on CUDA, Triton importable, at most
    `MAX_ROWS` `rows`, dtypes it loads, and no kernel failed before in this process; else None
    (the torch paths)."""
    if tensors[0].device.type != "cuda" or _TRITON_PRODUCTS_FAILED:
        return None
    kernels = _skinny_kernels()
    if kernels is None:
        return None
    max_rows, dtypes = kernels[-2], kernels[-1]
    if rows > max_rows or any(t.dtype not in dtypes for t in tensors):
        return None
    return kernels[op]


def _run_kernel(kernel: Any, *args: Any) -> torch.Tensor | None:
    """`kernel(*args)`, or None once it fails: a kernel Triton cannot build on this machine is
    tried once, said in a warning, and the torch paths serve from then on."""
    try:
        return kernel(*args)
    except Exception as e:  # noqa: BLE001 - the torch paths, said once
        _TRITON_PRODUCTS_FAILED.append(f"{type(e).__name__}: {e}")
        warnings.warn(
            f"the skinny-product Triton kernel failed ({_TRITON_PRODUCTS_FAILED[0][:200]}); "
            "DoGE's products and updates use the torch GEMMs from now on",
            stacklevel=3,
        )
        return None


def _triton_products(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """x [r, n] @ y [s, n]^T in fp32 by the Triton kernel where it applies, else None."""
    kernel = _triton_kernel(0, max(x.shape[0], y.shape[0]), x, y)
    return None if kernel is None else _run_kernel(kernel, x, y)


#: Why a skinny-row kernel failed in this process (then none is tried again), if one did.
_TRITON_PRODUCTS_FAILED: list[str] = []


def rows_gram(flat: torch.Tensor) -> torch.Tensor:
    """flat [r, n] @ flat^T in fp32 [r, r]. On CUDA, with Triton and r <= 16, the skinny-product
    kernel (`trainer.model.ops.skinny_products_triton`: each program reads its columns of every
    row once, in [16, 256] tiles loaded once for both operands of a tensor-core dot with an fp32
    accumulator; fp32 partial sums added by one `.sum(0)`, bitwise repeatable, the upper triangle
    mirrored so bitwise symmetric): as one `torch.mm(..., out_dtype=torch.float32)` this Gram ran
    as a CUTLASS kernel at about a tenth of the H100's bandwidth, 71.5 ms of a 1B one-pass DoGE
    step (docs/design.md section 4c-iii), and the kernel's first, CUDA-core version at a sixth
    (18.6 ms). `group_gram` sums it over parameters with one buffer (`summed_gram`).
    Elsewhere (CPU, no Triton, more rows) as before: one GEMM (fp32 operands, or on CUDA
    low-precision ones with an fp32 output), else upcast in chunks of at most `_DOT_CHUNK`."""
    out = _triton_products(flat, flat)
    if out is not None:
        return out
    if flat.dtype == torch.float32:
        return torch.mm(flat, flat.t())
    kind = flat.device.type
    if kind == "cuda" and kind not in _NO_FP32_OUT:
        try:
            return torch.mm(flat, flat.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without the fp32-output GEMM
            _NO_FP32_OUT.add(kind)
    out = torch.zeros(flat.shape[0], flat.shape[0], dtype=torch.float32, device=flat.device)
    for gc in flat.split(max(1, _DOT_CHUNK // flat.shape[0]), dim=1):
        gc = gc.float()
        out += torch.mm(gc, gc.t())
    return out


#: Devices found not to run `torch.mm(..., out_dtype=torch.float32)` on bf16 / fp16 operands.
_NO_FP32_OUT: set[str] = set()


def rows_dot(flat: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """flat [k, n] @ vec [n] in fp32 [k]. On CUDA, with Triton and k <= 16, the skinny-product
    kernel as `rows_gram` (vec as one row; the fp32-output GEMM it replaces is the same skinny
    shape, likely as slow). Elsewhere as before: one GEMV for fp32 operands; for low-precision
    ones on CUDA one GEMM with an fp32 output (`out_dtype`: cuBLAS accumulates in fp32, and the
    result is not rounded to bf16, which would leave 3 significant digits), else upcast in
    chunks of at most `_DOT_CHUNK` elements (no fp32 temporary the size of G). Untested on a GPU: where the
    fp32-output GEMM is missing, the first call falls back to the chunks for good."""
    out = _triton_products(flat, vec.reshape(1, -1))
    if out is not None:
        return out.view(-1)
    if flat.dtype == torch.float32 and vec.dtype == torch.float32:
        return torch.mv(flat, vec)
    kind = flat.device.type
    if kind == "cuda" and flat.dtype == vec.dtype and kind not in _NO_FP32_OUT:
        try:
            return torch.mm(flat, vec.reshape(-1, 1), out_dtype=torch.float32).view(-1)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without the fp32-output GEMM
            _NO_FP32_OUT.add(kind)
    out = torch.zeros(flat.shape[0], dtype=torch.float32, device=flat.device)
    step = max(1, _DOT_CHUNK // flat.shape[0])
    for gc, tc in zip(flat.split(step, dim=1), vec.split(step)):
        out += torch.mv(gc.float(), tc.float())
    return out


def combine(scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum_d scale[d] G[d] (G [k, *shape]) in G's dtype, accumulated in fp32 (for bf16 gradients
    the weights rounded to bf16 first, as the k-pass step's `addcmul_` rounds them). On CUDA
    with Triton the `weighted_rows` kernel (one read of G, one write; the GEMV below ran at about
    a third of that speed at 1B, docs/design.md 4c-iii), elsewhere one GEMV. `scale` already in
    G's dtype costs no conversion (the one-pass step rounds it once for all parameters)."""
    k = g.shape[0]
    flat, weights = g.reshape(k, -1), scale.to(g.dtype)
    kernel = _triton_kernel(1, k, flat)
    out = None if kernel is None else _run_kernel(kernel, weights, flat)
    if out is None:
        out = torch.mv(flat.t(), weights)
    return out.view(g.shape[1:])


def _write_grads(params: list[torch.Tensor], total: list[torch.Tensor], norm: torch.Tensor | None) -> None:
    """total / norm into each parameter's gradient buffer (its fp32 main grad when it has one);
    `norm` None: `total` is the update as it stands (the one-pass step's weights are normalised
    before `combine`, and a division by 1 was a kernel a parameter, 3.5 ms a step at 1B)."""
    for p, acc in zip(params, total):
        if norm is not None:
            acc.div_(norm.to(acc.dtype))
        if getattr(p, "main_grad", None) is not None:
            grad_of(p).copy_(acc)
        else:
            p.grad = acc.to(p.dtype)
