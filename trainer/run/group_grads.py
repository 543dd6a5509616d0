"""Per-group weight gradients from one forward and backward (DoGE's one-pass step,
`Alignment.one_pass`; docs/design.md section 4c, experiments/notes/PERFORMANCE.md "DoGE at 1B").

A batch whose rows (sequences) are sorted by group, with each group's row count known on the
host, gives every parameter p a gradient per group G_p [k, *p.shape]: G_p[g] is the gradient of
the step's objective restricted to group g's rows. Rows never mix in a dense Llama (attention
is within a sequence; no batch statistic), so each weight's gradient is a sum over rows, and
splitting that sum by group needs no extra forward or backward. Each parameter has, for the
pass, a leaf [k, *shape] that only receives gradients (one shared zero broadcast, requiring
grad; the forward reads the parameter itself), whose gradient autograd accumulates over the
micro-batches; the parameters' own gradients stay empty:

- linears (`trainer.parallel.tensor`'s column- and row-parallel linears and the LM head, at
  tp 1): their `mm` hook (the FP8 one's place) runs y = x W^T and the input gradient g W as
  usual, and the weight gradient per group, dW_g = g_g^T x_g, into the leaf's gradient (the
  same FLOPs as the one GEMM it replaces): the stage runs batch-first for the pass
  (`LlamaStage.batch_first`: activations [b, s, d]), so a group's rows are one contiguous
  block [rows x s, d] that one GEMM reads in place (`segment_grads`);
- the embedding: its lookup, whose backward adds each token's gradient at [group, id] of the
  leaf's gradient (the embedding's own backward over [k * vocab, d], an op the compiler does not
  trace: `group_embedding_grads`); a tied head's GEMMs add into the same leaf;
- RMSNorm weights: the norm's backward is one op (`trainer.model.ops.group_norm_backward`)
  that writes the input's gradient and each group's sums of dy x_hat from one read of dy and x;
  a block's pre-norm (`Block.pre_norm`) is one function of the residual stream with two outputs,
  the stream and its norm, whose backward also adds the stream's gradient (`_GroupPreNorm`).

Any other parameter (MoE experts and router, Mamba's, tp > 1's shards) is refused, never
silently left without its gradient. The model's own forward is untouched: `GroupGrads`
installs the hooks (and the batch-first layout) on the modules' instances for the duration of
its `with` block only; a
compiled stage traces them as one more graph, kept from step to step (no graph break,
tests/test_doge_one_pass.py).

Memory: the k gradient copies G (in the gradients' dtype: fp32 where main grads are attached,
else the parameters'), the only gradient the pass writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.config.tools import ConfigError
from trainer.model.layers import RMSNorm
from trainer.model.llama import Attention, Block, LlamaStage
from trainer.model.ops.group_norm_backward import group_norm_backward
from trainer.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from trainer.parallel.tied import head_weight


@dataclass
class RowGroups:
    """The groups of the micro-batch whose forward runs now: `offsets` [k + 1] (host; group g
    is rows offsets[g]:offsets[g + 1]) and `rows` [b], each row's group (on the device)."""

    offsets: tuple[int, ...] = ()
    rows: torch.Tensor | None = None


def group_offsets(groups: Sequence[int], k: int) -> tuple[int, ...]:
    """Offsets [k + 1] of rows sorted by group (`groups`: each row's group, non-decreasing)."""
    if any(a > b for a, b in zip(groups, groups[1:])):
        raise ValueError(f"group gradients: rows must be sorted by group, got {list(groups)}")
    counts = [0] * k
    for g in groups:
        counts[g] += 1
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return tuple(out)


