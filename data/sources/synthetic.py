"""Synthetic domains whose per-token entropy is known exactly.

Each generator yields a stream of `num_tokens` symbols in [0, vocab), cut into documents of
`doc_tokens`. The recorded entropy is the entropy rate of the source in nats per token, i.e.
the loss of the Bayes-optimal predictor that has seen the preceding tokens:

- noise:  i.i.d. uniform symbols                       -> log(vocab)
- repeat: a fixed permutation of the vocab, repeated    -> 0
- markov: order-k chain, each context has `branching` distinct successors drawn uniformly
          (successor sets fixed by the seed)            -> log(branching)

Symbols map to token ids skipping the tokenizer's EOS (`symbol_ids`), so that the EOS written
between documents is never a synthetic symbol.
"""

from __future__ import annotations

import math

import numpy as np

from data.config import SyntheticSpec
from data.errors import DataError

MAX_MARKOV_TABLE = 1 << 25


def entropy(spec: SyntheticSpec) -> float:
    """Entropy rate in nats/token of the source `spec` describes."""
    if spec.kind == "noise":
        return math.log(spec.vocab)
    if spec.kind == "repeat":
        return 0.0
    if spec.kind == "markov":
        return math.log(spec.branching)
    raise DataError(f"synthetic.kind: expected noise, repeat or markov, got {spec.kind!r}")


def noise(spec: SyntheticSpec) -> np.ndarray:
    return np.random.default_rng(spec.seed).integers(0, spec.vocab, spec.num_tokens, dtype=np.int64)


def repeat(spec: SyntheticSpec) -> np.ndarray:
    pattern = np.random.default_rng(spec.seed).permutation(spec.vocab)
    return np.resize(pattern, spec.num_tokens).astype(np.int64)


def markov_table(spec: SyntheticSpec) -> np.ndarray:
    """[vocab**order, branching] successor symbols of each context (distinct per row)."""
    contexts = spec.vocab**spec.order
    if contexts * spec.vocab > MAX_MARKOV_TABLE:
        raise DataError(
            f"synthetic markov: vocab**(order+1) = {contexts * spec.vocab}, expected at most "
            f"{MAX_MARKOV_TABLE}; lower vocab or order"
        )
    rng = np.random.default_rng(spec.seed)
    # The `branching` smallest of per-row random keys: a uniform draw without replacement.
    keys = rng.random((contexts, spec.vocab), dtype=np.float32)
    return np.argpartition(keys, spec.branching - 1, axis=1)[:, : spec.branching].astype(np.int64)


def markov(spec: SyntheticSpec) -> np.ndarray:
    table = markov_table(spec)
    contexts = table.shape[0]
    rng = np.random.default_rng([spec.seed, 1])
    out = np.empty(spec.num_tokens, dtype=np.int64)
    start = rng.integers(0, spec.vocab, min(spec.order, spec.num_tokens))
    out[: len(start)] = start
    ctx = 0
    for s in start:
        ctx = (ctx * spec.vocab + int(s)) % contexts
    choices = rng.integers(0, spec.branching, spec.num_tokens).tolist()
    rows = table.tolist()
    for t in range(len(start), spec.num_tokens):
        nxt = rows[ctx][choices[t]]
        out[t] = nxt
        ctx = (ctx * spec.vocab + nxt) % contexts
    return out


GENERATORS = {"noise": noise, "repeat": repeat, "markov": markov}


def generate_documents(spec: SyntheticSpec) -> list[np.ndarray]:
    """The symbol stream cut into documents of `doc_tokens` (the last one may be shorter)."""
    stream = GENERATORS[spec.kind](spec)
    return [stream[i : i + spec.doc_tokens] for i in range(0, len(stream), spec.doc_tokens)]


def symbol_ids(symbols: np.ndarray, eos_id: int) -> np.ndarray:
    """Symbol s -> token id s, or s + 1 from the EOS id on (ids stay clear of EOS)."""
    return symbols + (symbols >= eos_id)


def check_fits(spec: SyntheticSpec, vocab_size: int, eos_id: int, where: str) -> None:
    top = int(symbol_ids(np.array([spec.vocab - 1]), eos_id)[0])
    if top >= vocab_size:
        raise DataError(
            f"{where}: synthetic vocab {spec.vocab} needs token ids up to {top}, but the tokenizer has {vocab_size} ids"
        )
