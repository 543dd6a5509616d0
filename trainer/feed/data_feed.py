"""The trainer's view of the data: this rank's micro-batches for a step, drawn from the token
stores with the step's domain weights, and the per-domain validation batches."""

from __future__ import annotations

from typing import Any

import numpy as np

from data.config import DataConfig
from data.errors import DataError
from data.preprocess.preprocess import check_stores_match
from data.sampling.pools import train_splits
from data.sampling.sampler import DomainBatchSampler, cursor_caps, interleave
from data.store.batch import collate
from data.store.dataset import PackedDomains
from data.store.store import open_stores
from data.store.validation import validation_items
from data.store.validation_split import ALL, sequence_documents, split_for, validation_view
from trainer.config.tools import ConfigError
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
        check_stores_match(data, self.manifest)
        self.domains: list[str] = list(self.stores.domains)
        self.train = PackedDomains(self.stores, "train", data.seq_len)
        counts = [self.train.num_sequences(i) for i in range(len(self.domains))]
        splits = train_splits(self.train, data)
        self.heldout = [held for _, held in splits]
        pools = [pool for pool, _ in splits]
        #: `data.max_epochs`, which caps every run's draws (fixed or changing mixtures alike).
        self.max_epochs = data.max_epochs
        caps = None if data.max_epochs is None else cursor_caps([len(p) for p in pools], data.max_epochs)
        self.sampler = DomainBatchSampler(counts, global_batch_size, seed, pools=pools, caps=caps, names=self.domains)
        self.validation_split = data.validation_split
        self._val_args = (data.seq_len, data.dev_fraction, data.split_seed)
        self._views: dict[str, tuple[PackedDomains, list[np.ndarray], list[np.ndarray]]] = {}
        if data.validation_split != "none":
            for half in ("dev", "test"):  # a domain too small to split fails here, before any step
                self._view(half)
        self._val_cache: dict[tuple[str, int, int], list[list[dict]]] = {}
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
        exact counts or random draws (`data.sampling.sampler`)."""
        local = self.sampler.local(step - 1, weights, self.pc.dp_rank, self.pc.dp, self.micro_batches, draws)
        return [collate(self.train, items, device=self.pc.device) for items in local]

    def check_allowance(self, steps: int) -> None:
        """Refuse, before step 0, a run of `steps` global batches that asks for more sequences
        than its pools hold at `data.max_epochs` (the sampler would stop at the step the last
        pool ran out, after spending the compute before it)."""
        caps, b = self.sampler.caps, self.sampler.global_batch_size
        if caps is None or sum(caps) >= steps * b:
            return
        e = self.max_epochs
        raise DataError(
            f"data.max_epochs {e:g}: the pools hold {sum(caps)} sequences at {e:g} epochs each, fewer than "
            f"train.steps x train.global_batch_size = {steps} x {b} = {steps * b}; raise data.max_epochs, "
            f"add data or shorten the run"
        )

    def drawn_weights(self, asked: np.ndarray) -> np.ndarray:
        """The weights the step drawn last was drawn with: `asked`, unless the epoch caps moved
        them (data/sampling/sampler.py), so that a method learns what it was given."""
        return self.sampler.weights if self.sampler.capped else asked

    def exhausted(self) -> dict[str, int | None] | None:
        """Per domain, the step at which it was read to `data.max_epochs` (None: not yet); None
        without a cap."""
        if self.sampler.caps is None:
            return None
        return {name: self.sampler.exhausted.get(d) for d, name in enumerate(self.domains)}

    def _view(self, half: str) -> tuple[PackedDomains, list[np.ndarray], list[np.ndarray]]:
        """(packed sequences, stream offsets, document ids) of a validation half, or of `all`."""
        if half not in self._views:
            seq_len, fraction, seed = self._val_args
            self._views[half] = validation_view(self.stores, seq_len, half, fraction, seed)
        return self._views[half]

    def validation_half(self, consumer: str) -> str:
        """The validation documents `consumer` reads: `all`, `dev` or `test`
        (data.store.validation_split.CONSUMERS)."""
        return split_for(consumer, self.validation_split)

    def _num_validation(self, d: int, half: str, sequences: int) -> int:
        n = self._view(half)[0].num_sequences(d)
        if n == 0:
            where = "data.validation_fraction" if half == ALL else f"data.validation_split ({half} half)"
            raise DataError(
                f"{where}: domain {self.domains[d]!r} has no validation sequences in "
                f"{self.stores.store_dir}; evaluation needs some"
            )
        return min(n, sequences) if sequences else n

    def validation(self, batch_size: int, sequences: int, consumer: str) -> list[list[dict]]:
        """Per domain, the first `sequences` sequences (0: all) of the validation documents
        `consumer` reads, in batches of `batch_size`: the same tokens whatever the layout, so
        validation losses compare."""
        half = self.validation_half(consumer)
        key = (half, batch_size, sequences)
        if key not in self._val_cache:
            view = self._view(half)[0]
            self._val_cache[key] = [
                [
                    collate(view, items, device=self.pc.device)
                    for items in validation_items(self._num_validation(d, half, sequences), d, batch_size)
                ]
                for d in range(self.k)
            ]
        return self._val_cache[key]

    def validation_tokens(self, sequences: int, consumer: str) -> int:
        """Tokens one evaluation pass of `validation` forwards, over all domains: what a study's
        compute ledger counts (doremi/reports/ledger.py), logged because a run's half of the
        validation documents is known only while its stores are."""
        half = self.validation_half(consumer)
        view = self._view(half)[0]
        return sum(self._num_validation(d, half, sequences) for d in range(self.k)) * view.seq_len

    def validation_documents(self, sequences: int, consumer: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per domain, the (first, last) validation document id of each sequence `validation`
        gives `consumer` (data.store.validation_split.sequence_documents): what per-sequence losses
        are clustered by."""
        half = self.validation_half(consumer)
        view, offsets, ids = self._view(half)
        return [
            sequence_documents(
                offsets[d], ids[d], self._num_validation(d, half, sequences), view.seq_len, offsets[d][-1]
            )
            for d in range(self.k)
        ]

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
        view = self._view(self.validation_half("method_target"))[0]
        for d, c in enumerate(counts):
            n = view.num_sequences(d)
            if c and not n:
                raise DataError(f"target mixture: domain {self.domains[d]!r} has no validation sequences")
            picks[d] = iter(rng.integers(0, max(n, 1), size=int(c)).tolist())
        items = [(d, next(picks[d])) for d in interleave([int(c) for c in counts])]
        start, stop = (sequences * r // self.pc.dp for r in (self.pc.dp_rank, self.pc.dp_rank + 1))
        mine = items[start:stop]
        return [collate(view, mine[j : j + batch_size], device=self.pc.device) for j in range(0, len(mine), batch_size)]

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
