"""Expert parallelism: the routed experts of every MoE block split over an expert-parallel (ep)
group carved from the data-parallel ranks (GShard, Lepikhin et al. 2021; DeepSpeed-MoE).

Grid (the groups are made by `trainer.parallel.context.ParallelContext` with the others): dp
rank d is ep rank d % ep of the ep group {d' : d' // ep == d // ep} (consecutive dp ranks,
neighbours in the world), at the same pipeline stage and tp rank. Ep rank r holds the
experts [r E/ep, (r+1) E/ep) of each block. The ranks holding the same experts, {d' : d' % ep
== d % ep} (dp / ep of them), are the expert's *replica group*: an expert weight's gradient is
summed over that group only (each replica saw different tokens of the global batch, and the
ep peers' tokens arrived by all-to-all), and its ZeRO-1 owner is one of them.

Token flow of a block (`ExpertParallel.experts_fn`): this rank's (token, expert) assignments,
sorted by expert, go to the rank of their expert by one all-to-all (split sizes from an
all-to-all of the per-expert counts), are regrouped there by local expert, run through the
grouped experts, and return by the reverse all-to-all (whose backward is the forward one).
Dropless: buffers are sized from the counts, nothing is padded or dropped.

Parameters of ep-split experts carry `_expert_parallel` (this object) so that initialisation,
checkpoints, the dp reduction, ZeRO-1 and the gradient norm treat dim 0 as split over ep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_EP_ATTR = "_expert_parallel"


@dataclass(eq=False)
class ExpertParallel:
    size: int = 1
    rank: int = 0
    #: The ep group (same stage, tp rank and block of ep dp ranks).
    group: dist.ProcessGroup | None = None
    #: The replica group of this rank's experts, and its members' global ranks in dp order.
    replica_group: dist.ProcessGroup | None = None
    replica_ranks: list[int] = field(default_factory=list)
    #: This rank's index in its replica group (= dp_rank // ep).
    replica_rank: int = 0

    @property
    def replicas(self) -> int:
        return max(1, len(self.replica_ranks))

    @classmethod
    def from_context(cls, pc) -> ExpertParallel:
        """This rank's ep and replica groups, made with the grid's by `ParallelContext`
        (`trainer.parallel.context.grid_groups`). ep = 1: no groups."""
        if pc.ep == 1:
            return cls()
        return cls(
            size=pc.ep,
            rank=pc.dp_rank % pc.ep,
            group=pc.ep_group,
            replica_group=pc.ep_replica_group,
            replica_ranks=pc.ep_replica_ranks,
            replica_rank=pc.dp_rank // pc.ep,
        )

    def __deepcopy__(self, memo) -> ExpertParallel:
        return self

    # -- parameters ---------------------------------------------------------------------------
    def mark(self, param: torch.Tensor, num_experts: int) -> None:
        if self.size > 1:
            setattr(param, _EP_ATTR, self)

    def experts_fn(self, experts: Callable, num_experts: int) -> Callable:
        """`experts(sorted_x, counts)` over all experts, as this rank sees it: the local experts
        alone at ep = 1, through the all-to-alls otherwise."""
        if self.size == 1:
            return experts

        def fn(sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return _dispatched(sorted_x, counts, experts, num_experts, self)

        return fn


def expert_parallel_of(param: torch.Tensor) -> ExpertParallel | None:
    return getattr(param, _EP_ATTR, None)


def ep_full_shape(param: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` (the tp-full shape of a local parameter) with dim 0 whole when ep-split."""
    ep = expert_parallel_of(param)
    return shape if ep is None else (shape[0] * ep.size, *shape[1:])


