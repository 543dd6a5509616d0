"""Fixed-length packed sequences within each domain.

A domain's split is one token stream (doc0 EOS doc1 EOS ...). Sequence i covers tokens
[i*seq_len, i*seq_len + seq_len + 1): inputs are its first seq_len tokens, labels its last
seq_len, so consecutive sequences share one token and every token is a label once (GPT-style
packing across document boundaries). With `pad_last`, a final partial sequence is kept and
padded with PAD (-1), which `data.store.batch.collate` turns into ignored labels.
"""

from __future__ import annotations

import numpy as np

from data.errors import DataError
from data.store.store import TokenStores, check_split

PAD = -1


def packed_count(tokens: int, seq_len: int, pad_last: bool = False) -> int:
    """Sequences of `seq_len` (+1) packed from a stream of `tokens` tokens: (tokens - 1) //
    seq_len, one more for a padded partial last sequence under `pad_last`."""
    n = int(tokens) - 1
    if n <= 0:
        return 0
    return -(-n // seq_len) if pad_last else n // seq_len


class PackedDomains:
    def __init__(self, stores: TokenStores, split: str, seq_len: int, pad_last: bool | None = None):
        """`pad_last` defaults to True for validation (use every token) and False for train."""
        check_split(split)
        if seq_len < 1:
            raise DataError(f"seq_len: expected >= 1, got {seq_len}")
        self.stores = stores
        self.split = split
        self.seq_len = seq_len
        self.pad_last = (split != "train") if pad_last is None else pad_last
        self.domains = stores.domains
        self.eos_id = stores.eos_id
        self._tokens = [stores.tokens(d, split) for d in self.domains]

    @property
    def num_domains(self) -> int:
        return len(self.domains)

    def num_sequences(self, domain_index: int) -> int:
        return packed_count(len(self._tokens[domain_index]), self.seq_len, self.pad_last)

    def sequence(self, domain_index: int, i: int) -> np.ndarray:
        """seq_len + 1 tokens as int64 (PAD after the end of a padded last sequence)."""
        count = self.num_sequences(domain_index)
        if not 0 <= i < count:
            raise IndexError(
                f"sequence {i} of domain {self.domains[domain_index]!r} ({self.split}): expected 0 <= i < {count}"
            )
        start = i * self.seq_len
        chunk = np.asarray(self._tokens[domain_index][start : start + self.seq_len + 1], dtype=np.int64)
        if len(chunk) < self.seq_len + 1:
            chunk = np.concatenate([chunk, np.full(self.seq_len + 1 - len(chunk), PAD, np.int64)])
        return chunk
