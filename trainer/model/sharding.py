"""The sharding plan: where every parameter of the model lives on the process grid, one table per
model family (docs/design.md sections 5, 5b, 5c; as torchtitan's parallelize plans state a whole
decision in one place).

A row per parameter, keyed by its single-process name without the `layers.<i>.` of its block:
- tp: its tensor-parallel style, and `dim`, the dimension of the single-process tensor that is
  split over tp (None: whole on every tp rank). The split is cut per part (`ShardSpec`), so a
  fused projection's rank holds whole heads of each of its parts;
- ep: whether dim 0 (the experts) is split over the expert-parallel group;
- pp: which pipeline stage holds it: `block` the stage of its layer (`trainer.plan.stage_split`),
  `first|tied` the first (the last too when the embeddings are tied: a duplicate there,
  `trainer.parallel.tied`), `last`, `last|untied` the last when the head is not tied.

The model builds every parameter through its row: the weight-holding modules by `tp_module`, the
bare parameters (the routed experts' stacked weights, Mamba-2's per-channel ones) by
`plan_parameter`; each stage holds what `on_stage` says. Both tag the parameter with the row's
`ShardSpec` and, for an ep row, its `ExpertParallel`; initialisation (`trainer.model.init`),
checkpoint resharding (`trainer.checkpoint.checkpoint`) and the Hugging Face import
(`trainer.hf.init`) cut and join each parameter by those tags, so they hold no list of names.

| family | parameter | tp | split dim | ep | pp |
|---|---|---|---|---|---|
| dense | `embed.weight` | vocab | 0 (vocabulary rows) | | first, tied |
| dense | `attn_norm.weight`, `mlp_norm.weight` | replicated | | | block |
| dense | `attn.qkv.weight` | column | 0, per part q, k, v | | block |
| dense | `attn.out.weight` | row | 1 (heads) | | block |
| dense | `mlp.gate_up.weight` | column | 0, per part gate, up | | block |
| dense | `mlp.down.weight` | row | 1 (FFN) | | block |
| dense | `norm.weight` | replicated | | | last |
| dense | `head.weight` | column | 0 (vocabulary rows) | | last, untied |
| MoE | `mlp.router.weight` | replicated | | | block |
| MoE | `mlp.experts.gate_up` [E, 2F, d] | column | 1, per part gate, up | 0 | block |
| MoE | `mlp.experts.down` [E, d, F] | row | 2 (FFN) | 0 | block |
| MoE | `mlp.shared.gate_up.weight`, `.down.weight` | column, row | 0, 1 | | block |
| Mamba | `mamba_norm.weight` | replicated | | | block |
| Mamba | `mamba.in_proj.weight` | column | 0, per part z, x, B, C, dt | | block |
| Mamba | `mamba.conv_weight`, `.conv_bias` | channel | 0, per part x, B, C | | block |
| Mamba | `mamba.dt_bias`, `.A_log`, `.D`, `.norm.weight` | channel | 0 (heads; channels) | | block |
| Mamba | `mamba.out_proj.weight` | row | 1 (heads) | | block |

- column: the input is replicated, or under sequence parallel all-gathered along the sequence;
  the output stays split. The head's output is this rank's vocabulary slice of the logits.
- row: takes a column projection's split output; its output is all-reduced, or under sequence
  parallel reduce-scattered along the sequence.
- vocab: each rank looks up the ids in its rows; the partial sums are all-reduced (or
  reduce-scattered along the sequence).
- replicated: the whole weight on every rank. Under sequence parallel a norm (or the router)
  sees only this rank's part of the sequence, so its gradient is summed over tp after the
  backward (`trainer.parallel.tensor.sync_sequence_parallel_grads`).
- channel: split like the in_proj part it acts on; no collective (the gated norm's groups lie on
  one rank). The collectives of each style are in `trainer.parallel.tensor`; the experts' tokens
  enter and leave the tp region as a column input and a row output do (`trainer.model.moe`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from trainer.model.layers import RMSNorm
from trainer.parallel.expert import ExpertParallel
from trainer.parallel.shard import ShardSpec, set_shard_spec
from trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)
from trainer.parallel.tied import holds_embedding, holds_head

COLUMN, ROW, VOCAB, REPLICATED, CHANNEL = "column", "row", "vocab", "replicated", "channel"
BLOCK, FIRST_TIED, LAST, LAST_UNTIED = "block", "first|tied", "last", "last|untied"


@dataclass(frozen=True)
class Placement:
    """One parameter's row: its tp style and split dimension, ep split of dim 0, pp stage rule."""

    tp: str
    dim: int | None = None
    ep: bool = False
    pp: str = BLOCK


