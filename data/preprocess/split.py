"""Train/validation split by documents, fixed by (seed, domain name) alone."""

from __future__ import annotations

import zlib

import numpy as np


def validation_count(num_documents: int, fraction: float) -> int:
    """round(fraction x n), but at least one validation and one train document when n >= 2
    and fraction > 0."""
    if fraction <= 0 or num_documents < 2:
        return 0
    return min(max(1, round(fraction * num_documents)), num_documents - 1)


def validation_mask(num_documents: int, fraction: float, seed: int, domain: str) -> np.ndarray:
    """Boolean mask over documents: True for validation. Independent per domain (the seed is
    mixed with a CRC of the domain name) and of how documents are later batched."""
    mask = np.zeros(num_documents, dtype=bool)
    k = validation_count(num_documents, fraction)
    if k:
        rng = np.random.default_rng([seed, zlib.crc32(domain.encode("utf-8"))])
        mask[rng.permutation(num_documents)[:k]] = True
    return mask
