"""Data parallelism: gradient reduction over the dp group and the ZeRO-1 parameter partition.

Gradients are SUMMED over dp ranks, never averaged: the loss weights already carry the global
normalisation (`trainer.feed.weighting`). Reductions run once per optimizer step, after every
micro-batch's backward, over flattened buckets (fewer, larger collectives), with at most a
couple of buckets in flight so the extra memory is bounded by the bucket size, not the model.

ZeRO-1 (Rajbhandari et al. 2020, stage 1) here is parameter-granular: each parameter's optimizer
state lives on one dp rank, its *owner*, chosen by a deterministic greedy size balance. The
gradient is reduced to the owner only (non-owners drop theirs), the owner updates the parameter,
then broadcasts it. Whole parameters keep Adafactor's factored (row, column) state intact and
make the optimizer state in a checkpoint per parameter, so it reshards by name.

Gradients are read through `trainer.parallel.main_grad.grad_of` (the fp32 main grad where one
is attached).

Expert-parallel parameters (`trainer.parallel.expert`: dim 0 split over an ep group carved from
dp) are reduced and broadcast over their replica group only, and owned by one of its ranks
(`param_owners`): the ep ranks of a replica hold different experts under the same name.

Tensors that are consecutive views of one storage (the flat buffers of
`trainer.optim.master_weights`) are reduced and broadcast in place as one span of that storage, gaps
included (there they are zero padding), instead of through a flattened copy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from trainer.parallel.context import ParallelContext, grid_rank
from trainer.parallel.expert import expert_parallel_of
from trainer.parallel.main_grad import grad_of

#: Elements per flattened bucket (64 MiB of fp32).
DEFAULT_BUCKET_NUMEL = 1 << 24
_MAX_IN_FLIGHT = 2
_OWNER_ATTR = "_dp_owner"


def partition_params(sizes: Sequence[int], parts: int) -> list[int]:
    """Owner (0..parts-1) of each parameter: largest first onto the least-loaded part, ties to the
    lower index, so every dp rank computes the same answer from the same shapes."""
    load = [0] * parts
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += sizes[i]
    return owners


def param_owners(params: Sequence[torch.Tensor], dp: int) -> list[int]:
    """Each parameter's owning dp rank: `partition_params` over dp for the dense ones; over the
    replica group for the expert-parallel ones (as the dp rank of that replica member)."""
    eps = [expert_parallel_of(p) for p in params]
    owners = [0] * len(params)
    dense = [i for i, e in enumerate(eps) if e is None]
    for i, o in zip(dense, partition_params([params[i].numel() for i in dense], dp)):
        owners[i] = o
    experts = [i for i, e in enumerate(eps) if e is not None]
    if experts:
        ep = eps[experts[0]]
        for i, o in zip(experts, partition_params([params[i].numel() for i in experts], ep.replicas)):
            owners[i] = o * ep.size + ep.rank
    return owners


def _split_experts(params: Sequence[torch.Tensor], owners: Sequence[int]) -> tuple[list, list, list, list]:
    dense = [(p, o) for p, o in zip(params, owners) if expert_parallel_of(p) is None]
    experts = [(p, o) for p, o in zip(params, owners) if expert_parallel_of(p) is not None]
    return [p for p, _ in dense], [o for _, o in dense], [p for p, _ in experts], [o for _, o in experts]


def set_dp_owner(param: torch.Tensor, owner: int | None) -> None:
    """Record which dp rank counts this parameter's reduced gradient (see `clip_grad_norm`)."""
    setattr(param, _OWNER_ATTR, owner)


def get_dp_owner(param: torch.Tensor) -> int | None:
    return getattr(param, _OWNER_ATTR, None)


def sums_gradients(micro_batches: int, world_size: int) -> bool:
    """Whether a step sums gradients: over micro-batches, or over ranks (dp reduction, tp
    sequence-parallel norms, tied embeddings across stages)."""
    return micro_batches > 1 or world_size > 1


