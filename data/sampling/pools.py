"""Each domain's sampler pool: its train split packed at `data.seq_len`, less the sequences held
back (data/sampling/holdout.py). A run reads epochs in this unit (data/sampling/sampler.py), so it
is what every epoch count and cap counts in: `data.max_epochs` (the sampler's `cursor_caps`, and
data/sampling/mixtures.py `sequence_capped`), `sweep.max_epochs` and `fit.max_epochs`
(doremi/offline/sweep.py `sequence_caps`) and the guardrails' epochs of a stacked sweep run. One
owner, so that the sampler's pools and every count of them agree; a pool holds fewer tokens than
its domain (the holdout, and the stream's tail shorter than a window)."""

from __future__ import annotations

import numpy as np

from data.config import DataConfig
from data.sampling.holdout import check_holdout, holdout_split
from data.store.dataset import PackedDomains, packed_count
from data.store.store import open_stores


def pool_size(train_tokens: int, seq_len: int, holdout: int, domain: str = "") -> int:
    """Sequences in the pool of a domain of `train_tokens` train tokens (the manifest's count)."""
    n = packed_count(train_tokens, seq_len)
    check_holdout(n, holdout, domain)
    return n - holdout


def train_splits(train: PackedDomains, data: DataConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per domain (pool, held): the packed train sequences a run's sampler draws from, and those
    held back from every run (`data.holdout_sequences`)."""
    return [
        holdout_split(train.num_sequences(i), data.holdout_sequences, data.split_seed, name)
        for i, name in enumerate(train.domains)
    ]


def pool_sizes(data: DataConfig) -> list[int]:
    """Sequences in each domain's sampler pool of a run under `data`, as trainer/feed/data_feed.py
    `DataFeed` builds it (`train_splits`), from the stores' manifest."""
    manifest = open_stores(data.store_dir).manifest
    return [pool_size(d.train.tokens, data.seq_len, data.holdout_sequences, d.name) for d in manifest.domains]
