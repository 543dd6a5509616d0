"""The weight-holding layers of `trainer.stacked.model`, each weight with a leading model
dimension M, each op one batched kernel over the M models.

Activations are [M, b, s, ...]: the model dimension first (so that a projection is one
`torch.bmm` over [M, b s, in]), then the batch's own [b, s] order, so that the M b sequences
that RoPE and attention see are a view ([M b, s, ...], `trainer.stacked.model.to_heads`), not
a copy (`trainer.model.llama`'s [s, b] order cost a permuting copy of the QKV projection and of
the attention output per layer, and of their gradients: design section 4d). A layer's weight
`weight[m]` is model m's weight in `Llama` (same name, same shape), so stacking and unstacking
is indexing.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class StackedLinear(nn.Module):
    """y[m] = x[m] W[m]^T for W [M, out, in]; `torch.bmm` is on autocast's bf16 list, as
    `F.linear` is, so under autocast both compute in bf16."""

    def __init__(self, models: int, in_features: int, out_features: int, device: torch.device | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(models, out_features, in_features, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, ..., in] -> [M, ..., out]."""
        m, inner = x.shape[0], x.shape[-1]
        y = torch.bmm(x.reshape(m, -1, inner), self.weight.transpose(1, 2))
        return y.view(*x.shape[:-1], y.shape[-1])


class StackedRMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) with one weight per model: the fused `F.rms_norm` without
    a weight, then the per-model scale (the fused op takes one weight for the whole input)."""

    def __init__(self, models: int, dim: int, eps: float, device: torch.device | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(models, dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, ..., d] -> the same shape."""
        scale = self.weight.view(x.shape[0], *([1] * (x.ndim - 2)), x.shape[-1])
        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * scale


class StackedEmbedding(nn.Module):
    """Per-model token lookup: model m's ids index rows m V .. (m + 1) V - 1 of the flattened
    [M V, d] table, so that all models are one `F.embedding` (and one sparse-free backward)."""

    def __init__(self, models: int, rows: int, dim: int, device: torch.device | None = None):
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(models, rows, dim, device=device))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids [M, b, s] -> hidden [M, b, s, d]."""
        m = input_ids.shape[0]
        offsets = torch.arange(m, device=input_ids.device).view(m, 1, 1) * self.rows
        return F.embedding(input_ids + offsets, self.weight.flatten(0, 1))
