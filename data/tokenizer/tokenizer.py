"""Tokenizers: byte-level (no files), BPE trained on the corpus, or a `tokenizer.json` / Hugging
Face tokenizer loaded with the `tokenizers` library.

Every tokenizer has an end-of-document id (`eos_id`) written between documents, and an
`identity` (name, vocab size, EOS id, content hash) that the manifest records so that a run can
check it trains on stores built with the tokenizer it asks for.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from data.config import TokenizerConfig
from data.errors import DataError
from data.tokenizer.bos import bos_token, without_bos

TOKENIZER_FILE = "tokenizer.json"
EOS_TEXT = "<|endoftext|>"
EOS_CANDIDATES = (EOS_TEXT, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]: ...

    def encode_flat(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    @property
    def identity(self) -> dict[str, Any]: ...

    def spec(self) -> dict[str, Any]: ...


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def flat_with_eos(arrays: list[np.ndarray], eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(the documents' ids with `eos_id` after each, as one `dtype` array; tokens per document,
    EOS included): what a store appends (data.store.store.SplitWriter)."""
    eos = np.array([eos_id], dtype=dtype)
    parts = []
    for a in arrays:
        parts.append(a.astype(dtype, copy=False))
        parts.append(eos)
    lengths = np.fromiter((len(a) + 1 for a in arrays), dtype=np.int64, count=len(arrays))
    return (np.concatenate(parts) if parts else np.zeros(0, dtype)), lengths


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; EOS is 256. Exact round trip for any text."""

    kind = "byte"
    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def encode_flat(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        return flat_with_eos(self.encode_arrays(texts), self.eos_id, dtype)

    def decode(self, ids: Iterable[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if i == self.eos_id:
                out.append(run.decode("utf-8", errors="replace") + EOS_TEXT)
                run = bytearray()
            else:
                run.append(int(i))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    @property
    def identity(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "hash": _sha256("byte-level utf-8, eos=256, v1"),
        }

    def spec(self) -> dict[str, Any]:
        return {"kind": "byte"}

    def to_json(self) -> str:
        return json.dumps({"kind": "byte", "version": 1}) + "\n"


class HFTokenizer:
    """A `tokenizers.Tokenizer`, encoding without added special tokens except the BOS that its
    post-processor puts first (`bos_id`; data.tokenizer.bos): what the model sees in the stores is what
    transformers gives with the exported tokenizer."""

    kind = "hf"

    def __init__(self, tok: Any, name: str, eos_id: int):
        self._tok = tok
        self.name = name
        self.eos_id = eos_id
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._json = tok.to_str()
        bos = bos_token(self._json)
        self.bos_id: int | None = bos[1] if bos else None
        self._bos = [] if bos is None else [bos[1]]
        # The same ids without the character offsets (tokenizers >= 0.21), which nothing here
        # reads: about 16% less CPU a token (docs/design.md section 3a-iv).
        self._batch = getattr(tok, "encode_batch_fast", tok.encode_batch)

    def encode(self, text: str) -> list[int]:
        return self._bos + self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        rows = [e.ids for e in self._batch(texts, add_special_tokens=False)]
        return [self._bos + r for r in rows] if self._bos else rows

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self.encode_batch(texts)]

    def encode_flat(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """As `flat_with_eos(encode_arrays(texts))`, but the Python lists of ids go to `dtype` in
        one `np.fromiter` instead of an int64 array per document, then a cast and a concatenation
        of two arrays a document (docs/design.md section 3a-iv)."""
        rows = self.encode_batch(texts)
        for r in rows:
            r.append(self.eos_id)
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=int(lengths.sum()))
        return flat, lengths

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def identity(self) -> dict[str, Any]:
        ident = {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id, "hash": _sha256(self._json)}
        return ident if self.bos_id is None else ident | {"bos_id": self.bos_id}

    def spec(self) -> dict[str, Any]:
        return {"kind": "hf", "json": self._json, "name": self.name, "eos_id": self.eos_id}

    def to_json(self) -> str:
        return self._json


def tokenizer_from_spec(spec: dict[str, Any]) -> ByteTokenizer | HFTokenizer:
    """Rebuild a tokenizer from `Tokenizer.spec()` (how worker processes receive it)."""
    if spec["kind"] == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer as RawTokenizer

    return HFTokenizer(RawTokenizer.from_str(spec["json"]), spec["name"], spec["eos_id"])


def _find_eos(tok: Any, wanted: str | None, where: str) -> int:
    names = (wanted,) if wanted else EOS_CANDIDATES
    for name in names:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    raise DataError(
        f"{where}: no end-of-document token {' or '.join(names)} in the vocabulary; set data.tokenizer.eos_token"
    )


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization, all 256 bytes in the alphabet so that any text
    round-trips), EOS `<|endoftext|>` = id 0, trained on `texts` (the caller chooses and caps
    them: `data.preprocess.preprocess.tokenizer_training_texts`)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok, f"bpe-{vocab_size}", tok.token_to_id(EOS_TEXT))


def _local_tokenizer_file(path: str, kind: str) -> Path | None:
    p = Path(path).expanduser()
    if p.is_dir():
        f = p / TOKENIZER_FILE
        if not f.is_file():
            raise DataError(
                f"data.tokenizer.path: {p} has no {TOKENIZER_FILE} (kind {kind!r} needs a fast tokenizer file)"
            )
        return f
    if p.is_file():
        return p
    return None


def _load_file(path: Path, name: str, eos_token: str | None) -> HFTokenizer:
    from tokenizers import Tokenizer as RawTokenizer

    try:
        tok = RawTokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise DataError(f"data.tokenizer.path: {path} is not a valid {TOKENIZER_FILE} ({e})") from None
    return HFTokenizer(tok, name, _find_eos(tok, eos_token, f"tokenizer {path}"))


def build_tokenizer(
    cfg: TokenizerConfig, texts_for_training: Iterable[str] | None = None
) -> ByteTokenizer | HFTokenizer:
    """The tokenizer that `cfg` asks for; `bpe` trains on `texts_for_training`. With
    `add_bos: false`, a `file`/`hf` tokenizer's BOS-adding template is removed (data.tokenizer.bos)."""
    tok = _build_tokenizer(cfg, texts_for_training)
    if isinstance(tok, HFTokenizer) and tok.bos_id is not None and not cfg.add_bos:
        from tokenizers import Tokenizer as RawTokenizer

        return HFTokenizer(RawTokenizer.from_str(without_bos(tok.to_json())), tok.name, tok.eos_id)
    return tok