def _span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D view of the storage from the first tensor's start to the last one's end, when the
    tensors are contiguous, of one dtype and in increasing order in one storage; else None."""
    first = tensors[0]
    ptr, end = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (
            t.dtype != first.dtype
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != ptr
            or t.storage_offset() < end
        ):
            return None
        end = t.storage_offset() + t.numel()
    start = first.storage_offset()
    return first.detach().as_strided((end - start,), (1,), start)


def _aliases(flat: torch.Tensor, t: torch.Tensor) -> bool:
    return flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def buckets(params: Sequence[torch.Tensor], max_numel: int = DEFAULT_BUCKET_NUMEL) -> list[list[torch.Tensor]]:
    """Consecutive runs of params of one dtype and device, each run at most `max_numel` elements
    (a larger parameter gets a bucket of its own)."""
    out: list[list[torch.Tensor]] = []
    cur: list[torch.Tensor] = []
    size = 0
    for p in params:
        if cur and (p.dtype != cur[0].dtype or p.device != cur[0].device or size + p.numel() > max_numel):
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel()
    if cur:
        out.append(cur)
    return out


def _flat_grads(bucket: list[torch.Tensor]) -> torch.Tensor:
    """The bucket's gradients as one flat tensor: a span of their storage when they lie in one
    buffer, else a copy (a missing gradient counts as 0)."""
    grads = [grad_of(p) for p in bucket]
    if all(g is not None for g in grads):
        span = _span(grads)
        if span is not None:
            return span
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for p, g in zip(bucket, grads)])


def _unflatten(flat: torch.Tensor, bucket: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view_as(p) for t, p in zip(torch.split(flat, [p.numel() for p in bucket]), bucket)]


def _pipelined(
    items: list[list[torch.Tensor]],
    launch: Callable[[list[torch.Tensor]], tuple[torch.Tensor, dist.Work | None]],
    finish: Callable[[list[torch.Tensor], torch.Tensor], None],
) -> None:
    """Launch an async collective per bucket, keeping at most `_MAX_IN_FLIGHT` outstanding."""
    pending: deque = deque()
    for bucket in items:
        flat, work = launch(bucket)
        pending.append((bucket, flat, work))
        if len(pending) > _MAX_IN_FLIGHT:
            _complete(pending.popleft(), finish)
    while pending:
        _complete(pending.popleft(), finish)


def _complete(entry: tuple, finish: Callable) -> None:
    bucket, flat, work = entry
    if work is not None:
        work.wait()
    finish(bucket, flat)


def _copy_into_grads(bucket: list[torch.Tensor], flat: torch.Tensor) -> None:
    first = grad_of(bucket[0])
    if first is not None and _aliases(flat, first):
        return
    for p, g in zip(bucket, _unflatten(flat, bucket)):
        target = grad_of(p)
        if target is None:
            p.grad = g.clone()
        else:
            target.copy_(g)


def all_reduce_grads(
    params: Sequence[torch.Tensor], pc: ParallelContext, bucket_numel: int = DEFAULT_BUCKET_NUMEL
) -> None:
    """Sum every parameter's gradient over the dp group, in place (a missing grad counts as 0)."""
    if pc.dp == 1:
        return

    def launch(bucket):
        flat = _flat_grads(bucket)
        return flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pc.dp_group, async_op=True)

    _pipelined(buckets(params, bucket_numel), launch, _copy_into_grads)


def owner_global_rank(owner: int, pc: ParallelContext) -> int:
    return grid_rank(pc.pp_rank, owner, pc.tp_rank, pc.tp, pc.dp)


def _by_owner(params: Sequence[torch.Tensor], owners: Sequence[int], dp: int) -> list[list[torch.Tensor]]:
    return [[p for p, o in zip(params, owners) if o == r] for r in range(dp)]


