"""Per-domain sums over the tokens of a batch: every per-domain statistic (token counts, mean
losses, DoReMi's excess) is a sum of per-token values over each domain's non-masked tokens,
reduced over micro-batches and data-parallel ranks before any division."""

from __future__ import annotations

import torch


def domain_sums(
    values: torch.Tensor, domain_ids: torch.Tensor, mask: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of `values` [b, s] over each domain's non-masked tokens [k], token count [k] int64).

    Sums are in `values`' dtype promoted to at least float32. Masked tokens contribute exactly 0
    even when their value is NaN or inf (torch.where, not a multiplication by the mask). Domain
    ids must lie in [0, k); they are not checked on the host so that the step has no device
    sync (an id out of range fails inside scatter_add)."""
    dtype = torch.promote_types(values.dtype, torch.float32) if values.is_floating_point() else torch.float32
    zero = torch.zeros((), dtype=dtype, device=values.device)
    per_seq = torch.where(mask, values.to(dtype), zero).sum(dim=1)
    ids = domain_ids.to(device=values.device, dtype=torch.long)
    sums = torch.zeros(k, dtype=dtype, device=values.device).scatter_add_(0, ids, per_seq)
    counts = torch.zeros(k, dtype=torch.long, device=values.device).scatter_add_(0, ids, mask.sum(dim=1))
    return sums, counts