def segment_grads(g: torch.Tensor, x: torch.Tensor, offsets: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """[k, out, in] in `dtype`: g_i^T x_i over the rows (dim 0 of batch-first [b, s, .]) of each
    group i, zeros for an empty group (a product over no rows): one GEMM per group, K = rows x s,
    reading the group's contiguous block in place.

    The forms before it, with the model's [s, b, d] activations, where a group's rows are not one
    block (measured at 1B on one H100, method_bench `doge-1p`, experiments/results/gpu_session14
    and gpu_session15): one GEMM per group over segments copied contiguous, 43.9 ms a step in
    GEMMs, about 10 ms of copies and 4.17 GiB of peak memory over plain; one GEMM per row
    (K = s) read in place, 52.5 ms in GEMMs and no copies, +1.22 GiB, each row a launch from the
    host. Batch-first gives the first form's GEMMs without its copies. The op is opaque to the
    compiler (`trainer::group_weight_grads`): traced, a sum of GEMMs became `addmm`s into fresh
    buffers that cuBLAS fills by copying the accumulator first."""
    return group_weight_grads(g, x, list(offsets), dtype)


@torch.library.custom_op("trainer::group_weight_grads", mutates_args=())
def group_weight_grads(g: torch.Tensor, x: torch.Tensor, offsets: list[int], dtype: torch.dtype) -> torch.Tensor:
    """`segment_grads`' op: g [b, s, out], x [b, s, in] (batch-first), groups' row offsets [k + 1]."""
    g, x = g.contiguous(), x.contiguous()
    n_out, n_in = g.shape[-1], x.shape[-1]
    out = g.new_empty((len(offsets) - 1, n_out, n_in), dtype=dtype)
    for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        if lo == hi:
            out[i].zero_()
            continue
        a, b = g[lo:hi].reshape(-1, n_out).t(), x[lo:hi].reshape(-1, n_in)
        if dtype == g.dtype:
            torch.mm(a, b, out=out[i])
        else:  # fp32 main gradients: the group's product (in g's dtype, as its own pass) in fp32
            out[i].copy_(torch.mm(a, b))
    return out


@group_weight_grads.register_fake
def _(g: torch.Tensor, x: torch.Tensor, offsets: list[int], dtype: torch.dtype) -> torch.Tensor:
    return g.new_empty((len(offsets) - 1, g.shape[-1], x.shape[-1]), dtype=dtype)


class _GroupLinear(torch.autograd.Function):
    """y = x W^T; W's gradient goes per group to `leaf` [k, *W.shape], none to W itself."""

    @staticmethod
    def forward(ctx, x, weight, leaf, offsets):
        ctx.save_for_backward(x, weight)
        ctx.offsets, ctx.dtype = offsets, leaf.dtype
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.contiguous()  # a no-op in the model (RoPE writes the qkv projection's gradient batch-major)
        grad_x = torch.matmul(g, weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, segment_grads(g, x, ctx.offsets, ctx.dtype), None


@torch.library.custom_op("trainer::group_embedding_grads", mutates_args=())
def group_embedding_grads(
    g: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, k: int, vocab: int, dtype: torch.dtype
) -> torch.Tensor:
    """[k, vocab, d] in `dtype`: each token's gradient g [b, s, d] added at [group of its row, id]
    (ids [b, s], rows [b]) in fp32 and rounded once, by the embedding's own backward over
    k x vocab rows (sorted, no atomics). Opaque to the compiler: traced,
    `new_zeros(...).index_add_` became an out-of-place `index_add` that copied the zeros first,
    a 655 MB copy (0.44 ms) a step at 1B (session 18's profile). The CPU's backward adds in the
    gradient's dtype, so it is given fp32 (fp64 kept); CUDA's adds in fp32 whatever the dtype
    (below)."""
    return _embedding_grads(g.to(torch.promote_types(g.dtype, torch.float32)), ids, rows, k, vocab).to(dtype)


def _embedding_grads(g: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, k: int, vocab: int) -> torch.Tensor:
    d = g.shape[-1]
    index = (rows.unsqueeze(1) * vocab + ids).reshape(-1)
    return torch.ops.aten.embedding_dense_backward(g.reshape(-1, d), index, k * vocab, -1, False).view(k, vocab, d)


@group_embedding_grads.register_kernel("cuda")
def _(g, ids, rows, k, vocab, dtype):
    return _embedding_grads(g.to(dtype), ids, rows, k, vocab)


@group_embedding_grads.register_fake
def _(g, ids, rows, k, vocab, dtype):
    return g.new_empty((k, vocab, g.shape[-1]), dtype=dtype)


class _GroupEmbedding(torch.autograd.Function):
    """ids [b, s] -> weight[ids] [b, s, d] (batch-first); the weight's gradient goes to
    `leaf`[group of the row, id]."""

    @staticmethod
    def forward(ctx, ids, weight, leaf, rows):
        ctx.save_for_backward(ids, rows)
        ctx.shape, ctx.dtype = leaf.shape, leaf.dtype
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, g):
        ids, rows = ctx.saved_tensors
        k, vocab, _ = ctx.shape
        return None, None, group_embedding_grads(g, ids, rows, k, vocab, ctx.dtype), None


@dataclass
class GroupMatmul:
    """A linear's `mm` hook (`trainer.parallel.tensor.column_parallel_linear`, tp 1: `whole`)
    whose weight gradient goes per group to `leaf` [k, *weight.shape]."""

    leaf: torch.Tensor
    groups: RowGroups
    whole: bool = field(default=True, init=False)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _GroupLinear.apply(x, weight, self.leaf, self.groups.offsets)


def _grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype a step keeps p's gradient in: its fp32 main grad where attached."""
    return torch.float32 if getattr(p, "main_grad", None) is not None else p.dtype


def _receiver(p: torch.Tensor, k: int, zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor]) -> torch.Tensor:
    """A leaf [k, *p.shape] that only receives gradients (its values are never read): one
    element broadcast, no storage of the parameter's size; the element is shared by every
    receiver of its dtype and device (`zeros`), not one fill launched a parameter a step."""
    key = (_grad_dtype(p), p.device)
    if key not in zeros:
        zeros[key] = torch.zeros((), dtype=key[0], device=key[1])
    return zeros[key].expand(k, *p.shape).requires_grad_()


