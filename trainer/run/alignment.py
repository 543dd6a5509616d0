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
renormalised. Memory: k + 1 gradients (the kept ones and g_T); communication: k + 1 dp
all-reduces of the model's gradient (the optimizer's own dp sum then adds the zeros of dp ranks
other than 0 to rank 0's sum).

At 1B these passes over the model's gradients, not the arithmetic, are what the deferred step
adds beside its target pass (docs/design.md section 4c-iii): so autograd's gradients are kept as
they are, not copied (`_reduced`); a clip is a coefficient c (clipped g = c g) applied to the
inner products and to the domain's weight, never a pass over the gradient (`_clip_coef`); a
domain's norm and alignment come from one pass over it (`fp32_norm_dot`); and the update is
built in the first domain's gradient, in L2-sized pieces. About 150 bytes touched per
parameter at bf16 and k = 4 (about 30 reaching HBM when the chunks' upcasts stay in L2), where
copying, clipping and dotting separately touched about 250.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from data.batch import IGNORE_INDEX, collate
from trainer.feed.data_feed import DataFeed
from trainer.feed.weighting import DomainWeights, MeanTokenLoss
from trainer.parallel.context import ParallelContext
from trainer.parallel.main_grad import grad_of, reset_main_grads
from trainer.parallel.pipeline_schedule import train_schedule
from trainer.parallel.shard import get_shard_spec
from trainer.parallel.tensor import sync_sequence_parallel_grads
from trainer.parallel.tied import is_tied_duplicate, sync_tied_grads
from trainer.run.hooks import Alignment, MixingHook, StepSignals
from trainer.run.step import StepStats, global_stats


def counts_before_dp_reduction(name: str, param: torch.Tensor, pc: ParallelContext) -> bool:
    """Whether this rank's (unreduced) gradient of `param` enters a whole-model sum: not the
    tied duplicate, and sharded over tp or on tp rank 0; every dp rank holds its own part."""
    if is_tied_duplicate(name, pc):
        return False
    return pc.tp == 1 or get_shard_spec(param) is not None or pc.tp_rank == 0


#: Elements per chunk of a low-precision dot product: its two fp32 upcasts (16 MiB each, in
#: buffers reused chunk after chunk) fit the GPU's L2 cache (50 MB on an H100) from the copy
#: that writes them to the dots that read them, so a pass over bf16 gradients costs about their
#: reads, not three times their bytes again in fp32 traffic; smaller chunks would add kernels
#: (four a chunk) whose launch gaps cost more than the traffic saved.
_DOT_CHUNK = 1 << 22


def fp32_dot(g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """<g, t> as an fp64 scalar, accumulated in fp32 whatever the gradients' dtype: bf16
    gradients (a bf16 model without fp32 main grads, one micro-batch) would otherwise give a
    bf16 dot, 3 significant digits. fp32 inputs take one BLAS dot; others are upcast chunk by
    chunk, so no temporary the size of the parameter is made."""
    if g is t:
        return fp32_norm_dot(g, t)[0]
    g, t = g.reshape(-1), t.reshape(-1)
    if g.dtype == torch.float32 and t.dtype == torch.float32:
        return torch.dot(g, t).to(torch.float64)
    return _upcast_dots(g, t, norm=False)[1]


def fp32_norm_dot(g: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(<g, g>, <g, t>) as fp64 scalars, accumulated in fp32 as `fp32_dot`, each chunk of a
    low-precision g upcast once for both (t may be g): a deferred DoGE domain needs its
    gradient's norm and its alignment, and such passes over the whole model's gradients, not
    their arithmetic, are the step's extra cost (docs/design.md section 4c-iii)."""
    same = g is t
    g, t = g.reshape(-1), t.reshape(-1)
    if g.dtype == torch.float32 and t.dtype == torch.float32:
        sq = torch.dot(g, g).to(torch.float64)
        return sq, sq if same else torch.dot(g, t).to(torch.float64)
    sums = _upcast_dots(g, g if same else t, norm=True)
    return sums[0], sums[0] if same else sums[1]


def _upcast_dots(g: torch.Tensor, t: torch.Tensor, norm: bool) -> torch.Tensor:
    """[<g, g> (0 unless `norm`), <g, t> (0 when t is g)] in fp64 of two flat tensors: each
    chunk's fp32 dot written into its own slot (no accumulation kernel per chunk), the slots
    added in fp64."""
    n = g.numel()
    size = min(_DOT_CHUNK, max(n, 1))
    out = torch.zeros(2, -(-n // size), dtype=torch.float32, device=g.device)
    g_buf = torch.empty(size, dtype=torch.float32, device=g.device)
    t_buf = None if t is g else torch.empty(size, dtype=torch.float32, device=g.device)
    for i, start in enumerate(range(0, n, size)):
        m = min(size, n - start)
        gf = g_buf[:m].copy_(g[start : start + m])
        if norm:
            torch.dot(gf, gf, out=out[0, i])
        if t_buf is not None:
            torch.dot(gf, t_buf[:m].copy_(t[start : start + m]), out=out[1, i])
    return out.to(torch.float64).sum(1)


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


def _reduced(grads: list[torch.Tensor], params: Sequence[torch.Tensor], pc: ParallelContext) -> list[torch.Tensor]:
    """This step's gradients summed over dp (the same whole-batch gradient on every dp rank), in
    tensors that the gradient buffers no longer use: autograd's own are taken as they are
    (`_clear` then drops them, and the next backward allocates new ones), fp32 main grads
    (reset in place) and any tensor met twice are copied. A copy per domain would be one more
    pass over the whole model's gradients."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for g, p in zip(grads, params):
        g = g.detach()
        if getattr(p, "main_grad", None) is not None or g.data_ptr() in seen:
            g = g.clone()
        seen.add(g.data_ptr())
        out.append(g)
    if pc.dp > 1:
        for g in out:
            dist.all_reduce(g, group=pc.dp_group)
    return out


def _full_norm_dot(
    a: list[torch.Tensor], b: list[torch.Tensor], counted: list[bool], pc: ParallelContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """(<a, a>, <a, b>) over the whole model (fp64 0-dim each; b may be a) of two dp-reduced
    gradients, in one pass over a: each element counted once, by dp rank 0 of the ranks that
    count it before the reduction; one all-reduce for both."""
    sums = torch.zeros(2, dtype=torch.float64, device=pc.device)
    if pc.dp_rank == 0:
        for x, y, c in zip(a, b, counted):
            if c:
                sq, dot = fp32_norm_dot(x, y)
                sums[0] += sq
                sums[1] += dot
    if pc.world_size > 1:
        dist.all_reduce(sums)
    return sums[0], sums[1]


def _clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`'s coefficient min(1, max_norm / (norm + 1e-6)) when
    max_norm > 0, else 1 (fp64). The clip is not applied to the gradient: the coefficient
    scales the inner products and the domain's weight, which is the same number without a
    pass over the gradient (docs/design.md section 4c-iii)."""
    if max_norm > 0:
        return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return torch.ones_like(norm)


def aligned_step(
    model: torch.nn.Module,
    named_params: Sequence[tuple[str, torch.Tensor]],
    micro_batches: list[dict],
    signals: StepSignals,
    step: int,
    hook: MixingHook,
    feed: DataFeed,
    pc: ParallelContext,
) -> StepStats:
    """Leaves sum_i m_i g_i / sum_i m_i in the gradient buffers (tp and tied syncs done, dp
    reduction not) and fills `signals.alignment`; returns the step's statistics."""
    spec = hook.needs.alignment
    assert spec is not None
    k = feed.k
    params = [p for _, p in named_params]
    counted = [counts_before_dp_reduction(n, p, pc) for n, p in named_params]
    size = max(b["input_ids"].shape[0] for b in micro_batches)
    schedule = "afab" if pc.pp > 1 else "1f1b"
    g_target, target_coef = _target_gradient(model, params, counted, spec, feed, step, size, schedule, pc)

    by_domain = _by_domain(micro_batches, k)
    total = [] if spec.deferred else [torch.zeros_like(g) for g in g_target]
    norm = torch.zeros((), dtype=torch.float64, device=pc.device)
    alignment = torch.zeros(k, dtype=torch.float64, device=pc.device)
    norms = torch.zeros(k, dtype=torch.float64, device=pc.device)
    coefs = torch.ones(k, dtype=torch.float64, device=pc.device)
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
            kept.append(_reduced(grads, params, pc))
            sq, dot = _full_norm_dot(kept[-1], g_target, counted, pc)
            coefs[d] = _clip_coef(sq.sqrt(), spec.domain_clip)
            norms[d] = sq.sqrt() * coefs[d]
            alignment[d] = coefs[d] * (dot * target_coef)
        else:
            dot = _partial_dot(grads, g_target, counted, pc) * target_coef
            alignment[d] = dot
            m = hook.alignment_weight(step, d, dot, signals.lr).to(torch.float64)
            norm += m
            for acc, g in zip(total, grads):
                acc.addcmul_(g, m.to(acc.dtype))
        _clear(params)
    if spec.deferred:
        total = _deferred_sum(hook, step, alignment, norms, coefs, kept, signals, pc)
    _write_grads(params, total, None if spec.deferred else norm)
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
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """g_T: the gradient of the mean token loss on the target batch, summed over dp (every rank
    holds the whole-batch gradient), and the coefficient of its clip to `spec.domain_clip`
    (`_clip_coef`: the clipped g_T is coefficient x g_T); the buffers are left clear."""
    target = feed.target_batches(step, np.asarray(spec.weights, dtype=np.float64), spec.sequences, size)
    target_tokens = torch.zeros((), dtype=torch.float64, device=pc.device)
    for b in target:
        target_tokens += (b["labels"] != IGNORE_INDEX).sum()
    if pc.dp > 1:
        dist.all_reduce(target_tokens, group=pc.dp_group)
    _clear(params)
    if target:
        train_schedule(model, target, pc, schedule, MeanTokenLoss(target_tokens), few_ok=True)
    g_target = _reduced(_synced_grads(model, params, pc), params, pc)
    coef = torch.ones((), dtype=torch.float64, device=pc.device)
    if spec.domain_clip > 0:
        coef = _clip_coef(_full_norm_dot(g_target, g_target, counted, pc)[0].sqrt(), spec.domain_clip)
    _clear(params)
    return g_target, coef


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
    one_hot = torch.eye(k, dtype=torch.float64, device=pc.device)[d]  # no host value on the device
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


def _deferred_sum(
    hook: MixingHook,
    step: int,
    alignment: torch.Tensor,
    norms: torch.Tensor,
    coefs: torch.Tensor,
    kept: list[list[torch.Tensor]],
    signals: StepSignals,
    pc: ParallelContext,
) -> list[torch.Tensor]:
    """The deferred update sum_i w_i c_i g_i (c_i: domain i's clip coefficient, so c_i g_i is
    its clipped gradient), not renormalised, built in place in the first domain's gradient (one
    pass over each kept gradient, no further copy); on dp rank 0 only: every dp rank holds the
    reduced sum, and the optimizer's dp sum of (total, 0, ..., 0) gives it back exactly. Each
    parameter is done in L2-sized pieces (`_DOT_CHUNK`), so that the piece of the sum stays in
    cache while every domain's piece is added to it: one read of each kept gradient and one
    write, not k reads and writes of the sum."""
    w = hook.alignment_weights(step, alignment, norms, signals.lr).to(torch.float64)
    signals.grad_norms = norms
    scale = w * coefs
    total = kept[0]
    if pc.dp > 1 and pc.dp_rank != 0:
        for acc in total:
            acc.zero_()
    else:
        cast: dict[torch.dtype, torch.Tensor] = {}
        for j, acc in enumerate(total):
            s = cast.setdefault(acc.dtype, scale.to(acc.dtype))
            for acc_piece, *pieces in _pieces([grads[j] for grads in kept]):
                acc_piece.mul_(s[0])
                for d, g in enumerate(pieces, start=1):
                    acc_piece.addcmul_(g, s[d])
    kept.clear()
    return total


def _pieces(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Matching flat views of same-shaped tensors, `_DOT_CHUNK` elements each (the tensors
    whole when one is not contiguous)."""
    if not all(x.is_contiguous() for x in tensors):
        return [tuple(tensors)]
    return list(zip(*(x.view(-1).split(_DOT_CHUNK) for x in tensors)))


def _write_grads(params: list[torch.Tensor], total: list[torch.Tensor], norm: torch.Tensor | None) -> None:
    """total / norm (None: total as it is) into each parameter's gradient buffer (its fp32 main
    grad when it has one)."""
    for p, acc in zip(params, total):
        if norm is not None:
            acc.div_(norm.to(acc.dtype))
        if getattr(p, "main_grad", None) is not None:
            grad_of(p).copy_(acc)
        else:
            p.grad = acc.to(p.dtype)