def _build_tokenizer(
    cfg: TokenizerConfig, texts_for_training: Iterable[str] | None = None
) -> ByteTokenizer | HFTokenizer:
    if cfg.kind == "byte":
        return ByteTokenizer()
    if cfg.kind == "bpe":
        if texts_for_training is None:
            raise DataError("data.tokenizer: kind 'bpe' needs texts to train on (no real text domain?)")
        return train_bpe(texts_for_training, cfg.vocab_size)
    if not cfg.path:
        raise DataError(f"data.tokenizer.path: required for kind {cfg.kind!r}")
    local = _local_tokenizer_file(cfg.path, cfg.kind)
    if cfg.kind == "file":
        if local is None:
            raise DataError(f"data.tokenizer.path: tokenizer file {cfg.path} not found")
        return _load_file(local, f"file:{Path(cfg.path).name}", cfg.eos_token)
    if local is not None:
        return _load_file(local, f"hf:{cfg.path}", cfg.eos_token)
    from tokenizers import Tokenizer as RawTokenizer

    try:
        tok = RawTokenizer.from_pretrained(cfg.path)
    except Exception as e:
        raise DataError(
            f"data.tokenizer.path: {cfg.path!r} is not a local path and could not be "
            f"fetched from the Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return HFTokenizer(tok, f"hf:{cfg.path}", _find_eos(tok, cfg.eos_token, f"tokenizer {cfg.path}"))


def expected_identity(cfg: TokenizerConfig) -> dict[str, Any]:
    """What a run can know about its tokenizer without the stores: the full identity for
    byte/file/hf, the name (`bpe-<vocab>`) for a BPE that preprocessing trains."""
    if cfg.kind == "bpe":
        return {"name": f"bpe-{cfg.vocab_size}"}
    return build_tokenizer(cfg).identity


def save_tokenizer(tok: ByteTokenizer | HFTokenizer, path: Path) -> None:
    from data.atomic import atomic_write_text

    atomic_write_text(path, tok.to_json())


def load_tokenizer(store_dir: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer saved with the stores in `store_dir`, checked against the manifest."""
    from data.store.store import read_manifest

    store = Path(store_dir)
    identity = read_manifest(store).tokenizer
    path = store / TOKENIZER_FILE
    if identity.get("name") == "byte":
        tok: ByteTokenizer | HFTokenizer = ByteTokenizer()
    else:
        if not path.is_file():
            raise DataError(f"{path}: tokenizer file missing from the stores")
        from tokenizers import Tokenizer as RawTokenizer

        tok = HFTokenizer(RawTokenizer.from_file(str(path)), identity["name"], identity["eos_id"])
    if tok.identity["hash"] != identity["hash"]:
        raise DataError(
            f"{path}: tokenizer hash {tok.identity['hash'][:12]} does not match the manifest's {identity['hash'][:12]}"
        )
    return tok
