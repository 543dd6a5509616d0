"""The Llama model's tensor-parallel plan: how every weight is laid out over the tp ranks, in one
table (as torchtitan's `parallelize_module` plan), and the module each entry builds.

The model (`trainer.model.llama`) builds every weight-holding module through `tp_module`, so
this table is the single statement of the layout; the collectives each style implies are in
`trainer.parallel.tensor`.

| weight        | projection            | style      | split over tp                  |
|---------------|-----------------------|------------|--------------------------------|
| `embed`       | token embedding       | vocab      | vocabulary rows                |
| `attn_norm`   | RMSNorm               | replicated | (sequence shard under SP)      |
| `attn.qkv`    | q, k, v (fused)       | column     | heads of each of q, k and v    |
| `attn.out`    | o                     | row        | heads (input columns)          |
| `mlp_norm`    | RMSNorm               | replicated | (sequence shard under SP)      |
| `mlp.gate_up` | gate, up (fused)      | column     | FFN rows of each of gate, up   |
| `mlp.down`    | down                  | row        | FFN (input columns)            |
| `norm`        | final RMSNorm         | replicated | (sequence shard under SP)      |
| `head`        | LM head               | column     | vocabulary rows                |
| `mamba_norm`  | RMSNorm (Mamba block) | replicated | (sequence shard under SP)      |
| `mamba.in_proj` | z, x, B, C, dt (fused) | column  | groups of each part (whole heads) |
| `mamba.out_proj` | Mamba-2 output      | row        | heads (input columns)          |
| `mamba.conv_*`, `.dt_bias`, `.A_log`, `.D`, `.norm` | per channel / head | channel | as in_proj's part |
| `mlp.router`  | MoE router            | replicated | (sequence shard under SP)      |
| `mlp.experts.gate_up` | each expert's gate, up | column | FFN rows per expert (`trainer.model.moe`) |
| `mlp.experts.down` | each expert's down   | row        | FFN (input columns) per expert |
| `mlp.shared.*` | shared experts' SwiGLU | column, row | as `mlp.gate_up`, `mlp.down`   |

- column: the input is replicated, or under sequence parallel all-gathered along the sequence;
  the output stays split (a fused projection is cut per part, so a rank holds whole heads). The
  head's output is this rank's vocabulary slice of the logits, for the vocabulary-parallel loss.
- row: takes the split output of a column projection; its output is all-reduced, or under
  sequence parallel reduce-scattered along the sequence.
- vocab: each rank looks up the ids in its rows; the partial sums are all-reduced (or
  reduce-scattered along the sequence).
- replicated: the whole weight on every rank. Under sequence parallel a norm sees only this
  rank's part of the sequence, so its gradient is summed over tp after the backwards
  (`trainer.parallel.tensor.sync_sequence_parallel_grads`).
- channel: Mamba-2's per-channel and per-head parameters (`trainer.model.mamba`), split along
  dim 0 like the in_proj part they act on; no collective (the gated norm's groups lie on one rank).
- With tied embeddings there is no `head`: the head is `embed`'s weight (`trainer.parallel.tied`),
  split the same way.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from trainer.model.layers import RMSNorm
from trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"

#: Weight-holding module (its name in a block, or in the stage) -> tensor-parallel style.
TP_PLAN: dict[str, str] = {
    "embed": VOCAB,
    "attn_norm": REPLICATED,
    "attn.qkv": COLUMN,
    "attn.out": ROW,
    "mlp_norm": REPLICATED,
    "mlp.gate_up": COLUMN,
    "mlp.down": ROW,
    "norm": REPLICATED,
    "head": COLUMN,
    "mamba_norm": REPLICATED,
    "mamba.in_proj": COLUMN,
    "mamba.out_proj": ROW,
}


def tp_module(
    name: str,
    tp: TensorParallel,
    out_parts: tuple[int, ...],
    in_features: int | None = None,
    *,
    eps: float | None = None,
    device: torch.device | None = None,
) -> nn.Module:
    """The module for `name` laid out as `TP_PLAN` says. Its single-process weight is
    [sum(out_parts), in_features] (a norm's: [out_parts[0]], with `eps`); `out_parts` are the
    fused projections' sizes (q, k, v or gate, up), one entry for an unfused one."""
    style = TP_PLAN[name]
    if style == COLUMN:
        return ColumnParallelLinear(in_features, out_parts, tp, device=device)
    if style == ROW:
        return RowParallelLinear(in_features, sum(out_parts), tp, device=device)
    if style == VOCAB:
        return VocabParallelEmbedding(sum(out_parts), in_features, tp, device=device)
    return RMSNorm(sum(out_parts), eps, tp.sequence_parallel, device=device)