class GroupGrads:
    """Within `with GroupGrads(stage, params, k) as gg:`, every forward of `stage` whose batch
    was announced by `gg.announce(batch, offsets)` leaves, after its backward, each parameter's
    per-group gradient in `gg.grads()` (in `params`' order), summed over the micro-batches.

    Each parameter has a leaf [k, *shape] (`leaves`) that only receives its per-group gradient,
    which autograd accumulates: the parameters' own gradients are left empty."""

    def __init__(self, stage: nn.Module, named_params: Sequence[tuple[str, torch.Tensor]], k: int):
        self.stage, self.k = stage, k
        self.groups = RowGroups()
        self.params = [p for _, p in named_params]
        self._offsets: dict[int, tuple[int, ...]] = {}
        self._patched: list[tuple[object, str, object, bool]] = []
        self._linears: list[nn.Module] = []
        self._embeds: list[VocabParallelEmbedding] = []
        self._norms: list[RMSNorm] = []
        self._attentions: list[Attention] = []
        self._blocks: list[Block] = []
        covered = self._plan()
        names = [n for n, p in named_params if id(p) not in covered]
        if names:
            raise ConfigError(
                f"group gradients (DoGE's one pass): no per-group gradient for {', '.join(names[:4])}"
                f"{' ...' if len(names) > 4 else ''}; only dense linears, RMSNorm and the embedding at tp 1"
            )
        zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.leaves = {id(p): _receiver(p, k, zeros) for p in self.params}

    def _plan(self) -> set[int]:
        """Which modules get hooks; returns the ids of the parameters they cover."""
        covered: set[int] = set()
        head = getattr(self.stage, "head", None)
        if not isinstance(self.stage, LlamaStage):
            raise ConfigError(
                f"group gradients (DoGE's one pass): expected a Llama stage, got {type(self.stage).__name__}"
            )
        for m in self.stage.modules():
            if isinstance(m, Attention):
                self._attentions.append(m)
            if isinstance(m, Block):
                self._blocks.append(m)
            tp = getattr(m, "tp", None)
            if tp is not None and getattr(tp, "size", 1) != 1:
                raise ConfigError(f"group gradients (DoGE's one pass): tensor parallel (tp {tp.size}) is not supported")
            if isinstance(m, ColumnParallelLinear | RowParallelLinear) and m is not head:
                if m.fp8 is not None:
                    raise ConfigError("group gradients (DoGE's one pass): FP8 linears are not supported")
                self._linears.append(m)
            elif isinstance(m, VocabParallelEmbedding):
                self._embeds.append(m)
            elif isinstance(m, RMSNorm):
                self._norms.append(m)
            else:
                continue
            covered.add(id(m.weight))
        if getattr(self.stage, "is_last", False):
            if getattr(self.stage, "head_fp8", None) is not None:
                raise ConfigError("group gradients (DoGE's one pass): an FP8 head is not supported")
            covered.add(id(head_weight(self.stage)))
        return covered

    def announce(self, batch: dict, offsets: tuple[int, ...]) -> None:
        """`batch`'s rows are sorted by group, group g being rows offsets[g]:offsets[g + 1]."""
        self._offsets[id(batch)] = offsets

    def _set(self, obj: object, name: str, value: object) -> None:
        had = name in vars(obj)
        self._patched.append((obj, name, vars(obj).get(name), had))
        setattr(obj, name, value)

    def __enter__(self) -> GroupGrads:
        groups, stage, leaves = self.groups, self.stage, self.leaves
        forward = stage.forward

        def stage_forward(hidden, batch):
            groups.offsets = self._offsets[id(batch)]
            groups.rows = batch["domain_ids"]
            return forward(hidden, batch)

        self._set(stage, "forward", stage_forward)
        self._set(stage, "batch_first", True)
        for m in self._attentions:
            self._set(m, "batch_first", True)
        for m in self._linears:
            self._set(m, "fp8", GroupMatmul(leaves[id(m.weight)], groups))
        if getattr(stage, "is_last", False):
            self._set(stage, "head_fp8", GroupMatmul(leaves[id(head_weight(stage))], groups))
        for m in self._embeds:
            self._set(m, "forward", _embedding(m, leaves[id(m.weight)], groups))
        for m in self._norms:
            self._set(m, "forward", _norm(m, leaves[id(m.weight)], groups))
        for m in self._blocks:
            self._set(m, "pre_norm", _pre_norm(m, leaves, groups))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, old, had in reversed(self._patched):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._patched.clear()

    def grads(self) -> list[torch.Tensor]:
        """G_p [k, *p.shape] for each parameter, in the order given (zeros where no backward
        reached it); handed over once: the leaves are dropped."""
        out = []
        for p in self.params:
            leaf = self.leaves[id(p)]
            out.append(
                torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device) if leaf.grad is None else leaf.grad
            )
        self.leaves = {}
        return out


