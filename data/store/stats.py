"""Statistics of tokens: the plug-in entropy of documents at any order, and the unigram entropy of
a store's domain (the loss that a model which learned anything must go below)."""

from __future__ import annotations

import numpy as np

from data.errors import DataError
from data.store.store import TokenStores


def unigram_entropy(stores: TokenStores, domain: str, split: str = "validation") -> float:
    """Plug-in unigram entropy (nats/token) of a domain's documents: the loss of the best model
    that ignores context, so a language model that learned anything must go below it."""
    n = len(stores.documents(domain, split)) - 1
    return empirical_entropy([stores.document(domain, split, i) for i in range(n)], order=0)


def empirical_entropy(documents: list[np.ndarray], order: int) -> float:
    """Plug-in conditional entropy H(x_t | previous `order` tokens) in nats, counted within
    documents (order 0: the unigram entropy)."""
    rows = []
    for doc in documents:
        doc = np.asarray(doc, dtype=np.int64)
        if len(doc) > order:
            rows.append(np.stack([doc[j : len(doc) - order + j] for j in range(order + 1)], axis=1))
    if not rows:
        raise DataError("empirical_entropy: no document longer than the order")
    grams = np.concatenate(rows)
    _, joint = np.unique(grams, axis=0, return_counts=True)
    h_joint = _plugin(joint)
    if order == 0:
        return h_joint
    _, ctx = np.unique(grams[:, :-1], axis=0, return_counts=True)
    return h_joint - _plugin(ctx)


def _plugin(counts: np.ndarray) -> float:
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())
