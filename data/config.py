"""The `data` section of an experiment: where each domain's text comes from, how it is
tokenized and stored, and how training batches are drawn from the domains."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from data.errors import DataError


@dataclass
class SyntheticSpec:
    """A generated domain whose per-token entropy is known exactly (recorded in the manifest).

    kind: `noise` (uniform over `vocab` symbols: entropy log(vocab)), `repeat` (a fixed short
    pattern repeated: entropy ~0), `markov` (a sparse order-`order` Markov chain with `branching`
    successors per context: learnable but hard).
    """

    kind: Literal["noise", "repeat", "markov"]
    num_tokens: int = 200_000
    vocab: int = 64
    order: int = 2
    branching: int = 4
    seed: int = 0


@dataclass
class DomainSource:
    """One domain: local files (jsonl/json/parquet/txt/arrow) read through `datasets`, a hub
    dataset name (when online), the embedded quickstart corpus, or a synthetic generator."""

    name: str
    paths: list[str] = field(default_factory=list)
    hub: str | None = None
    hub_split: str = "train"
    text_field: str = "text"
    embedded: str | None = None
    synthetic: SyntheticSpec | None = None
    max_documents: int | None = None


@dataclass
class TokenizerConfig:
    """`byte` needs no files; `bpe` is trained on the corpus; `file` loads a tokenizer.json;
    `hf` loads a Hugging Face tokenizer by local path or (online) by name."""

    kind: Literal["byte", "bpe", "file", "hf"] = "byte"
    vocab_size: int = 4096
    path: str | None = None


@dataclass
class DataConfig:
    domains: list[DomainSource] = field(default_factory=list)
    # One dataset holding every domain, split by a column instead of one source per domain.
    dataset: list[str] = field(default_factory=list)
    domain_column: str | None = None
    text_field: str = "text"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    store_dir: str = "runs/stores"
    validation_fraction: float = 0.05
    split_seed: int = 1234
    num_proc: int = 2
    seq_len: int = 256
    # `uniform`, `tokens` (proportional to train tokens), a weights JSON path, or a list of
    # values in domain order / a mapping from domain name to value.
    domain_weights: str | list[float] | dict[str, float] = "uniform"
    seed: int = 0

    def validate(self, path: str = "data") -> None:
        names = [d.name for d in self.domains]
        for n in names:
            if names.count(n) > 1:
                raise DataError(f"{path}.domains: domain {n!r} is named twice")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise DataError(f"{path}.validation_fraction: expected a value in [0, 1), got {self.validation_fraction}")
        if self.seq_len < 2:
            raise DataError(f"{path}.seq_len: expected >= 2, got {self.seq_len}")
        if self.num_proc < 1:
            raise DataError(f"{path}.num_proc: expected >= 1, got {self.num_proc}")
