"""Mixture-of-experts SwiGLU blocks: top-k routing, dropless grouped experts, balance losses.

A MoE block replaces a Llama block's MLP (`model.moe`, `trainer.config.moe.MoEConfig`):
    y = sum_{e in topk(t)} w_{t,e} * SwiGLU_e(x_t)  (+ SwiGLU_shared(x_t))
- Router: logits = x W_r^T in fp32. `softmax` gating: p = softmax(logits), the top-k p as
  weights (renormalised to sum to one with `normalize_top_k`, as Mixtral). `sigmoid` gating
  (DeepSeek-V3, Liu et al. 2024): s = sigmoid(logits), top-k by s, weights s / sum of top-k s.
- Dropless (MegaBlocks, Gale et al. 2023): no capacity factor, no token dropped. The (token,
  expert) assignments are sorted by expert, each expert runs on its contiguous slice (a grouped
  matmul: `torch._grouped_mm` on CUDA where it applies, else a loop over the slices), the
  outputs are unsorted and combined with the weights.
- Load-balancing loss, the Switch / GShard form, E * sum_e f_e P_e (Fedus et al. 2022 eq. 4;
  f_e the share of the k * S assignments that went to e, P_e the mean router probability of e),
  with the group of tokens it is computed over being ONE SEQUENCE, averaged over the sequences
  of the global batch, summed over MoE blocks. Why a sequence: the trainer's objective is a sum
  over the global batch of per-token terms (`trainer.feed.weighting`), and the batch is split over dp
  ranks and micro-batches differently in every layout; f_e is a non-linear (count) statistic,
  so a loss over a micro-batch's tokens would change with micro_batches and dp. A sequence is
  never split across micro-batches or dp ranks (only across tp ranks under sequence parallel,
  where the per-sequence sums are all-reduced over tp), so per-sequence groups make the loss,
  and the weights trained with it, the same in every layout. (This is GShard's group = one
  sequence, the "sequence-wise" balance loss of DeepSeek-V3; a global-batch balance, Qiu et al.
  2025, would need every forward of the step before any backward.) Its gradient goes through
  P_e only (f_e is a count).
- Router z-loss (ST-MoE, Zoph et al. 2022 eq. 5): mean over all token positions of the global
  batch of logsumexp(logits)^2.
Both losses enter the backward through `_AttachLoss` on the block output with weights
aux_loss_coef / B and z_loss_coef / (B S) (B sequences of S tokens in the global batch,
`set_global_batch`), so that their gradients add to the main objective's on every pipeline
stage, whatever the schedule, and sum over micro-batches and dp to the global-batch value.

Tensor parallel: the router is replicated (its input is the block input, replicated or under
sequence parallel this rank's sequence shard: then its weight is marked `_sequence_parallel`
and the per-sequence statistics are all-reduced over tp). Each expert's gate_up is split by
rows and down by columns, like the dense MLP; tokens and combine weights enter the tp region
as a column-parallel input does (copy / all-gather of the sequence) and the combined partial
outputs leave it as a row-parallel output does (all-reduce / reduce-scatter).

Expert parallel (`trainer.parallel.expert`): the experts are split over the ep group; the
sorted assignments travel to their expert's rank and back by all-to-all.

Parameters: `mlp.router.weight` [E, d], `mlp.experts.gate_up` [E, 2F, d] ([gate | up] rows per
expert), `mlp.experts.down` [E, d, F], shared experts `mlp.shared.{gate_up,down}.weight`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from trainer.config.moe import MoEConfig
from trainer.model.ops.swiglu import swiglu
from trainer.model.sharding import plan_parameter, tp_module
from trainer.parallel.expert import ExpertParallel
from trainer.parallel.tensor import (
    TensorParallel,
    copy_to_tp,
    gather_from_sequence,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)


def is_moe_layer(cfg, layer: int) -> bool:
    moe: MoEConfig | None = getattr(cfg, "moe", None)
    return moe is not None and layer in moe.moe_layers(cfg.n_layers)


# -- routing (pure) -----------------------------------------------------------------------------


@dataclass
class Routing:
    weights: torch.Tensor  # [T, k] combine weights (differentiable)
    experts: torch.Tensor  # [T, k] int64 expert ids
    probs: torch.Tensor  # [T, E] router probabilities for the balance loss (differentiable)
    logits: torch.Tensor  # [T, E] fp32


def route(logits: torch.Tensor, top_k: int, gating: str = "softmax", normalize_top_k: bool = True) -> Routing:
    """Top-k routing of [T, E] fp32 logits (see the module docstring)."""
    if gating == "softmax":
        probs = torch.softmax(logits, dim=-1)
        top, experts = probs.topk(top_k, dim=-1)
        weights = top / top.sum(-1, keepdim=True) if normalize_top_k and top_k > 1 else top
        return Routing(weights, experts, probs, logits)
    if gating == "sigmoid":
        scores = torch.sigmoid(logits)
        top, experts = scores.topk(top_k, dim=-1)
        weights = top / top.sum(-1, keepdim=True)
        return Routing(weights, experts, scores / scores.sum(-1, keepdim=True), logits)
    raise ValueError(f"model.moe.gating: expected softmax or sigmoid, got {gating!r}")


def sequence_balance_terms(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """Per-sequence sums over this rank's tokens: router probabilities [b, E] (differentiable)
    and assignment counts [b, E], from probs [s, b, E] and experts [s, b, k]."""
    s, b, k = experts.shape
    counts = torch.zeros(b, num_experts, dtype=probs.dtype, device=probs.device)
    ones = torch.ones(s * k, dtype=probs.dtype, device=probs.device)
    for j in range(b):
        counts[j].index_add_(0, experts[:, j].reshape(-1), ones)
    return probs.sum(0), counts


def balance_loss_per_sequence(prob_sums: torch.Tensor, counts: torch.Tensor, seq_len: int, top_k: int) -> torch.Tensor:
    """[b]: E * sum_e f_e P_e per sequence, f_e = counts / (k S), P_e = prob_sums / S."""
    num_experts = prob_sums.shape[-1]
    f = counts / (top_k * seq_len)
    return num_experts * (f * (prob_sums / seq_len)).sum(-1)


def z_loss_sum(logits: torch.Tensor) -> torch.Tensor:
    """sum over tokens of logsumexp(logits)^2 (ST-MoE)."""
    return torch.logsumexp(logits, dim=-1).square().sum()


# -- the grouped experts (pure) -----------------------------------------------------------------


def grouped_swiglu(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: list[int] | torch.Tensor
) -> torch.Tensor:
    """[N, d] tokens sorted by expert (counts[e] rows for expert e) -> [N, d]:
    row block e through down[e] @ swiglu(gate_up[e] @ x). `torch._grouped_mm` on CUDA for bf16
    with 16-byte-aligned rows; elsewhere one matmul per expert's slice. An expert with no rows
    still goes through its (empty) matmuls: the output must stay connected to `x` and the
    weights even when every local expert is idle, or under expert parallelism the backward of
    the return all-to-all would run on the ranks that received tokens and not on this one (a
    collective called by some ranks only: a hang, and a gradient cut). Under autocast the
    operands are cast to its dtype first, as for every other matmul of the model: fp32
    parameters under bf16 autocast reach the grouped kernel in bf16, not the loop in fp32."""
    if torch.is_autocast_enabled(x.device.type):
        dt = torch.get_autocast_dtype(x.device.type)
        x, gate_up, down = x.to(dt), gate_up.to(dt), down.to(dt)
    if _grouped_mm_applies(x, gate_up, down):
        offs = torch.as_tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(swiglu(h), down.transpose(-2, -1), offs=offs)
    sizes = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    outs = [swiglu(rows @ gate_up[e].t()) @ down[e].t() for e, rows in enumerate(torch.split(x, sizes))]
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])


def _grouped_mm_applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    if x.device.type != "cuda" or not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    aligned = all(n % 8 == 0 for n in (*gate_up.shape[1:], down.shape[1]))
    return gate_up.dtype == down.dtype == torch.bfloat16 and aligned and _grouped_mm_runs(x.device)


@functools.cache
def _grouped_mm_runs(device: torch.device) -> bool:
    """One tiny bf16 forward + backward through `torch._grouped_mm` on `device` (its kernels
    exist for some GPU architectures only); False: the loop over slices is used instead."""
    try:
        x = torch.randn(32, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(2, 32, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def sort_assignments(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the flat (token, slot) assignments sorted by expert (stable: by token
    within an expert), and the number of assignments per expert [E]."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts)


def moe_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    expert_fn,
) -> torch.Tensor:
    """Dropless MoE over tokens x [T, d]: sort the T * k assignments by expert, run
    `expert_fn(sorted_x, counts)`, unsort, weight and sum the k outputs of each token."""
    t, k = experts.shape
    order, counts = sort_assignments(experts, num_experts)
    sorted_x = x[order // k]
    out_sorted = expert_fn(sorted_x, counts)
    out = torch.empty_like(out_sorted).index_copy(0, order, out_sorted)
    return (out.view(t, k, -1) * weights.unsqueeze(-1).to(out.dtype)).sum(1)


# -- the autograd hook for the auxiliary losses -------------------------------------------------


class _AttachLoss(torch.autograd.Function):
    """Identity on `x`; in backward, `loss` (a scalar already weighted) receives gradient 1, so it
    is minimised with the main objective whatever the pipeline schedule (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (loss,) = ctx.saved_tensors
        return g, torch.ones_like(loss)


def _in_backward() -> bool:
    """True while autograd recomputes a checkpointed forward."""
    return torch._C._current_graph_task_id() != -1


# -- the module ---------------------------------------------------------------------------------


class GroupedExperts(nn.Module):
    """The routed experts' weights, this rank's (E / ep) experts, each split over tp (the
    `mlp.experts` rows of `trainer.model.sharding`)."""

    def __init__(self, num_experts: int, d_model: int, ffn: int, tp: TensorParallel, ep: ExpertParallel, device=None):
        super().__init__()
        self.gate_up = plan_parameter(
            "mlp.experts.gate_up", (num_experts, 2 * ffn, d_model), tp, (ffn, ffn), ep, device=device
        )
        self.down = plan_parameter("mlp.experts.down", (num_experts, d_model, ffn), tp, ep=ep, device=device)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu(x, self.gate_up, self.down, counts)


class MoE(nn.Module):
    """The mixture-of-experts MLP of one block (module docstring). Input and output [s(/tp), b, d]."""

    def __init__(self, cfg, tp: TensorParallel, ep: ExpertParallel | None = None, device=None):
        super().__init__()
        moe: MoEConfig = cfg.moe
        self.moe = moe
        self.tp = tp
        self.ep = ep or ExpertParallel()
        self.num_experts = moe.num_experts
        ffn = moe.ffn_dim(cfg.ffn_dim)
        self.router = nn.Linear(cfg.d_model, moe.num_experts, bias=False, device=device)
        if tp.sequence_parallel:
            self.router.weight._sequence_parallel = True
        self.experts = GroupedExperts(moe.num_experts, cfg.d_model, ffn, tp, self.ep, device)
        self.shared: nn.Module | None = None
        if moe.shared_experts:
            f = moe.shared_experts * ffn
            self.shared = nn.ModuleDict(
                {
                    "gate_up": tp_module("mlp.shared.gate_up", tp, (f, f), cfg.d_model, device=device),
                    "down": tp_module("mlp.shared.down", tp, (cfg.d_model,), f, device=device),
                }
            )
        #: Sequences in the global batch (the balance losses' normaliser; `set_global_batch`).
        self.global_sequences = 1
        self.reset_stats()

    # -- statistics for metrics.jsonl --------------------------------------------------------
    def reset_stats(self) -> None:
        self.stats_tokens = torch.zeros(self.num_experts, dtype=torch.float64)
        self.stats_balance = torch.zeros((), dtype=torch.float64)  # sum over sequences
        self.stats_z = torch.zeros((), dtype=torch.float64)  # sum over tokens
        self.stats_sequences = torch.zeros((), dtype=torch.float64)
        self.stats_positions = torch.zeros((), dtype=torch.float64)

    def _record(self, counts: torch.Tensor, balance: torch.Tensor, z: torch.Tensor, seq_len: int) -> None:
        """Add one training forward's statistics (not a recomputation's, nor an evaluation's).
        Under sequence parallel `z` is this rank's share and is summed over tp here."""
        if not torch.is_grad_enabled() or _in_backward():
            return
        z = z.detach().double()
        if self.tp.sequence_parallel:
            z = z.clone()
            dist.all_reduce(z, group=self.tp.group)
        dev = counts.device
        b = counts.shape[0]
        self.stats_tokens = self.stats_tokens.to(dev) + counts.detach().sum(0).double()
        self.stats_balance = self.stats_balance.to(dev) + balance.detach().double()
        self.stats_z = self.stats_z.to(dev) + z
        self.stats_sequences = self.stats_sequences.to(dev) + b
        self.stats_positions = self.stats_positions.to(dev) + b * seq_len

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp, moe = self.tp, self.moe
        s_local, b, d = x.shape
        seq_len = s_local * (tp.size if tp.sequence_parallel else 1)
        logits = F.linear(x, self.router.weight).float()  # [s_local, b, E]
        r = route(logits.view(-1, self.num_experts), moe.top_k, moe.gating, moe.normalize_top_k)

        prob_sums, counts = sequence_balance_terms(
            r.probs.view(s_local, b, -1), r.experts.view(s_local, b, -1), self.num_experts
        )
        z_sum = z_loss_sum(r.logits)
        if tp.sequence_parallel:
            prob_sums = reduce_from_tp(prob_sums, tp)
            dist.all_reduce(counts, group=tp.group)
        balance = balance_loss_per_sequence(prob_sums, counts, seq_len, moe.top_k).sum()
        self._record(counts, balance, z_sum, seq_len)

        weights = r.weights.view(s_local, b, -1).to(x.dtype)
        experts = r.experts.view(s_local, b, -1)
        if tp.sequence_parallel:
            x_in, weights = gather_from_sequence(x, tp), gather_from_sequence(weights, tp)
            experts = gather_sequence(experts, tp)
        else:
            x_in, weights = copy_to_tp(x, tp), copy_to_tp(weights, tp)
        k = moe.top_k
        experts_fn = self.ep.experts_fn(self.experts, self.num_experts)
        y = moe_combine(
            x_in.reshape(-1, d), weights.reshape(-1, k), experts.reshape(-1, k), self.num_experts, experts_fn
        )
        y = y.view(x_in.shape)
        y = reduce_scatter_to_sequence(y, tp) if tp.sequence_parallel else reduce_from_tp(y, tp)
        if self.shared is not None:
            y = y + self.shared["down"](swiglu(self.shared["gate_up"](x)))

        n = self.global_sequences
        aux = moe.aux_loss_coef / n * balance + moe.z_loss_coef / (n * seq_len) * z_sum
        if aux.requires_grad:
            y = _AttachLoss.apply(y, aux)
        return y


# -- model-level helpers ------------------------------------------------------------------------


def moe_modules(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def set_global_batch(model: nn.Module, sequences: int) -> None:
    """Tell every MoE block how many sequences the global batch holds (the losses' normaliser)."""
    for _, m in moe_modules(model):
        m.global_sequences = sequences


def moe_metrics(model: nn.Module, cfg, pc) -> dict:
    """Collective over the world (every rank calls it, stages without MoE blocks too): since the
    last call (whose statistics it resets), per block the (token, expert) assignments over the
    global batch, and the balance loss (E sum_e f_e P_e, mean over sequences) and z-loss (mean
    over tokens) summed over blocks, without their coefficients. {} without `model.moe`."""
    if getattr(cfg, "moe", None) is None:
        return {}
    width = cfg.moe.num_experts
    table = torch.zeros(cfg.n_layers, width + 4, dtype=torch.float64, device=pc.device)
    for name, m in moe_modules(model):
        if pc.tp_rank == 0:  # the tp ranks of a block hold the same statistics
            layer = int(name.split(".")[1])
            table[layer, :width] = m.stats_tokens.to(pc.device)
            table[layer, width:] = torch.stack([m.stats_balance, m.stats_z, m.stats_sequences, m.stats_positions]).to(
                pc.device
            )
        m.reset_stats()
    if pc.distributed:
        dist.all_reduce(table)
    rows = [i for i in cfg.moe.moe_layers(cfg.n_layers)]
    t = table[rows]
    balance = (t[:, width] / t[:, width + 2].clamp_min(1)).sum()
    z = (t[:, width + 1] / t[:, width + 3].clamp_min(1)).sum()
    return {
        "moe_expert_tokens": {str(i): [int(v) for v in table[i, :width].tolist()] for i in rows},
        "moe_balance_loss": float(balance),
        "moe_z_loss": float(z),
    }