def reduce_grads(
    params: Sequence[torch.Tensor],
    owners: Sequence[int],
    pc: ParallelContext,
    zero1: bool,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> None:
    """An optimizer's dp reduction: to each gradient's owner under ZeRO-1, to every rank without."""
    params, owners, expert_params, expert_owners = _split_experts(params, owners)
    if zero1:
        reduce_grads_to_owners(params, owners, pc, bucket_numel)
    else:
        all_reduce_grads(params, pc, bucket_numel)
    if expert_params:
        _reduce_expert_grads(expert_params, expert_owners, zero1, bucket_numel)


def _reduce_expert_grads(params: list[torch.Tensor], owners: list[int], zero1: bool, bucket_numel: int) -> None:
    """`reduce_grads` of expert-parallel parameters, over their replica group."""
    ep = expert_parallel_of(params[0])
    if ep.replicas == 1:
        return
    if not zero1:

        def launch(bucket):
            flat = _flat_grads(bucket)
            return flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ep.replica_group, async_op=True)

        _pipelined(buckets(params, bucket_numel), launch, _copy_into_grads)
        return
    for j, dst in enumerate(ep.replica_ranks):
        mine = [p for p, o in zip(params, owners) if o == j * ep.size + ep.rank]
        _reduce_onto(mine, dst, ep.replica_group, j == ep.replica_rank, bucket_numel)


def _reduce_onto(
    params: Sequence[torch.Tensor], dst: int, group: dist.ProcessGroup, is_dst: bool, bucket_numel: int
) -> None:
    """Sum `params`' gradients over `group` onto global rank `dst`; the other ranks drop their
    (partial) `.grad`s."""

    def launch(bucket):
        flat = _flat_grads(bucket)
        return flat, dist.reduce(flat, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def finish(bucket, flat):
        if is_dst:
            _copy_into_grads(bucket, flat)
        else:
            for p in bucket:
                p.grad = None

    _pipelined(buckets(params, bucket_numel), launch, finish)


def reduce_grads_to_owners(
    params: Sequence[torch.Tensor], owners: Sequence[int], pc: ParallelContext, bucket_numel: int = DEFAULT_BUCKET_NUMEL
) -> None:
    """Sum each gradient over dp onto its owner; non-owners drop their (partial) `.grad`s (a
    main grad stays allocated, holding a partial sum that nothing reads)."""
    if pc.dp == 1:
        return
    for owner, mine in enumerate(_by_owner(params, owners, pc.dp)):
        _reduce_onto(mine, owner_global_rank(owner, pc), pc.dp_group, owner == pc.dp_rank, bucket_numel)


@torch.no_grad()
def broadcast_from_owners(
    params: Sequence[torch.Tensor], owners: Sequence[int], pc: ParallelContext, bucket_numel: int = DEFAULT_BUCKET_NUMEL
) -> None:
    """After the owners' update, every dp rank receives each parameter from its owner."""
    if pc.dp == 1:
        return
    params, owners, expert_params, expert_owners = _split_experts(params, owners)
    groups = [
        (owner_global_rank(o, pc), o == pc.dp_rank, pc.dp_group, mine)
        for o, mine in enumerate(_by_owner(params, owners, pc.dp))
    ]
    if expert_params and (ep := expert_parallel_of(expert_params[0])).replicas > 1:
        for j, src in enumerate(ep.replica_ranks):
            mine = [p for p, o in zip(expert_params, expert_owners) if o == j * ep.size + ep.rank]
            groups.append((src, j == ep.replica_rank, ep.replica_group, mine))
    for src, sending, group, mine in groups:

        def launch(bucket, src=src, sending=sending, group=group):
            flat = _span(bucket)
            if flat is None and sending:
                flat = torch.cat([p.detach().reshape(-1) for p in bucket])
            elif flat is None:
                flat = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            return flat, dist.broadcast(flat, src=src, group=group, async_op=True)

        def finish(bucket, flat, sending=sending):
            if not sending and not _aliases(flat, bucket[0]):
                for p, v in zip(bucket, _unflatten(flat, bucket)):
                    p.copy_(v)

        _pipelined(buckets(mine, bucket_numel), launch, finish)
