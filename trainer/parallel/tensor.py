"""Tensor parallelism, Megatron style (Shoeybi et al. 2019; sequence parallel: Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models").

Activations are laid out [s, b, d] so that sequence-parallel shards are contiguous slices of
dim 0 (all-gather / reduce-scatter need no copies).

- Column-parallel linear: weight rows split over tp (fused QKV and gate/up cut per part so each
  rank holds whole heads and matching FFN slices). Its input is replicated (backward
  all-reduces the input gradient) or, under sequence parallel, sequence-sharded (forward
  all-gathers it, backward reduce-scatters the input gradient).
- Row-parallel linear: weight columns split over tp; forward all-reduces the output or, under
  sequence parallel, reduce-scatters it along the sequence.
- `tp_recompute_allgather`: the column linear keeps only its local sequence shard for
  backward and re-gathers the full input there, into the stage's `GatherBuffer`.
- `tp_async`: in the column linear's backward the input all-gather overlaps the input-gradient
  matmul and the input-gradient reduce-scatter / all-reduce overlaps the weight-gradient matmul.
- Vocabulary-parallel embedding and cross entropy over a vocabulary padded to a multiple of tp
  (padded rows are masked out of every loss and receive zero gradient).

Which of the model's weights is laid out which way is one table per family, `trainer.model.sharding`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from data.store.batch import IGNORE_INDEX
from trainer.parallel.buffer import GatherBuffer
from trainer.parallel.context import ParallelContext
from trainer.parallel.main_grad import grad_of
from trainer.parallel.shard import ShardSpec, set_shard_spec

if TYPE_CHECKING:
    from trainer.config.schema import ParallelismConfig
#: The vocabulary is padded to a multiple of lcm(VOCAB_PAD_MULTIPLE, tp): for tp dividing 64 the
#: padded (full) size does not depend on tp, so checkpoints reshard without changing shapes.
VOCAB_PAD_MULTIPLE = 64

# `all_gather_single` / `reduce_scatter_single` replace the *_tensor names from torch 2.13.
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    m = math.lcm(multiple, tp)
    return -(-vocab_size // m) * m


@dataclass
class TensorParallel:
    """What the tensor-parallel layers of one stage need: the tp group and the feature flags.
    The flags are forced off at tp = 1; recompute_allgather only exists with sequence parallel."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False
    async_comm: bool = False
    recompute_allgather: bool = False
    buffer: GatherBuffer = field(default_factory=GatherBuffer)

    @classmethod
    def from_config(cls, par: ParallelismConfig, pc: ParallelContext) -> TensorParallel:
        on = pc.tp > 1
        sp = on and par.sequence_parallel
        return cls(
            size=pc.tp,
            rank=pc.tp_rank,
            group=pc.tp_group,
            sequence_parallel=sp,
            async_comm=on and par.tp_async,
            recompute_allgather=sp and par.tp_recompute_allgather,
        )

    def __deepcopy__(self, memo) -> TensorParallel:
        return self  # process groups cannot be copied; a copied model shares its stage's settings


# -- collectives along dim 0 (the sequence) ---------------------------------------------------


def _gathered_shape(x: torch.Tensor, tp: TensorParallel) -> tuple[int, ...]:
    return (x.shape[0] * tp.size, *x.shape[1:])


def _all_gather(out: torch.Tensor, x: torch.Tensor, tp: TensorParallel, async_op: bool = False):
    return _all_gather_base(out, x.contiguous(), group=tp.group, async_op=async_op)


def gather_sequence(x: torch.Tensor, tp: TensorParallel, buffer_key: str | None = None) -> torch.Tensor:
    """All-gather along dim 0, into the stage buffer when `buffer_key` is given."""
    shape = _gathered_shape(x, tp)
    out = (
        tp.buffer.get(buffer_key, shape, x.dtype, x.device)
        if buffer_key
        else torch.empty(shape, dtype=x.dtype, device=x.device)
    )
    _all_gather(out, x, tp)
    return out