DENSE_PLAN: dict[str, Placement] = {
    "embed.weight": Placement(VOCAB, 0, pp=FIRST_TIED),
    "attn_norm.weight": Placement(REPLICATED),
    "attn.qkv.weight": Placement(COLUMN, 0),
    "attn.out.weight": Placement(ROW, 1),
    "mlp_norm.weight": Placement(REPLICATED),
    "mlp.gate_up.weight": Placement(COLUMN, 0),
    "mlp.down.weight": Placement(ROW, 1),
    "norm.weight": Placement(REPLICATED, pp=LAST),
    "head.weight": Placement(COLUMN, 0, pp=LAST_UNTIED),
}

MOE_PLAN: dict[str, Placement] = {
    "mlp.router.weight": Placement(REPLICATED),
    "mlp.experts.gate_up": Placement(COLUMN, 1, ep=True),
    "mlp.experts.down": Placement(ROW, 2, ep=True),
    "mlp.shared.gate_up.weight": Placement(COLUMN, 0),
    "mlp.shared.down.weight": Placement(ROW, 1),
}

MAMBA_PLAN: dict[str, Placement] = {
    "mamba_norm.weight": Placement(REPLICATED),
    "mamba.in_proj.weight": Placement(COLUMN, 0),
    "mamba.conv_weight": Placement(CHANNEL, 0),
    "mamba.conv_bias": Placement(CHANNEL, 0),
    "mamba.dt_bias": Placement(CHANNEL, 0),
    "mamba.A_log": Placement(CHANNEL, 0),
    "mamba.D": Placement(CHANNEL, 0),
    "mamba.norm.weight": Placement(CHANNEL, 0),
    "mamba.out_proj.weight": Placement(ROW, 1),
}

PLANS: dict[str, dict[str, Placement]] = {"dense": DENSE_PLAN, "moe": MOE_PLAN, "mamba": MAMBA_PLAN}

_BLOCK_PREFIX = re.compile(r"^layers\.\d+\.")


def plan_key(name: str) -> str:
    """A parameter's row key: its name without the `layers.<i>.` of its block."""
    return _BLOCK_PREFIX.sub("", name)


def placement(name: str) -> Placement:
    """The row of parameter `name` (a global name, or a row key)."""
    key = plan_key(name)
    rows = [plan[key] for plan in PLANS.values() if key in plan]
    if len(rows) != 1:
        raise KeyError(f"parameter {name!r}: {len(rows)} rows of the sharding plan, expected 1")
    return rows[0]


def on_stage(name: str, tie_embeddings: bool, is_first: bool, is_last: bool) -> bool:
    """Whether a stage holds the stage-level parameter `name` (the pp rule of its row)."""
    pp = placement(name).pp
    if pp == FIRST_TIED:
        return holds_embedding(tie_embeddings, is_first, is_last)
    if pp == LAST_UNTIED:
        return holds_head(tie_embeddings, is_last)
    return is_last if pp == LAST else True


def tp_module(
    name: str,
    tp: TensorParallel,
    out_parts: tuple[int, ...],
    in_features: int | None = None,
    *,
    eps: float | None = None,
    device: torch.device | None = None,
) -> nn.Module:
    """The module whose weight is `name.weight`, laid out as its row says. Its single-process
    weight is [sum(out_parts), in_features] (a norm's: [out_parts[0]], with `eps`); `out_parts`
    are the fused projections' sizes (q, k, v or gate, up), one entry for an unfused one."""
    style = placement(f"{name}.weight").tp
    if style == COLUMN:
        return ColumnParallelLinear(in_features, out_parts, tp, device=device)
    if style == ROW:
        return RowParallelLinear(in_features, sum(out_parts), tp, device=device)
    if style == VOCAB:
        return VocabParallelEmbedding(sum(out_parts), in_features, tp, device=device)
    return RMSNorm(sum(out_parts), eps, tp.sequence_parallel, device=device)


def plan_parameter(
    name: str,
    shape: tuple[int, ...],
    tp: TensorParallel,
    parts: tuple[int, ...] | None = None,
    ep: ExpertParallel | None = None,
    device: torch.device | None = None,
) -> nn.Parameter:
    """Parameter `name` as this rank's piece of its single-process `shape` (all experts for an
    ep row): the row's dim cut per `parts` (default: one part) over tp, dim 0 over `ep`."""
    row = placement(name)
    local, spec = list(shape), None
    if row.dim is not None:
        spec = ShardSpec(row.dim, parts or (shape[row.dim],))
        if sum(spec.parts) != shape[row.dim]:
            raise ValueError(f"{name}: parts {spec.parts} do not add up to dim {row.dim} of {shape}")
        local[row.dim] = sum(spec.local_parts(tp.size))
    ep = ep or ExpertParallel()
    if row.ep:
        local[0] //= ep.size
    param = nn.Parameter(torch.empty(local, device=device))
    set_shard_spec(param, spec)
    if row.ep:
        ep.mark(param, shape[0])
    return param
