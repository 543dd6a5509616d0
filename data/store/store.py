"""Per-domain token stores: the on-disk format, the manifest, and a validated reader.

Layout of a store directory:

    manifest.json            Manifest (written last; its presence means the stores are complete),
                             with the stores' artifact header: every file's size and XXH3-64 hash
                             (data.artifact; checked once per file per process at open)
    tokenizer.json           the tokenizer the stores were built with
    <domain>/<split>.bin     flat little-endian uint16/uint32 tokens: doc0 EOS doc1 EOS ...
    <domain>/<split>.idx     little-endian int64 offsets, documents + 1 entries: document i is
                             tokens[idx[i]:idx[i+1]] and ends with its EOS

Splits are `train` and `validation`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from data import artifact
from data.errors import DataError

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "validation")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
INDEX_DTYPE = np.dtype("<i8")


def token_dtype(vocab_size: int, requested: str = "auto") -> str:
    """`uint16` when every id fits (vocab_size <= 65536), else `uint32`; a requested dtype that
    cannot hold the vocabulary is an error."""
    fits16 = vocab_size <= 1 << 16
    if requested == "auto":
        return "uint16" if fits16 else "uint32"
    if requested not in DTYPES:
        raise DataError(f"data.token_dtype: expected one of auto, uint16, uint32, got {requested!r}")
    if requested == "uint16" and not fits16:
        raise DataError(
            f"data.token_dtype: uint16 holds ids < 65536 but the tokenizer's vocabulary "
            f"has {vocab_size} ids; use uint32 or auto"
        )
    return requested


@dataclass(frozen=True)
class SplitCounts:
    tokens: int
    documents: int
    # UTF-8 bytes of the split's text (for bits per byte); None for synthetic domains.
    bytes: int | None = None


@dataclass
class DomainEntry:
    name: str
    source: str
    train: SplitCounts
    validation: SplitCounts
    # Entropy rate of the generating process in nats/token over document tokens (EOS excluded);
    # None for real text.
    entropy: float | None = None
    synthetic: dict[str, Any] | None = None

    def split(self, split: str) -> SplitCounts:
        check_split(split)
        return self.train if split == "train" else self.validation


@dataclass
class Manifest:
    domains: list[DomainEntry]
    tokenizer: dict[str, Any]
    dtype: str
    fingerprint: str
    sources: dict[str, str] = field(default_factory=dict)
    split: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    # What the fingerprint hashes, by part (data.preprocess.preprocess.fingerprint_inputs), so that a
    # rebuild from other inputs can name what changed; empty for stores of older versions.
    inputs: dict[str, Any] = field(default_factory=dict)
    # The artifact header (data.artifact.Header as JSON): the files' sizes and hashes; None for
    # stores built before headers.
    artifact: dict[str, Any] | None = None

    @property
    def domain_names(self) -> list[str]:
        return [d.name for d in self.domains]

    @property
    def entropies(self) -> list[float | None]:
        return [d.entropy for d in self.domains]

    def domain(self, name: str) -> DomainEntry:
        for d in self.domains:
            if d.name == name:
                return d
        raise DataError(f"unknown domain {name!r}; the stores have {', '.join(self.domain_names)}")

    def counts(self, split: str) -> list[SplitCounts]:
        return [d.split(split) for d in self.domains]

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the stores it was trained on, so that evaluating or
        resuming it against stores rebuilt from other inputs is refused, not silently wrong."""
        return {"fingerprint": self.fingerprint, "tokenizer": self.tokenizer}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_FILE) -> Manifest:
        try:
            raw = json.loads(text)
            domains = [
                DomainEntry(
                    name=d["name"],
                    source=d["source"],
                    train=SplitCounts(**d["train"]),
                    validation=SplitCounts(**d["validation"]),
                    entropy=d.get("entropy"),
                    synthetic=d.get("synthetic"),
                )
                for d in raw["domains"]
            ]
            return cls(
                domains=domains,
                tokenizer=raw["tokenizer"],
                dtype=raw["dtype"],
                fingerprint=raw["fingerprint"],
                sources=raw.get("sources", {}),
                split=raw.get("split", {}),
                version=raw["version"],
                inputs=raw.get("inputs", {}),
                artifact=raw.get(artifact.HEADER_KEY),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{where}: not a valid manifest ({type(e).__name__}: {e})") from None


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


def split_paths(store_dir: Path, domain: str, split: str) -> tuple[Path, Path]:
    return store_dir / domain / f"{split}.bin", store_dir / domain / f"{split}.idx"


def read_manifest(store_dir: str | os.PathLike) -> Manifest:
    path = Path(store_dir) / MANIFEST_FILE
    if not path.is_file():
        raise DataError(f"{path}: no manifest; build the stores with `doremi preprocess` first")
    manifest = Manifest.from_json(path.read_text(), str(path))
    if manifest.version != FORMAT_VERSION:
        raise DataError(
            f"{path}: format version {manifest.version}, this code reads version "
            f"{FORMAT_VERSION}; re-run `doremi preprocess`"
        )
    return manifest


def store_files(manifest: Manifest) -> list[str]:
    """The files of the stores, relative to the store directory."""
    names = [f"{d.name}/{split}.{ext}" for d in manifest.domains for split in SPLITS for ext in ("bin", "idx")]
    return [*names, "tokenizer.json"]


def write_manifest(store_dir: Path, manifest: Manifest) -> None:
    """Write the manifest with the stores' header: the files in place are hashed now."""
    present = [n for n in store_files(manifest) if (store_dir / n).is_file()]
    header = artifact.Header("stores", fingerprint=manifest.fingerprint, files=artifact.hash_files(store_dir, present))
    artifact.write(
        store_dir / MANIFEST_FILE, header, {k: v for k, v in dataclasses.asdict(manifest).items() if k != "artifact"}
    )
    manifest.artifact = header.to_json()  # with its `content`, set by the write


_unhashed_noted: set[str] = set()


def verify_contents(stores: TokenStores, once: bool = True) -> int:
    """Check every file's hash against the manifest's header (once per file per process with
    `once`) and every token id against the vocabulary; returns the bytes hashed. Stores built
    before hashes are not verified: one note per process says how to add them."""
    header = artifact.read(stores.store_dir)
    if header is None or not header.files:
        where = str(stores.store_dir)
        if where not in _unhashed_noted:
            _unhashed_noted.add(where)
            print(
                f"{where}: stores built before per-file hashes, contents not verified; "
                f"`doremi preprocess CONFIG` adds them",
                file=sys.stderr,
            )
        return 0
    artifact.check_content(stores.store_dir, "the stores' manifest")
    fresh = [n for n in header.files if not (once and artifact.verified(stores.store_dir / n, header.files[n]))]
    hashed = artifact.verify_files(stores.store_dir, header.files, "stores", once=once)
    for name in fresh:
        if name.endswith(".bin"):
            domain, split = name.removesuffix(".bin").split("/")
            stores.check_ids(domain, split)
    return hashed


def check_tokenizer(manifest: Manifest, expect: dict[str, Any], where: str) -> None:
    """Every key of `expect` must equal the manifest's tokenizer identity."""
    for key, want in expect.items():
        have = manifest.tokenizer.get(key)
        if have != want:
            raise DataError(
                f"{where}: stores were built with tokenizer {manifest.tokenizer.get('name')!r} "
                f"({key}={have!r}) but the run asks for {expect.get('name', '?')!r} "
                f"({key}={want!r}); re-run `doremi preprocess` with this tokenizer"
            )


class SplitWriter:
    """Appends tokenized documents to `<split>.bin` / `<split>.idx` (in a staging directory)."""

    def __init__(self, bin_path: Path, idx_path: Path, dtype: str):
        bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.bin_path, self.idx_path = bin_path, idx_path
        self.dtype = DTYPES[dtype]
        self.tokens = 0
        self.documents = 0
        self._bin: BinaryIO = open(bin_path, "wb")
        self._idx: BinaryIO = open(idx_path, "wb")
        self._idx.write(np.zeros(1, INDEX_DTYPE).tobytes())

    def append(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """`flat`: documents each followed by EOS; `lengths`: tokens per document incl. EOS."""
        if len(lengths) == 0:
            return
        self._bin.write(np.ascontiguousarray(flat, dtype=self.dtype).tobytes())
        offsets = self.tokens + np.cumsum(lengths, dtype=np.int64)
        self._idx.write(offsets.astype(INDEX_DTYPE).tobytes())
        self.tokens = int(offsets[-1])
        self.documents += len(lengths)

    def close(self) -> SplitCounts:
        for f in (self._bin, self._idx):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        return SplitCounts(self.tokens, self.documents)


class TokenStores:
    """Read access to validated stores; token and index arrays are memory-mapped on first use."""

    def __init__(self, store_dir: Path, manifest: Manifest):
        self.store_dir = store_dir
        self.manifest = manifest
        self._maps: dict[tuple[str, str, str], np.ndarray] = {}

    @property
    def domains(self) -> list[str]:
        return self.manifest.domain_names

    @property
    def eos_id(self) -> int:
        return int(self.manifest.tokenizer["eos_id"])

    def _map(self, domain: str, split: str, kind: str) -> np.ndarray:
        key = (domain, split, kind)
        if key not in self._maps:
            self.manifest.domain(domain)
            check_split(split)
            bin_path, idx_path = split_paths(self.store_dir, domain, split)
            path, dtype = (bin_path, DTYPES[self.manifest.dtype]) if kind == "bin" else (idx_path, INDEX_DTYPE)
            if path.stat().st_size == 0:
                self._maps[key] = np.zeros(0, dtype)
            else:
                self._maps[key] = np.memmap(path, dtype=dtype, mode="r")
        return self._maps[key]

    def tokens(self, domain: str, split: str) -> np.ndarray:
        """Flat tokens of one split: documents each followed by EOS."""
        return self._map(domain, split, "bin")

    def documents(self, domain: str, split: str) -> np.ndarray:
        """Document offsets (documents + 1 entries) into `tokens(domain, split)`."""
        return self._map(domain, split, "idx")

    def document(self, domain: str, split: str, i: int) -> np.ndarray:
        """Tokens of document i without its trailing EOS."""
        idx = self.documents(domain, split)
        return np.asarray(self.tokens(domain, split)[idx[i] : idx[i + 1] - 1])

    def check_ids(self, domain: str, split: str) -> None:
        """Every token id of one split below the tokenizer's vocabulary size (an id beyond it
        would fail inside the embedding, far from its cause)."""
        vocab = int(self.manifest.tokenizer.get("vocab_size", 0) or 0)
        path = split_paths(self.store_dir, domain, split)[0]
        bad = first_id_at_least(path, DTYPES[self.manifest.dtype], vocab) if vocab else None
        if bad is not None:
            raise DataError(
                f"{path}: domain {domain!r}: token id {int(self.tokens(domain, split)[bad])} "
                f"at position {bad} is outside the vocabulary ({vocab} ids); re-run `doremi preprocess --force`"
            )

    def validate(self) -> None:
        """Every file present with the size the manifest implies, index ends where tokens end."""
        itemsize = DTYPES[self.manifest.dtype].itemsize
        for d in self.manifest.domains:
            for split in SPLITS:
                counts = d.split(split)
                bin_path, idx_path = split_paths(self.store_dir, d.name, split)
                for path, want, what in (
                    (bin_path, counts.tokens * itemsize, f"{counts.tokens} {self.manifest.dtype} tokens"),
                    (idx_path, (counts.documents + 1) * INDEX_DTYPE.itemsize, f"{counts.documents + 1} int64 offsets"),
                ):
                    if not path.is_file():
                        raise DataError(
                            f"{path}: missing from the stores (the manifest lists domain {d.name!r}); "
                            f"re-run `doremi preprocess`"
                        )
                    have = path.stat().st_size
                    if have != want:
                        raise DataError(
                            f"{path}: expected {want} bytes ({what} per the manifest), found {have}: "
                            f"truncated or from another build; re-run `doremi preprocess --force`"
                        )
                idx = self.documents(d.name, split)
                if idx[0] != 0 or idx[-1] != counts.tokens:
                    raise DataError(
                        f"{idx_path}: offsets run from {idx[0]} to {idx[-1]}, expected 0 to "
                        f"{counts.tokens}; re-run `doremi preprocess --force`"
                    )


CHECK_TOKENS = 1 << 24  # tokens read per block by check_ids


def first_id_at_least(path: Path, dtype: np.dtype, limit: int) -> int | None:
    """Position of the first token >= `limit` in a token file, read in blocks of CHECK_TOKENS:
    a reduction over a memory map counts every page of the file in the resident set until it
    is unmapped (issue 42: `doremi preprocess` ends by opening the stores it wrote)."""
    total = path.stat().st_size // dtype.itemsize
    for start in range(0, total, CHECK_TOKENS):
        block = np.fromfile(path, dtype=dtype, count=min(CHECK_TOKENS, total - start), offset=start * dtype.itemsize)
        if int(block.max()) >= limit:
            return start + int(np.argmax(block >= limit))
    return None


def open_stores(store_dir: str | os.PathLike, expect_tokenizer: dict[str, Any] | None = None) -> TokenStores:
    """Open and validate the stores in `store_dir`; with `expect_tokenizer`, check that they were
    built with that tokenizer (keys compared: those given, e.g. name, vocab_size, hash)."""
    store = Path(store_dir)
    manifest = read_manifest(store)
    if expect_tokenizer:
        check_tokenizer(manifest, expect_tokenizer, str(store))
    stores = TokenStores(store, manifest)
    stores.validate()
    verify_contents(stores)
    return stores
