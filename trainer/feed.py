"""The trainer's view of the data: this rank's micro-batches for a step, drawn from the token
stores with the step's domain weights, and the per-domain validation batches."""

from __future__ import annotations

from typing import Any

import numpy as np

from data.batch import collate
from data.config import DataConfig
from data.dataset import PackedDomains
from data.errors import DataError
from data.holdout import holdout_split
from data.sampler import DomainBatchSampler, interleave
from data.store import open_stores
from data.validation import validation_items
from trainer.configtools import ConfigError
from trainer.parallel.context import ParallelContext

#: Separates the generator of target draws from the sampler's.
TARGET_DRAWS = 0x7A6E


class DataFeed:
    def __init__(
        self,
        data: DataConfig,
        global_batch_size: int,
        micro_batches: int,
        pc: ParallelContext,
        seed: int,
        expect_tokenizer: dict | None = None,
    ):
        self.pc = pc
        self.seed = seed
        self.micro_batches = micro_batches
        self.stores = open_stores(data.store_dir, expect_tokenizer=expect_tokenizer)
        self.manifest = self.stores.manifest
        self.domains: list[str] = list(self.stores.domains)
        self.train = PackedDomains(self.stores, "train", data.seq_len)
        counts = [self.train.num_sequences(i) for i in range(len(self.domains))]
        splits = [
            holdout_split(n, data.holdout_sequences, data.split_seed, name) for n, name in zip(counts, self.domains)
        ]
        self.heldout = [held for _, held in splits]
        self.sampler = DomainBatchSampler(counts, global_batch_size, seed, pools=[pool for pool, _ in splits])
        self._val = PackedDomains(self.stores, "validation", data.seq_len)
        self._val_cache: dict[tuple[int, int], list[list[dict]]] = {}
        self._heldout_cache: dict[int, list[list[dict]]] = {}

    def check_vocab(self, model_vocab: int) -> None:
        vocab = int(self.manifest.tokenizer["vocab_size"])
        if model_vocab < vocab:
            raise ConfigError(
                f"model.vocab_size: expected >= {vocab} (the tokenizer of the stores in "
                f"{self.stores.store_dir}), got {model_vocab}"
            )

    @property
    def k(self) -> int:
        return len(self.domains)

    def step_batches(self, step: int, weights: np.ndarray, draws: str = "exact") -> list[dict]:
        """This rank's micro-batches of global batch `step` (1-based), on the device, drawn as
        exact counts or random draws (`data.sampler`)."""
        local = self.sampler.local(step - 1, weights, self.pc.dp_rank, self.pc.dp, self.micro_batches, draws)
        return [collate(self.train, items, device=self.pc.device) for items in local]

    def validation(self, batch_size: int, sequences: int) -> list[list[dict]]:
        """Per domain, its first `sequences` validation sequences (0: all) in batches of
        `batch_size`: the same tokens whatever the layout, so validation losses compare."""
        key = (batch_size, sequences)
        if key not in self._val_cache:
            per_domain = []
            for d in range(self.k):
                n = self._val.num_sequences(d)
                if n == 0:
                    raise DataError(
                        f"data.validation_fraction: domain {self.domains[d]!r} has no validation "
                        f"sequences in {self.stores.store_dir}; evaluation needs some"
                    )
                n = min(n, sequences) if sequences else n
                per_domain.append(
                    [collate(self._val, items, device=self.pc.device) for items in validation_items(n, d, batch_size)]
                )
            self._val_cache[key] = per_domain
        return self._val_cache[key]

    def target_batches(self, step: int, weights: np.ndarray, sequences: int, batch_size: int) -> list[dict]:
        """This rank's part of `sequences` validation sequences drawn for `step` from the mixture
        `weights` (a method's target, e.g. DoGE's): counts multinomial, each index uniform over
        its domain's validation sequences, from `default_rng([seed, TARGET_DRAWS, step])`, so the
        draw depends on the seed and step only; cut into dp contiguous parts as equal as they can
        be (a rank may get none: the gradient is a sum over ranks), in micro-batches of at most
        `batch_size`."""
        rng = np.random.default_rng([self.seed, TARGET_DRAWS, step])
        counts = rng.multinomial(sequences, weights)
        picks = {}
        for d, c in enumerate(counts):
            n = self._val.num_sequences(d)
            if c and not n:
                raise DataError(f"target mixture: domain {self.domains[d]!r} has no validation sequences")
            picks[d] = iter(rng.integers(0, max(n, 1), size=int(c)).tolist())
        items = [(d, next(picks[d])) for d in interleave([int(c) for c in counts])]
        start, stop = (sequences * r // self.pc.dp for r in (self.pc.dp_rank, self.pc.dp_rank + 1))
        mine = items[start:stop]
        return [
            collate(self._val, mine[j : j + batch_size], device=self.pc.device) for j in range(0, len(mine), batch_size)
        ]

    @property
    def holdout(self) -> int:
        """Training sequences held back per domain (data.holdout_sequences)."""
        return len(self.heldout[0]) if self.heldout else 0

    def heldout_batches(self, batch_size: int) -> list[list[dict]]:
        """Per domain, its held-back training sequences (never drawn by any run)."""
        if batch_size not in self._heldout_cache:
            self._heldout_cache[batch_size] = [
                [
                    collate(self.train, [(d, int(i)) for i in held[j : j + batch_size]], device=self.pc.device)
                    for j in range(0, len(held), batch_size)
                ]
                for d, held in enumerate(self.heldout)
            ]
        return self._heldout_cache[batch_size]

    def seen_batches(self, batch_size: int) -> list[list[dict]]:
        """Per domain, as many sequences as are held back, at evenly spaced positions of the
        stream this run has drawn so far (early and recent draws alike; all of them while the
        run has drawn fewer)."""
        out = []
        for d in range(self.k):
            drawn = self.sampler.cursors[d]
            m = min(self.holdout, drawn)
            positions = [drawn * j // m for j in range(m)]
            seen = [self.sampler.stream(d, pos, 1)[0] for pos in positions]
            out.append(
                [
                    collate(self.train, [(d, i) for i in seen[j : j + batch_size]], device=self.pc.device)
                    for j in range(0, len(seen), batch_size)
                ]
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