def _reduce_scatter_start(x: torch.Tensor, tp: TensorParallel, async_op: bool = False):
    if x.shape[0] % tp.size:
        raise ValueError(f"sequence parallel: sequence length {x.shape[0]} is not divisible by tp={tp.size}")
    out = torch.empty((x.shape[0] // tp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _reduce_scatter_base(out, x.contiguous(), group=tp.group, async_op=async_op)
    return out, work


def reduce_scatter_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _reduce_scatter_start(x, tp)[0]


def _all_reduce(x: torch.Tensor, tp: TensorParallel, async_op: bool = False):
    return dist.all_reduce(x, group=tp.group, async_op=async_op)


def local_chunk(x: torch.Tensor, tp: TensorParallel, dim: int = 0) -> torch.Tensor:
    if x.shape[dim] % tp.size:
        raise ValueError(f"tensor parallel: size {x.shape[dim]} of dim {dim} is not divisible by tp={tp.size}")
    return x.chunk(tp.size, dim=dim)[tp.rank].contiguous()


# -- autograd building blocks -----------------------------------------------------------------

#: A collective of one tensor over the tp group (x, tp) -> tensor.
Collective = Callable[[torch.Tensor, TensorParallel], torch.Tensor]


def _no_compile(fn):
    """Collectives stay outside compiled graphs: dynamo graph-breaks here on purpose. Torch's lazy
    form of `torch.compiler.disable` (the same graph break) imports dynamo at the first call, not at
    import: about 1.5 s of CPU saved for every process that only imports the trainer (each CLI
    call, each test rank; experiments/notes/SUITE.md)."""
    return torch._disable_dynamo(fn)


def _conjugate(name: str, forward: Collective, backward: Collective) -> Collective:
    """The op `name`: `forward` over the tp group whose gradient is its conjugate `backward`
    (Megatron's f/g pairs, Shoeybi et al. 2019 section 3; the sequence-parallel gather /
    reduce-scatter pair, Korthikanti et al. 2022 section 4.2), the identity at tp = 1, and
    outside compiled graphs. One owner for the five ops below, which differ only in the two
    collectives."""

    def fwd(ctx, x, tp):
        ctx.tp = tp
        return forward(x, tp)

    def bwd(ctx, g):
        return backward(g, ctx.tp), None

    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})

    def op(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return x if tp.size == 1 else fn.apply(x, tp)

    op.__name__ = op.__qualname__ = name
    return _no_compile(op)


def _same(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x.view_as(x)


def _summed(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    out = x.contiguous().clone()
    _all_reduce(out, tp)
    return out


def _gathered_last_dim(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def _last_dim_chunk(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return local_chunk(x, tp, dim=-1)


#: Identity forward, all-reduce backward (Megatron's f), and the converse (Megatron's g).
copy_to_tp = _conjugate("copy_to_tp", _same, _summed)
reduce_from_tp = _conjugate("reduce_from_tp", _summed, _same)
#: All-gather along the sequence forward, reduce-scatter backward, and the converse.
gather_from_sequence = _conjugate("gather_from_sequence", gather_sequence, reduce_scatter_sequence)
reduce_scatter_to_sequence = _conjugate("reduce_scatter_to_sequence", reduce_scatter_sequence, gather_sequence)
#: All-gather along the last dim forward (e.g. vocabulary-parallel logits), split backward.
gather_last_dim = _conjugate("gather_last_dim", _gathered_last_dim, _last_dim_chunk)


# -- parallel linears -------------------------------------------------------------------------


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run a matmul in: custom Functions cast explicitly because their
    backward does not run under autocast."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _ColumnParallelLinear(torch.autograd.Function):
    # `mm`: the GEMMs in another precision (`trainer.model.fp8.Fp8Matmul`); None: torch.matmul.
    @staticmethod
    def forward(ctx, x, weight, tp, mm=None, record=True):
        if tp.sequence_parallel:
            full = gather_sequence(x, tp, "input" if tp.recompute_allgather else None)
        else:
            full = x
        out = mm.forward(full, weight, record) if mm is not None else torch.matmul(full, weight.t())
        ctx.tp, ctx.mm = tp, mm
        ctx.save_for_backward(x if tp.recompute_allgather else full, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        saved, weight = ctx.saved_tensors
        tp = ctx.tp
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gather_work = None
        full = saved
        if tp.recompute_allgather and need_w:
            full = tp.buffer.get("input", _gathered_shape(saved, tp), saved.dtype, saved.device)
            gather_work = _all_gather(full, saved, tp, async_op=tp.async_comm)
        grad_x = comm = None
        mm = ctx.mm
        if need_x:
            grad_x = mm.grad_input(g, weight) if mm is not None else torch.matmul(g, weight)
            if tp.sequence_parallel:
                grad_x, comm = _reduce_scatter_start(grad_x, tp, async_op=tp.async_comm)
            elif tp.size > 1:
                comm = _all_reduce(grad_x, tp, async_op=tp.async_comm)
        grad_w = None
        if need_w:
            if gather_work is not None:
                gather_work.wait()
            grad_w = mm.grad_weight(g, full) if mm is not None else _flat(g).t().matmul(_flat(full))
        if comm is not None:
            comm.wait()
        return grad_x, grad_w, None, None, None


class _RowParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, tp, mm=None, record=True):
        out = mm.forward(x, weight, record) if mm is not None else torch.matmul(x, weight.t())
        if tp.sequence_parallel:
            out = reduce_scatter_sequence(out, tp)
        elif tp.size > 1:
            _all_reduce(out, tp)
        ctx.tp, ctx.mm = tp, mm
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        tp = ctx.tp
        if tp.sequence_parallel:
            g = gather_sequence(g, tp, "grad")
        mm = ctx.mm
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = mm.grad_input(g, weight) if mm is not None else torch.matmul(g, weight)
        if ctx.needs_input_grad[1]:
            grad_w = mm.grad_weight(g, x) if mm is not None else _flat(g).t().matmul(_flat(x))
        return grad_x, grad_w, None, None, None


@_no_compile
def _column_tp(x, weight, tp, mm=None):
    dt = _compute_dtype(x)
    return _ColumnParallelLinear.apply(x.to(dt), weight.to(dt), tp, mm, torch.is_grad_enabled())


@_no_compile
def _row_tp(x, weight, tp, mm=None):
    dt = _compute_dtype(x)
    return _RowParallelLinear.apply(x.to(dt), weight.to(dt), tp, mm, torch.is_grad_enabled())


def _fp8_whole(x, weight, mm):
    """tp 1, dynamic FP8 scaling: torchao's float8 linear, compiled with its neighbours (no
    collective, so no graph break), on the operands in the dtype the tp path would use."""
    dt = _compute_dtype(x)
    return mm.linear(x.to(dt), weight.to(dt))


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel, mm=None) -> torch.Tensor:
    """x [s(/tp under sequence parallel), b, in] -> [s, b, out/tp]. `mm`: FP8 GEMMs (any tp)."""
    if tp.size == 1 and (mm is None or mm.whole):
        return F.linear(x, weight) if mm is None else _fp8_whole(x, weight, mm)
    return _column_tp(x, weight, tp, mm)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallel, mm=None) -> torch.Tensor:
    """x [s, b, in/tp] -> [s(/tp under sequence parallel), b, out]. `mm`: FP8 GEMMs (any tp)."""
    if tp.size == 1 and (mm is None or mm.whole):
        return F.linear(x, weight) if mm is None else _fp8_whole(x, weight, mm)
    return _row_tp(x, weight, tp, mm)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows cut per part: `parts` are the output sizes of the fused
    projections (q, k, v) or (gate, up); each rank holds the r-th slice of every part."""

    def __init__(
        self,
        in_features: int,
        parts: tuple[int, ...],
        tp: TensorParallel,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        spec = ShardSpec(0, tuple(parts))
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(sum(spec.local_parts(tp.size)), in_features, device=device, dtype=dtype))
        set_shard_spec(self.weight, spec)
        self.fp8 = None  # `trainer.model.fp8.apply_fp8`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.tp, self.fp8)


class RowParallelLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallel,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        spec = ShardSpec(1, (in_features,))
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, spec.local_parts(tp.size)[0], device=device, dtype=dtype))
        set_shard_spec(self.weight, spec)
        self.fp8 = None  # `trainer.model.fp8.apply_fp8`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(x, self.weight, self.tp, self.fp8)


# -- vocabulary parallel ----------------------------------------------------------------------


def vocab_range(padded_vocab: int, tp: TensorParallel) -> tuple[int, int]:
    """[start, end) of the vocabulary rows this tp rank holds."""
    local = padded_vocab // tp.size
    return tp.rank * local, (tp.rank + 1) * local


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over tp; ids [b, s] -> hidden [s(/tp under sequence parallel), b, d].
    Each rank looks up the ids in its range (zero elsewhere); the partial sums are all-reduced,
    or reduce-scattered along the sequence under sequence parallel."""

    def __init__(
        self,
        padded_vocab: int,
        dim: int,
        tp: TensorParallel,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        spec = ShardSpec(0, (padded_vocab,))
        self.tp = tp
        self.padded_vocab = padded_vocab
        self.weight = nn.Parameter(torch.empty(spec.local_parts(tp.size)[0], dim, device=device, dtype=dtype))
        set_shard_spec(self.weight, spec)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.t()
        tp = self.tp
        if tp.size == 1:
            return F.embedding(ids, self.weight)
        start, end = vocab_range(self.padded_vocab, tp)
        outside = (ids < start) | (ids >= end)
        local = F.embedding((ids - start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        if tp.sequence_parallel:
            return reduce_scatter_to_sequence(local, tp)
        return reduce_from_tp(local, tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy over vocabulary-sharded logits, in fp32, without gathering them:
    loss = log sum_v exp(z_v - m) - (z_target - m), with the max m, the target logit and the sum
    of exponentials each all-reduced over tp. Saves only the local softmax (computed in place)."""

    @staticmethod
    def forward(ctx, logits, target, tp, vocab_size, ignore_index):
        z = logits.to(torch.float32, copy=True)
        local = z.shape[-1]
        start = tp.rank * local
        n_valid = max(0, min(local, vocab_size - start))
        if n_valid < local:
            z[:, n_valid:].fill_(float("-inf"))
        zmax = z.max(dim=-1).values
        if tp.size > 1:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=tp.group)
        z.sub_(zmax.unsqueeze(-1))
        in_range = (target >= start) & (target < start + n_valid)
        local_target = (target - start).masked_fill(~in_range, 0)
        target_logit = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        z.exp_()
        sum_exp = z.sum(dim=-1)
        if tp.size > 1:
            stats = torch.stack([target_logit, sum_exp])
            dist.all_reduce(stats, group=tp.group)
            target_logit, sum_exp = stats[0], stats[1]
        valid = target != ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(z, in_range, local_target, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, in_range, local_target, valid = ctx.saved_tensors
        grad = softmax  # in place: the graph is not kept (no double backward / retain_graph)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -in_range.to(grad.dtype).unsqueeze(-1))
        grad.mul_((g * valid).unsqueeze(-1))
        return grad, None, None, None, None


@_no_compile
def _vocab_parallel_ce(logits, target, tp, vocab_size, ignore_index):
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size, ignore_index)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp: TensorParallel, vocab_size: int, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token losses (fp32, shape of `target`; exactly 0 at `ignore_index`) from this rank's
    logits [..., padded_vocab / tp]; columns >= vocab_size (padding) are excluded."""
    loss = _vocab_parallel_ce(_flat(logits), target.reshape(-1), tp, vocab_size, ignore_index)
    return loss.view(target.shape)


# -- gradient synchronisation over tp after the backwards of a step ---------------------------


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, r in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(r.view_as(g))


def sync_sequence_parallel_grads(stage: nn.Module, pc: ParallelContext) -> None:
    """Sum over tp the gradients (`grad_of`: main grads where attached) of replicated parameters
    used on sequence shards (norm weights, marked `_sequence_parallel`): each rank saw only its
    part of the sequence."""
    if pc.tp == 1:
        return
    grads = [g for p in stage.parameters() if getattr(p, "_sequence_parallel", False) and (g := grad_of(p)) is not None]
    if grads:
        _all_reduce_coalesced(grads, pc.tp_group)
