"""The batches of M runs, each on its own mixture, stacked to [M, b, s].

Model m must see exactly the batches `trainer.run.loop.Trainer` would draw with
`data.domain_weights = mixtures[m]`: its own `data.sampling.sampler.DomainBatchSampler` (the exact-count
sampler carries each domain's remainder from step to step, so one sampler per mixture), with
the feed's seed, pools (the train sequences less the holdout) and epoch caps (`data.max_epochs`),
read from the one set of token stores that `trainer.feed.data_feed.DataFeed` opens. Single
process: dp rank 0 of 1.
"""

from __future__ import annotations

import numpy as np
import torch

from data.sampling.sampler import DomainBatchSampler
from data.store.batch import IGNORE_INDEX, collate, to_device
from trainer.feed.data_feed import DataFeed

#: The per-row tensors that are stacked (the host-side `items` and `sequence_ids` are not).
STACKED_KEYS = ("input_ids", "labels", "domain_ids")


class StackedFeed:
    """`weights` [M, k]: each run's resolved mixture (`data.sampling.weights.resolve_weights`)."""

    def __init__(self, feed: DataFeed, weights: np.ndarray, micro_batches: int):
        self.feed = feed
        self.weights = np.asarray(weights, dtype=np.float64)
        self.micro_batches = micro_batches
        base = feed.sampler
        counts = [feed.train.num_sequences(d) for d in range(feed.k)]
        self.samplers = [
            DomainBatchSampler(
                counts, base.global_batch_size, base.seed, pools=base.pools, caps=base.caps, names=base.names
            )
            for _ in self.weights
        ]

    @property
    def models(self) -> int:
        return len(self.samplers)

    def step_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of global batch `step` (1-based): `input_ids`, `labels` [M, b, s]
        and `domain_ids` [M, b], on the feed's device."""
        per_model = [s.local(step - 1, w, 0, 1, self.micro_batches) for s, w in zip(self.samplers, self.weights)]
        out = []
        for i in range(self.micro_batches):
            rows = [collate(self.feed.train, items[i]) for items in per_model]
            stacked = {key: torch.stack([r[key] for r in rows]) for key in STACKED_KEYS}
            out.append(to_device(stacked, self.feed.pc.device))
        return out


def token_counts(batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """[M] fp32: each model's non-masked tokens over the step's micro-batches (the N of the
    ordinary run's mean token loss, `trainer.feed.weighting.MeanTokenLoss`)."""
    total = sum((b["labels"] != IGNORE_INDEX).sum(dim=(1, 2)).to(torch.float64) for b in batches)
    return torch.as_tensor(total, dtype=torch.float32)
