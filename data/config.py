"""The `data` section of an experiment: where each domain's text comes from, how it is
tokenized and stored, and how training batches are drawn from the domains."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from data.errors import DataError

#: A domain weight: an int or a float, never a bool or a string (the "number" tag is
#: trainer.config.tools.NUMBER; `[true, false, true]` must not train on weights 1, 0, 1).
Weight = Annotated[float, "number"]
#: The forms of a mixture: `uniform`, `tokens`, a weights JSON path, a list in domain order, or
#: a mapping domain -> weight (data.sampling.weights.resolve_weights).
#: A file-system path, read against the current directory and saved absolute in a run's
#: config.yaml (the "path" tag is trainer.config.tools.PATH).
PathStr = Annotated[str, "path"]
#: A path when one exists there, else a name (`uniform`; a hub tokenizer): trainer.config.tools.PATH_OR_NAME.
PathOrName = Annotated[str, "path or name"]
Weights = PathOrName | list[Weight] | dict[str, Weight]


@dataclass
class SyntheticSpec:
    """A generated domain whose per-token entropy is known exactly (recorded in the manifest).

    kind: `noise` (uniform over `vocab` symbols: entropy log(vocab)), `repeat` (a fixed short
    pattern repeated: entropy ~0), `markov` (a sparse order-`order` Markov chain with `branching`
    successors per context: learnable but hard).
    """

    # The generator: `noise`, `repeat` or `markov` (above).
    kind: Literal["noise", "repeat", "markov"]
    # Tokens generated (before the train/validation split).
    num_tokens: int = 200_000
    # Distinct symbols the generator draws from.
    vocab: int = 64
    # `markov`: tokens of context that determine the next token's successors.
    order: int = 2
    # `markov`: successors each context may be followed by.
    branching: int = 4
    # Seed of the generator (the same seed gives the same tokens).
    seed: int = 0
    # Generated tokens are cut into documents of this many tokens (EOS between them).
    doc_tokens: int = 1024

    def validate(self, path: str = "synthetic") -> None:
        for name in ("num_tokens", "vocab", "order", "branching", "doc_tokens"):
            if getattr(self, name) < 1:
                raise DataError(f"{path}.{name}: expected a positive int, got {getattr(self, name)}")
        if self.kind == "markov" and self.branching > self.vocab:
            raise DataError(f"{path}.branching: expected at most vocab={self.vocab}, got {self.branching}")


@dataclass
class DomainSource:
    """One domain: local files (jsonl/json/parquet/txt/arrow) read through `datasets`, a hub
    dataset name (when online), the embedded quickstart corpus, or a synthetic generator."""

    # The domain's name in stores, weights and reports (no '/', no leading '.').
    name: str
    # Local files or globs (jsonl/json/parquet/txt/arrow), read in order.
    paths: list[PathStr] = field(default_factory=list)
    # A Hugging Face hub dataset name (needs network access).
    hub: str | None = None
    # The hub dataset's split to read.
    hub_split: str = "train"
    # The hub dataset's configuration (`datasets.load_dataset(name=...)`: `wikitext-103-raw-v1`
    # of `wikitext`); None: its default.
    hub_config: str | None = None
    # The hub dataset's revision (commit, tag or branch), recorded in the stores' fingerprint: an
    # upstream change is then a new revision, never other stores under the same fingerprint.
    # None: whatever the default branch holds when read (not pinned).
    hub_revision: str | None = None
    # Read the hub dataset as a stream: nothing is downloaded whole, `max_documents` stops the
    # reads early; the rows are read twice (a first pass counts them for the split).
    hub_streaming: bool = False
    # None: the data section's `text_field`.
    text_field: str | None = None
    # A domain of the embedded quickstart corpus (data/corpus), by name.
    embedded: str | None = None
    # A generated domain (see SyntheticSpec).
    synthetic: SyntheticSpec | None = None
    # Read at most this many documents; None: all.
    max_documents: int | None = None
    # How a .txt file becomes documents: the whole file, each paragraph, or each line.
    sample_by: Literal["document", "paragraph", "line"] = "document"


@dataclass
class TokenizerConfig:
    """`byte` needs no files; `bpe` is trained on the corpus; `file` loads a tokenizer.json;
    `hf` loads a Hugging Face tokenizer by local path or (online) by name."""

    # `byte`, `bpe`, `file` or `hf` (above).
    kind: Literal["byte", "bpe", "file", "hf"] = "byte"
    # `bpe`: the vocabulary size to train (>= 258: 256 bytes, EOS and merges); ignored otherwise.
    vocab_size: int = 4096
    # `file`: a tokenizer.json; `hf`: a local directory or a hub name.
    path: PathOrName | None = None
    # The end-of-document token of a `file`/`hf` tokenizer; None: the first known one it has
    # (<|endoftext|>, <|end_of_text|>, </s>, <eos>, [SEP]).
    eos_token: str | None = None
    # `bpe`: train on at most this many UTF-8 bytes of the train split, shared among the text
    # domains by `train_shares` (documents of each domain in order).
    train_max_bytes: int = 200_000_000
    # `equal`: each text domain an equal share of the bytes (a domain with less gives all it
    # has); or a mapping domain -> relative share. Taking the first bytes in domain order would
    # leave the later domains out of the vocabulary.
    train_shares: str | dict[str, float] = "equal"
    # `file`/`hf`: a tokenizer whose post-processor puts a special token first (Llama 3's
    # <|begin_of_text|>) was pretrained with it, so the stores hold it before every document
    # and the export adds it; false: neither (the tokenizer is used without that template).
    # No effect on `byte` and `bpe`, which have no BOS.
    add_bos: bool = True


def _validate_tokenizer_training(tok: TokenizerConfig, names: list[str], path: str) -> None:
    """The bpe training budget and `train_shares`: 'equal', or shares >= 0 (not all 0) for
    domains that exist."""
    if tok.train_max_bytes < 1:
        raise DataError(f"{path}.tokenizer.train_max_bytes: expected >= 1, got {tok.train_max_bytes}")
    if isinstance(tok.train_shares, str) and tok.train_shares != "equal":
        raise DataError(
            f"{path}.tokenizer.train_shares: expected 'equal' or a mapping domain -> share, got {tok.train_shares!r}"
        )
    if isinstance(tok.train_shares, dict):
        unknown = sorted(set(tok.train_shares) - set(names))
        bad = [
            f"{d}={v}"
            for d, v in tok.train_shares.items()
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0
        ]
        if unknown or bad or not sum(v for v in tok.train_shares.values() if not bad) > 0:
            raise DataError(
                f"{path}.tokenizer.train_shares: expected shares >= 0 (not all 0) for known "
                f"domains; unknown: {', '.join(unknown) or '-'}; bad: {', '.join(bad) or '-'}"
            )


@dataclass
class DataConfig:
    """Paths (store_dir, data files, weights files) are read against the current directory."""

    # The domains, in the order every weight list and report uses.
    domains: list[DomainSource] = field(default_factory=list)
    # One dataset holding every domain, split by a column instead of one source per domain:
    # files or globs, all of one format. Its domains are the column's values.
    dataset: list[PathStr] = field(default_factory=list)
    # The column of `dataset` that names each document's domain (required with `dataset`); a
    # dotted name is a field of a struct column (The Pile's `meta.pile_set_name`).
    domain_column: str | None = None
    # The field of a record that holds its text (a domain's `text_field` overrides it).
    text_field: str = "text"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # Where `doremi preprocess` writes the token stores and their manifest.json.
    store_dir: PathStr = "runs/stores"
    # Share of each domain's documents held out for validation.
    validation_fraction: float = 0.05
    # Seed of the train/validation split and of the holdout.
    split_seed: int = 1234
    # Worker processes that tokenize.
    num_proc: int = 2
    # Token file dtype; `auto`: uint16 when the vocabulary fits, else uint32.
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    # Tokens per training sequence (at most model.max_seq_len).
    seq_len: int = 256
    # `uniform`, `tokens` (proportional to train tokens), a weights JSON path, or a list of
    # values in domain order / a mapping from domain name to value.
    domain_weights: Weights = "uniform"
    # No run reads a domain more than this many epochs of its sampler pool (its train sequences
    # less the holdout), whatever chooses its mixture: the sampler stops a domain at
    # floor(max_epochs x pool) sequences and hands its share to the other domains in proportion
    # (data/sampling/sampler.py), and a fixed mixture (`domain_weights`) is capped ahead of the
    # run at (max_epochs x pool - 1) / (steps x batch) the same way (data/sampling/mixtures.py
    # sequence_capped); a run that needs more than the pools hold at this cap is refused before
    # step 0. None: no cap.
    max_epochs: float | None = None
    # Seed of the sampler's draw order.
    seed: int = 0
    # Training sequences per domain held back from every run (chosen by split_seed), on which
    # a run's final evaluation measures memorisation (loss on held-back vs on as many trained-on
    # sequences); 0: off. The gap's noise falls as 1/sqrt(this): hundreds for a 0.05-nat check.
    holdout_sequences: int = 0
    # `none`: every consumer reads the whole validation split. `dev_test`: each domain's
    # validation documents are split by document (fixed by split_seed) into a dev half that
    # methods, sweeps and fits read and a test half the verdict is computed on
    # (data/store/validation_split.py, docs/design.md 3b).
    validation_split: Literal["none", "dev_test"] = "none"
    # `dev_test`: share of each domain's validation documents in the dev half.
    dev_fraction: float = 0.5

    def validate(self, path: str = "data") -> None:
        names = [d.name for d in self.domains]
        for n in names:
            if names.count(n) > 1:
                raise DataError(f"{path}.domains: domain {n!r} is named twice")
        for i, d in enumerate(self.domains):
            self._validate_domain(f"{path}.domains[{i}]", d, path)
        if self.dataset and not self.domain_column:
            raise DataError(f"{path}.domain_column: required when {path}.dataset is set")
        if not self.domains and not self.dataset:
            raise DataError(f"{path}.domains: expected at least one domain, got none")
        tok = self.tokenizer
        if tok.kind == "bpe" and tok.vocab_size < 258:
            raise DataError(
                f"{path}.tokenizer.vocab_size: expected >= 258 for bpe (256 bytes + EOS + merges), got {tok.vocab_size}"
            )
        if tok.kind in ("file", "hf") and not tok.path:
            raise DataError(f"{path}.tokenizer.path: required for kind {tok.kind!r}")
        self._validate_ranges(path)
        _validate_tokenizer_training(tok, names, path)
        if self.num_proc < 1:
            raise DataError(f"{path}.num_proc: expected >= 1, got {self.num_proc}")

    def _validate_domain(self, where: str, d: DomainSource, path: str) -> None:
        """One domain: a usable name, exactly one source (or the shared dataset's column) and
        hub options only with a hub source."""
        if not d.name or "/" in d.name or d.name.startswith("."):
            raise DataError(f"{where}.name: expected a non-empty name without '/' or a leading '.', got {d.name!r}")
        given = [k for k in ("paths", "hub", "embedded", "synthetic") if getattr(d, k)]
        if len(given) > 1:
            raise DataError(f"{where} ({d.name}): expected one source, got {' and '.join(given)}")
        if not given and not self.dataset:
            raise DataError(
                f"{where} ({d.name}): no source (paths, hub, embedded or synthetic) "
                f"and no {path}.dataset with a domain column"
            )
        if d.max_documents is not None and d.max_documents < 1:
            raise DataError(f"{where}.max_documents: expected >= 1, got {d.max_documents}")
        hub_only = [k for k in ("hub_config", "hub_revision", "hub_streaming") if getattr(d, k)]
        if hub_only and not d.hub:
            raise DataError(f"{where} ({d.name}): {', '.join(hub_only)} set without a hub dataset (hub)")

    def _validate_ranges(self, path: str) -> None:
        """The numeric keys' ranges, in the order the errors have always been checked."""
        if not 0.0 <= self.validation_fraction < 1.0:
            raise DataError(f"{path}.validation_fraction: expected a value in [0, 1), got {self.validation_fraction}")
        if self.seq_len < 2:
            raise DataError(f"{path}.seq_len: expected >= 2, got {self.seq_len}")
        if self.holdout_sequences < 0:
            raise DataError(f"{path}.holdout_sequences: expected >= 0, got {self.holdout_sequences}")
        if self.max_epochs is not None and not 0 < self.max_epochs < float("inf"):
            raise DataError(f"{path}.max_epochs: expected a finite value > 0, got {self.max_epochs}")
        if not 0.0 < self.dev_fraction < 1.0:
            raise DataError(f"{path}.dev_fraction: expected a value in (0, 1), got {self.dev_fraction}")