def _embedding(m: VocabParallelEmbedding, leaf: torch.Tensor, groups: RowGroups):
    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        return _GroupEmbedding.apply(input_ids, m.weight, leaf, groups.rows)

    return forward


def _norm_forward(ctx, x, weight, leaf, rows, eps) -> torch.Tensor:
    """y = (x rstd) w for batch-first x [b, s, d] (rstd = 1 / sqrt(mean(x^2) + eps), in fp32 or
    wider; w the weight in x's dtype, each group's the same), saving what the backward reads."""
    wide = torch.promote_types(x.dtype, torch.float32)
    rstd = torch.rsqrt(x.to(wide).pow(2).mean(-1, keepdim=True) + eps)
    w = weight.detach().to(x.dtype)
    ctx.save_for_backward(x, rstd, w, rows)
    ctx.k, ctx.dtype = leaf.shape[0], leaf.dtype
    return (x.to(wide) * rstd).to(x.dtype) * w


def _norm_backward(ctx, dy, residual):
    """The input's gradient (plus the residual stream's, if any) and the weight's per group, to
    `leaf` [k, d], from one read of dy and x (`trainer.model.ops.group_norm_backward`). The
    weight's gradient is taken against x_hat in fp32, not the forward's x_hat rounded to the
    activations' dtype (as `F.rms_norm` with a weight does: the weight multiplies before the
    rounding)."""
    x, rstd, w, rows = ctx.saved_tensors
    return group_norm_backward(dy, x, rstd, w, rows, ctx.k, ctx.dtype, residual)


class _GroupRMSNorm(torch.autograd.Function):
    """A norm with no residual stream past it (the stage's last): y, the weight's gradient per
    group to `leaf`."""

    @staticmethod
    def forward(ctx, x, weight, leaf, rows, eps):
        return _norm_forward(ctx, x, weight, leaf, rows, eps)

    @staticmethod
    def backward(ctx, dy):
        dx, dw = _norm_backward(ctx, dy, None)
        return dx, None, dw, None, None


class _GroupPreNorm(torch.autograd.Function):
    """A block's pre-norm (`Block.pre_norm`): (x, y), the stream passed on as a view and its
    norm; the backward receives the gradients of both and writes their sum as x's, so the
    residual's add is in the norm's kernel, not one of its own."""

    @staticmethod
    def forward(ctx, x, weight, leaf, rows, eps):
        return x.view_as(x), _norm_forward(ctx, x, weight, leaf, rows, eps)

    @staticmethod
    def backward(ctx, d_stream, dy):
        dx, dw = _norm_backward(ctx, dy, d_stream)
        return dx, None, dw, None, None


def _eps(m: RMSNorm, x: torch.Tensor) -> float:
    return torch.finfo(x.dtype).eps if m.eps is None else m.eps  # `F.rms_norm`'s default


def _norm(m: RMSNorm, leaf: torch.Tensor, groups: RowGroups):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _GroupRMSNorm.apply(x, m.weight, leaf, groups.rows, _eps(m, x))

    return forward


def _pre_norm(block: Block, leaves: dict[int, torch.Tensor], groups: RowGroups):
    """`block`'s `pre_norm` for the pass: its norms' leaves looked up by identity (no `id()` in
    the traced code)."""
    pairs = tuple((m, leaves[id(m.weight)]) for m in block.children() if isinstance(m, RMSNorm))

    def pre_norm(norm: RMSNorm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = next(leaf for m, leaf in pairs if m is norm)
        return _GroupPreNorm.apply(x, norm.weight, leaf, groups.rows, _eps(norm, x))

    return pre_norm
