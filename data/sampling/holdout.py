"""Training sequences held back from every run, to measure memorisation.

A model's loss on sequences it trained on, against its loss on sequences of the same domain's
training split that it never saw, separates memorisation from any shift between the train and
validation splits (the validation split may differ in kind: other files, other documents). The
held-back sequences depend only on the stores (their split seed and the domain's name), never
on a run's seed, so that the reference, the proxy and every main run hold back the same ones
and none of them ever draws them.
"""

from __future__ import annotations

import zlib

import numpy as np

from data.errors import DataError

#: At most this share of a domain's training sequences is held back.
MAX_SHARE = 0.25


def check_holdout(num_sequences: int, count: int, domain: str, where: str = "data.holdout_sequences") -> None:
    """Refuse a holdout below 0 or above `MAX_SHARE` of the domain's training sequences."""
    if count < 0:
        raise DataError(f"{where}: expected >= 0, got {count}")
    if count and count > MAX_SHARE * num_sequences:
        raise DataError(
            f"{where}: domain {domain!r} has {num_sequences} training sequences; holding "
            f"back {count} leaves too few (at most {int(MAX_SHARE * num_sequences)} allowed)"
        )


def holdout_split(
    num_sequences: int, count: int, split_seed: int, domain: str, where: str = "data.holdout_sequences"
) -> tuple[np.ndarray, np.ndarray]:
    """(pool, held): the sorted sequence indices runs may draw, and the `count` held back."""
    check_holdout(num_sequences, count, domain, where)
    if count == 0:
        return np.arange(num_sequences, dtype=np.int64), np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([split_seed, zlib.crc32(domain.encode("utf-8"))])
    held = np.sort(rng.choice(num_sequences, size=count, replace=False)).astype(np.int64)
    keep = np.ones(num_sequences, dtype=bool)
    keep[held] = False
    return np.flatnonzero(keep).astype(np.int64), held
