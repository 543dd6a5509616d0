"""The validation documents split into a dev half and a test half, and which consumer reads which
(docs/design.md section 3b).

Methods and fits that read validation losses (Aioli's probes, DoGE's target, the sweep runs that
RegMix and mixing-law fits read) would otherwise be tuned on the very sequences the verdict is
computed on. Under `data.validation_split: dev_test` each domain's validation documents are split
by document, fixed by (split seed, domain name) alone like the train/validation split
(`data.preprocess.split`), at read time from the existing stores (their `.idx` offsets give the document
boundaries, so stores already built keep working). Each half is packed into sequences on its
own, so no dev sequence holds a test token. `CONSUMERS` is the one table of who reads which half:
everything a method, a fit or a search run reads is dev, the verdict is test. Under `none`, the
default, every consumer reads the whole validation split packed as before, bit for bit.
"""

from __future__ import annotations

import zlib

import numpy as np

from data.errors import DataError, UserError
from data.store.dataset import PackedDomains
from data.store.store import TokenStores

#: `data.validation_split`: one validation set for all (`none`), or dev for methods and fits,
#: test for the verdict (`dev_test`).
ARRANGEMENTS = ("none", "dev_test")
DEV, TEST, ALL = "dev", "test", "all"

#: Consumer -> the half it reads under `dev_test` (under `none`: all of it).
CONSUMERS: dict[str, str] = {
    # A method's validation losses on its own schedule (Aioli's probes): Trainer.method_validation.
    "method_probe": DEV,
    # A method's target batches (DoGE's target gradient): DataFeed.target_batches.
    "method_target": DEV,
    # The evaluation of a reference or proxy run: part of a method's search, read by guardrails.
    "search_run": DEV,
    # A sweep run's evaluation, the losses RegMix and mixing-law fits are fitted to.
    "sweep_run": DEV,
    # A main run's evaluation (val_loss in metrics.jsonl), `doremi eval`, the pipeline's eval.json.
    "verdict": TEST,
}

#: The consumer of a Trainer's own evaluation, by the stage it runs (trainer.run.loop.Trainer).
STAGE_EVALUATION: dict[str, str] = {"reference": "search_run", "proxy": "search_run", "train": "verdict"}

#: Separates the generator of the dev/test split from the train/validation split's.
DEV_TEST_DRAWS = 0xDE7E


class MethodSplitError(UserError, ValueError):
    """A method asked for validation data it may not read."""


def split_for(consumer: str, arrangement: str) -> str:
    """The half (`dev`, `test`) or `all` of the validation documents `consumer` reads."""
    if consumer not in CONSUMERS:
        raise ValueError(f"unknown validation consumer {consumer!r}; expected one of {', '.join(CONSUMERS)}")
    if arrangement not in ARRANGEMENTS:
        raise DataError(f"data.validation_split: expected one of {', '.join(ARRANGEMENTS)}, got {arrangement!r}")
    return ALL if arrangement == "none" else CONSUMERS[consumer]


def check_method_split(requested: str, method: str) -> None:
    """A method may ask only for dev validation data (`Needs.validation_split`): the verdict's
    test half is never handed to anything that tunes a mixture."""
    if requested != DEV:
        raise MethodSplitError(
            f"method {method}: asks for the {requested!r} validation split; a method reads only "
            f"'dev' (the verdict is computed on 'test'; docs/design.md 3b)"
        )


def dev_count(num_documents: int, fraction: float, domain: str) -> int:
    """round(fraction x n) documents in dev, at least one in each half."""
    if not 0 < fraction < 1:
        raise DataError(f"data.dev_fraction: expected a value in (0, 1), got {fraction}")
    if num_documents < 2:
        raise DataError(
            f"data.validation_split: domain {domain!r} has {num_documents} validation document(s); "
            f"dev_test needs at least 2 (raise data.validation_fraction)"
        )
    return min(max(1, round(fraction * num_documents)), num_documents - 1)


def dev_mask(num_documents: int, fraction: float, seed: int, domain: str) -> np.ndarray:
    """Boolean mask over a domain's validation documents: True for dev. Fixed by (seed, domain
    name) and the document count alone, so every run on the same stores splits them alike."""
    mask = np.zeros(num_documents, dtype=bool)
    rng = np.random.default_rng([seed, DEV_TEST_DRAWS, zlib.crc32(domain.encode("utf-8"))])
    mask[rng.permutation(num_documents)[: dev_count(num_documents, fraction, domain)]] = True
    return mask


def half_documents(half: str, num_documents: int, fraction: float, seed: int, domain: str) -> np.ndarray:
    """Sorted validation document ids of `half` (`dev`, `test`, or `all`)."""
    if half == ALL:
        return np.arange(num_documents, dtype=np.int64)
    mask = dev_mask(num_documents, fraction, seed, domain)
    return np.flatnonzero(mask if half == DEV else ~mask).astype(np.int64)


def sequence_documents(
    offsets: np.ndarray, doc_ids: np.ndarray, num_sequences: int, seq_len: int, num_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) document id of each packed sequence's label tokens: sequence i's labels
    are stream positions i*seq_len + 1 .. min(i*seq_len + seq_len, num_tokens - 1)
    (`data.dataset`), and document j of the stream holds positions offsets[j] .. offsets[j+1] - 1
    and is the store's validation document doc_ids[j]."""
    starts = np.arange(num_sequences, dtype=np.int64) * seq_len + 1
    ends = np.minimum(starts + seq_len - 1, num_tokens - 1)
    first = np.searchsorted(offsets, starts, side="right") - 1
    last = np.searchsorted(offsets, ends, side="right") - 1
    return doc_ids[first], doc_ids[last]


class PackedDocuments(PackedDomains):
    """The validation split restricted to chosen documents of each domain (in store order), packed
    into sequences on its own exactly as `PackedDomains` packs a whole split."""

    def __init__(self, stores: TokenStores, seq_len: int, documents: list[np.ndarray]):
        super().__init__(stores, "validation", seq_len)
        self.document_ids = documents
        self.offsets: list[np.ndarray] = []
        tokens = []
        for name, ids in zip(self.domains, documents):
            idx = np.asarray(stores.documents(name, "validation"))
            lengths = np.diff(idx)
            keep = np.zeros(len(lengths), dtype=bool)
            keep[ids] = True
            tokens.append(np.asarray(stores.tokens(name, "validation"))[np.repeat(keep, lengths)])
            self.offsets.append(np.concatenate([[0], np.cumsum(lengths[ids])]).astype(np.int64))
        self._tokens = tokens


def validation_view(
    stores: TokenStores, seq_len: int, half: str, fraction: float, seed: int
) -> tuple[PackedDomains, list[np.ndarray], list[np.ndarray]]:
    """(packed sequences, per-domain stream offsets, per-domain document ids) of `half`; `all` is
    the whole split, packed as `PackedDomains` always has."""
    if half == ALL:
        offsets = [np.asarray(stores.documents(d, "validation"), dtype=np.int64) for d in stores.domains]
        ids = [np.arange(len(o) - 1, dtype=np.int64) for o in offsets]
        return PackedDomains(stores, "validation", seq_len), offsets, ids
    counts = [stores.manifest.domain(d).validation.documents for d in stores.domains]
    ids = [half_documents(half, n, fraction, seed, d) for n, d in zip(counts, stores.domains)]
    view = PackedDocuments(stores, seq_len, ids)
    return view, view.offsets, ids
