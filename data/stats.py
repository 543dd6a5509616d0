"""Statistics of the token stores."""

from __future__ import annotations

from data.store import TokenStores
from data.synthetic import empirical_entropy


def unigram_entropy(stores: TokenStores, domain: str, split: str = "validation") -> float:
    """Plug-in unigram entropy (nats/token) of a domain's documents: the loss of the best model
    that ignores context, so a language model that learned anything must go below it."""
    n = len(stores.documents(domain, split)) - 1
    return empirical_entropy([stores.document(domain, split, i) for i in range(n)], order=0)
