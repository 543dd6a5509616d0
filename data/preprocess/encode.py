"""Tokenize batches of documents, in `num_proc` worker processes, into flat token arrays with
EOS after every document. Results come back in input order; at most 2 x num_proc batches are
in flight, so memory stays bounded however large the corpus.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from data.tokenizer.tokenizer import tokenizer_from_spec

Encoded = tuple[np.ndarray, np.ndarray]  # flat tokens (docs + EOS each), tokens per doc incl. EOS

# Per worker process: the tokenizer and dtype, set once by the pool initializer.
_worker: dict[str, Any] = {}


def encode_texts(tok: Any, texts: list[str], dtype: np.dtype) -> Encoded:
    if not texts:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    return tok.encode_flat(texts, dtype)


def _init_worker(spec: dict[str, Any], dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker["tok"] = tokenizer_from_spec(spec)
    _worker["dtype"] = np.dtype(dtype)


def _encode_task(task: tuple[list[str], ...]) -> tuple[Encoded, ...]:
    return tuple(encode_texts(_worker["tok"], texts, _worker["dtype"]) for texts in task)


class Encoder:
    """Tokenizes tasks (tuples of text lists, e.g. the train and validation documents of one
    read batch) into `Encoded` tuples, in order. num_proc == 1 (and the byte tokenizer) encodes
    in this process (the `tokenizers` library still uses its own threads); otherwise one pool of
    `num_proc` worker processes serves every domain. Use as a context manager."""

    def __init__(self, tok: Any, dtype: str, num_proc: int):
        self.tok = tok
        self.dtype = dtype
        self.num_proc = num_proc
        self._pool: Any = None

    def __enter__(self) -> Encoder:
        # Byte encoding is a memcpy: shipping texts to workers costs more than it saves
        # (experiments/notes/PREPROCESS.md), so bytes always encode in this process.
        if self.num_proc > 1 and self.tok.kind != "byte":
            # fork where the platform has it: no re-import of the caller's __main__ (scripts and
            # notebooks work without a main guard) and no start-up cost; children only tokenize.
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            self._pool = ctx.Pool(self.num_proc, initializer=_init_worker, initargs=(self.tok.spec(), self.dtype))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def map(self, tasks: Iterable[tuple[list[str], ...]]) -> Iterator[tuple[Encoded, ...]]:
        np_dtype = np.dtype(self.dtype)
        if self._pool is None:
            for task in tasks:
                yield tuple(encode_texts(self.tok, texts, np_dtype) for texts in task)
            return
        pending: collections.deque = collections.deque()
        for task in tasks:
            pending.append(self._pool.apply_async(_encode_task, (task,)))
            if len(pending) >= 2 * self.num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
