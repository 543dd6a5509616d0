"""Tokenizing local-file domains as independent tasks, one per (domain, file), recorded when
finished so that an interrupted build resumes (issue 42 point 2).

A task reads its file's rows (data.sources.readers), splits them with its slice of the domain's
validation mask (data.preprocess.split: the mask is a function of the document index and the seed, and a
task knows the index of its first row from the scan's per-file counts), tokenizes them and
writes part files plus a `.done.json` marker (written last, atomically) into a work directory
`<store>/.tasks-<key>`, keyed by the build's fingerprint, tokenizer and dtype, which outlives the
staging directory. The merge then appends the parts in (domain, file) order, so the stores'
bytes are those of one sequential pass, whatever the number of processes or interruptions
(tests/test_data_tasks.py). The work directory is removed once the stores are committed.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.atomic import atomic_write_text
from data.errors import DataError
from data.preprocess.encode import _init_worker, _worker, encode_texts
from data.progress import Progress
from data.sources.readers import FileRows
from data.sources.sources import digest
from data.store.store import DTYPES, INDEX_DTYPE, SplitWriter

#: report(domain, tokens, UTF-8 bytes) of one tokenized batch (data.progress).
Report = Callable[[str, int, int], None]

TASKS_PREFIX = ".tasks-"
READ_ROWS = 256
MERGE_TOKENS = 1 << 22  # tokens per block appended by the merge: bounded memory
SPLITS = ("train", "validation")


def check_text(value: Any, domain: str, field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"domain {domain!r}: field {field!r} holds {type(value).__name__}, expected text")
    return value


def split_rows(
    batches: Iterable[list[Any]], mask: np.ndarray, domain: str, field: str
) -> Iterator[tuple[list[str], list[str]]]:
    """(train texts, validation texts) per read batch, row i going where `mask[i]` says; empty
    and whitespace-only documents are dropped (they hold no text to learn, and a domain of
    nothing else must be refused as empty, not trained on as a stream of separators)."""
    row = 0
    for batch in batches:
        train, val = [], []
        for value in batch:
            text = check_text(value, domain, field)
            if text.strip():
                (val if mask[row] else train).append(text)
            row += 1
        yield train, val


@dataclass(frozen=True)
class Task:
    """Rows [first_row, first_row + rows) of a domain: the first `rows` rows of file `index`."""

    domain: str
    index: int
    path: str
    first_row: int
    rows: int
    files: FileRows

    def part(self, work: Path, split: str, ext: str) -> Path:
        return work / self.domain / f"{self.index}.{split}.{ext}"

    def marker(self, work: Path) -> Path:
        return work / self.domain / f"{self.index}.done.json"


def domain_tasks(domain: str, files: FileRows, num_rows: int) -> list[Task]:
    """One task per file holding any of the domain's first `num_rows` rows (max_documents)."""
    tasks, first = [], 0
    for i, (path, count) in enumerate(zip(files.files, files.counts)):
        n = min(count, num_rows - first)
        if n > 0:
            tasks.append(Task(domain, i, path, first, n, files))
            first += n
    return tasks


def work_dir(store: Path, key: str) -> Path:
    return store / f"{TASKS_PREFIX}{key}"


def remove_work_dirs(store: Path, keep: Path | None = None) -> None:
    """Work directories of other builds (other inputs), or all once the stores are committed."""
    for d in store.glob(f"{TASKS_PREFIX}*"):
        if d != keep:
            shutil.rmtree(d, ignore_errors=True)


def _first(batches: Iterable[list[Any]], rows: int) -> Iterator[list[Any]]:
    left = rows
    for batch in batches:
        if left <= 0:
            return
        yield batch[:left]
        left -= len(batch)


def run_task(
    task: Task, mask: np.ndarray, tok: Any, dtype: str, work: Path, report: Report | None = None
) -> dict[str, list[int]]:
    """Tokenize one task into its part files; the marker, written last, records per split the
    tokens, documents and UTF-8 bytes. `report(domain, tokens, bytes)` after each batch
    (data.progress)."""
    np_dtype = np.dtype(dtype)
    writers = [SplitWriter(task.part(work, s, "bin"), task.part(work, s, "idx"), dtype) for s in SPLITS]
    nbytes = [0, 0]
    batches = _first(task.files.file_batches(task.path, READ_ROWS), task.rows)
    for texts in split_rows(batches, mask, task.domain, task.files.text_field):
        for k, (writer, part) in enumerate(zip(writers, texts)):
            size = sum(len(t.encode("utf-8")) for t in part)
            flat, lengths = encode_texts(tok, part, np_dtype)
            writer.append(flat, lengths)
            nbytes[k] += size
            if report is not None:
                report(task.domain, len(flat), size)
    counts = [w.close() for w in writers]
    done = {s: [c.tokens, c.documents, n] for s, c, n in zip(SPLITS, counts, nbytes)}
    atomic_write_text(task.marker(work), json.dumps(done) + "\n")
    return done


