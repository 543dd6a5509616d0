"""How per-token losses become the scalar each micro-batch differentiates.

The trainer knows nothing of data mixing: a `LossWeighting` (the pipeline schedule's protocol,
`trainer.parallel.pipeline_schedule`) gives, for every micro-batch, a
weight per token such that the step's objective is sum over the *global* batch of
weight x per-token loss. Gradients are therefore *summed* over micro-batches and data-parallel
ranks (never averaged): the normalisation lives in the weights. Plain training is
`MeanTokenLoss` (1 / global token count on every non-masked token); DoReMi supplies weights
alpha_i / n_i on domain i's tokens (see `doremi.objective`).
"""

from __future__ import annotations

import torch

from data.store.batch import IGNORE_INDEX


class MeanTokenLoss:
    """The mean per-token loss over the global batch: weight 1 / N on each non-masked token,
    N the number of non-masked tokens over all micro-batches and dp ranks."""

    needs_forward_losses = False

    def __init__(self, global_tokens: int | torch.Tensor):
        self.scale = 1.0 / torch.as_tensor(global_tokens, dtype=torch.float32).clamp_min(1)

    def prepare(self, losses: list[torch.Tensor], batches: list[dict]) -> None:
        pass

    def token_weights(self, index: int, batch: dict) -> torch.Tensor:
        mask = batch["labels"] != IGNORE_INDEX
        return mask.to(torch.float32) * self.scale.to(mask.device)


class DomainWeights:
    """sum_i w_i * (mean loss over domain i's tokens in the global batch): weight w_d / n_d on
    each non-masked token of domain d, n_d its token count over the global batch."""

    needs_forward_losses = False

    def __init__(self, weights: torch.Tensor, domain_tokens: torch.Tensor):
        self.per_domain = (weights / domain_tokens.clamp_min(1)).to(torch.float32)

    def prepare(self, losses: list[torch.Tensor], batches: list[dict]) -> None:
        pass

    def token_weights(self, index: int, batch: dict) -> torch.Tensor:
        mask = batch["labels"] != IGNORE_INDEX
        return mask.to(torch.float32) * self.per_domain.to(mask.device)[batch["domain_ids"]][:, None]