def ep_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a tensor whose dim 0 holds all of them."""
    ep = expert_parallel_of(param)
    return full if ep is None else full.chunk(ep.size, dim=0)[ep.rank].contiguous()


# -- the all-to-all token exchange --------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split `send` go to the ranks of `group`; `recv` rows come back. Backward: the
    same exchange reversed."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((sum(ctx.send), *g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def _dispatched(
    sorted_x: torch.Tensor, counts: torch.Tensor, experts: Callable, num_experts: int, ep: ExpertParallel
) -> torch.Tensor:
    """sorted_x [N, d] sorted by (global) expert, counts [E] -> the experts' outputs, same rows."""
    local = num_experts // ep.size
    per_dest = counts.view(ep.size, local)
    recv_counts = torch.empty_like(per_dest)
    dist.all_to_all_single(recv_counts, per_dest.contiguous(), group=ep.group)  # [source, local expert]
    send = per_dest.sum(1).tolist()
    recv_table = recv_counts.tolist()
    recv = [sum(r) for r in recv_table]
    x = _AllToAll.apply(sorted_x, send, recv, ep.group)
    perm = regroup_by_expert(recv_table)
    inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel()))
    perm, inverse = perm.to(x.device), inverse.to(x.device)
    out = experts(permute_rows(x, perm, inverse), recv_counts.sum(0))
    return _AllToAll.apply(permute_rows(out, inverse, perm), recv, send, ep.group)


class _PermuteRows(torch.autograd.Function):
    """rows = x[index] for a permutation `index` whose inverse is `inverse`. Backward is the
    inverse gather, g[inverse]: a permutation's gradient needs no accumulation, where autograd's
    own for `x[index]` is an accumulating scatter (on CUDA a sort of the indices first)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return g.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[index] for a permutation `index` (inverse `inverse`); its gradient a gather too."""
    return _PermuteRows.apply(x, index, inverse)


def regroup_by_expert(table: list[list[int]]) -> torch.Tensor:
    """Rows arrive in blocks ordered (source rank, local expert), of sizes table[s][e]; the
    permutation that orders them (local expert, source rank)."""
    starts, pos = [], 0
    for row in table:
        starts.append([])
        for n in row:
            starts[-1].append(pos)
            pos += n
    idx = [
        torch.arange(starts[s][e], starts[s][e] + table[s][e])
        for e in range(len(table[0]) if table else 0)
        for s in range(len(table))
    ]
    return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)


# -- checkpoints: files hold all experts, whatever the ep ------------------------------------


@torch.no_grad()
def ep_gather(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """All of `param`'s experts from this rank's `t` (the parameter, or a state tensor whose dim 0
    follows it), gathered over the ep group (collective over it); `t` itself otherwise."""
    ep = expert_parallel_of(param)
    if ep is None or t.ndim == 0 or t.shape[0] != param.shape[0]:
        return t
    parts = [torch.empty_like(t) for _ in range(ep.size)]
    dist.all_gather(parts, t.contiguous(), group=ep.group)
    return torch.cat(parts)


def ep_gather_state(state: dict[str, dict[str, torch.Tensor]], params: dict[str, torch.Tensor]) -> dict:
    """An optimizer state (name -> key -> tensor) with the expert-parallel entries holding all
    experts, kept by ep rank 0 only (the ep peers hold the same names: one writer). Collective
    over the ep group: its ranks own the same names (`param_owners`)."""
    out = {}
    for name in sorted(state):
        ep = expert_parallel_of(params[name])
        if ep is None:
            out[name] = state[name]
            continue
        full = {k: ep_gather(v, params[name]) for k, v in sorted(state[name].items())}
        if ep.rank == 0:
            out[name] = full
    return out


def ep_slice_state(state: dict[str, torch.Tensor], param: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's experts of each state tensor whose dim 0 holds all experts."""
    ep = expert_parallel_of(param)
    if ep is None:
        return state
    whole = param.shape[0] * ep.size
    return {k: ep_slice(v, param) if v.ndim and v.shape[0] == whole else v for k, v in state.items()}


def uses_expert_parallel(module: torch.nn.Module) -> bool:
    """Whether `module` holds expert-parallel weights (its forwards are collective over dp peers)."""
    return any(expert_parallel_of(p) is not None for p in module.parameters())