def finished(task: Task, work: Path, dtype: str) -> dict[str, list[int]] | None:
    """The marker of a finished task whose part files have the sizes it records, else None."""
    try:
        done = json.loads(task.marker(work).read_text())
        for s in SPLITS:
            tokens, documents, _ = done[s]
            if task.part(work, s, "bin").stat().st_size != tokens * DTYPES[dtype].itemsize:
                return None
            if task.part(work, s, "idx").stat().st_size != (documents + 1) * INDEX_DTYPE.itemsize:
                return None
        return done
    except (OSError, ValueError, KeyError, TypeError):
        return None


_counters: dict[str, Any] = {}


def _init_task_worker(spec: dict[str, Any], dtype: str, counters: Any, domains: list[str]) -> None:
    _init_worker(spec, dtype)
    _counters["shared"], _counters["index"] = counters, {d: i for i, d in enumerate(domains)}


def _count_shared(domain: str, tokens: int, nbytes: int) -> None:
    """A worker's batch added to the counters its parent reads (data.progress.Progress.absorb)."""
    shared, i = _counters["shared"], _counters["index"][domain]
    with shared.get_lock():
        shared[2 * i] += tokens
        shared[2 * i + 1] += nbytes


def _run_in_worker(args: tuple[Task, np.ndarray, str, str]) -> None:
    task, mask, dtype, work = args
    run_task(task, mask, _worker["tok"], dtype, Path(work), _count_shared)


def run_tasks(
    tasks: list[Task],
    masks: dict[str, np.ndarray],
    tok: Any,
    dtype: str,
    num_proc: int,
    work: Path,
    progress: Progress | None = None,
) -> None:
    """Run the tasks not finished yet, in this process (`num_proc` 1) or in `num_proc` worker
    processes that each read, tokenize and write their own tasks; `progress` counts their
    tokens and bytes."""
    todo = [t for t in tasks if finished(t, work, dtype) is None]
    jobs = [(t, masks[t.domain][t.first_row : t.first_row + t.rows]) for t in todo]
    live = progress is not None and progress.enabled
    if num_proc == 1 or len(jobs) <= 1:
        for task, mask in jobs:
            run_task(task, mask, tok, dtype, work, progress.add if live else None)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    domains = progress.domains if progress is not None else sorted({t.domain for t in todo})
    counters = ctx.Array("q", 2 * len(domains))
    init = (tok.spec(), dtype, counters, domains)
    with ctx.Pool(min(num_proc, len(jobs)), initializer=_init_task_worker, initargs=init) as pool:
        results = pool.imap_unordered(_run_in_worker, [(t, m, dtype, str(work)) for t, m in jobs])
        while True:
            try:
                results.next(timeout=progress.interval if live else None)
            except StopIteration:
                break
            except multiprocessing.TimeoutError:
                pass
            if live:
                progress.absorb(counters[:])


def merge(tasks: list[Task], work: Path, dtype: str, writers: list[SplitWriter]) -> list[int]:
    """Append the tasks' parts, in order, to the domain's split writers, whole documents of at
    most MERGE_TOKENS tokens at a time (one longer document alone); returns the UTF-8 bytes per
    split."""
    nbytes = [0, 0]
    item = DTYPES[dtype].itemsize
    for task in tasks:
        done = finished(task, work, dtype)
        if done is None:
            raise DataError(f"{task.marker(work)}: task of {task.path} not finished; re-run `doremi preprocess`")
        for k, (s, writer) in enumerate(zip(SPLITS, writers)):
            nbytes[k] += done[s][2]
            idx = np.fromfile(task.part(work, s, "idx"), dtype=INDEX_DTYPE)
            a = 0
            while a < len(idx) - 1:
                b = max(a + 1, int(np.searchsorted(idx, idx[a] + MERGE_TOKENS, side="right")) - 1)
                n = int(idx[b] - idx[a])
                flat = np.fromfile(task.part(work, s, "bin"), dtype=DTYPES[dtype], count=n, offset=int(idx[a]) * item)
                writer.append(flat, np.diff(idx[a : b + 1]))
                a = b
    return nbytes


def task_key(parts: list[Any]) -> str:
    return digest(parts)[:16]
