"""Streaming readers of local files: JSON lines (plain, .gz, .xz, .bz2, .zst), text (by line,
paragraph or document; plain or compressed), parquet (by record batch) and Arrow IPC files.

Issue 42: a domain of hundreds of GB cannot be held as a list of documents. Each reader is a
`scan` (one pass that counts the rows and raises every error the full read would, before
anything is written) and a `batches(rows)` generator that re-reads the files in the same order,
so memory is bounded by one batch whatever the domain's size. The row count is what the split
needs (data.split: the validation mask is a function of the document index and the seed), so the
stores' bytes are those of the former whole-domain reads (tests/test_data_stream_golden.py). The
rows are those `datasets` gave for text, parquet and arrow (its text builder: universal newlines,
`\\n\\n` paragraphs, empty files skipped), and those of the former `read_jsonl_rows` for JSON lines.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.errors import DataError

ZSTD_HINT = "pip install 'doremi-mix[zst]' (or: pip install zstandard)"


def _zstd_open(path: str, mode: str = "rb") -> Any:
    """A .zst file's decompressed bytes (The Pile and SlimPajama ship as zstd JSON lines), frames
    read one after another (a concatenation of .zst files is one), buffered for line reads."""
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{path}: reading .zst files needs the zstandard package: {ZSTD_HINT}") from None
    raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True, closefd=True)
    return io.BufferedReader(raw, buffer_size=1 << 20)


DECOMPRESS: dict[str, Callable[..., Any]] = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open, ".zst": _zstd_open}


def open_binary(path: str) -> Any:
    """A file's bytes, decompressed by its suffix (`.gz`, `.xz`, `.bz2`, `.zst`)."""
    name = path.lower()
    opener = next((o for suffix, o in DECOMPRESS.items() if name.endswith(suffix)), open)
    return opener(path, "rb")


def decode_line(raw: bytes, n: int) -> str:
    """Line `n` as text; a byte that is not UTF-8 is one error naming the line and the byte (a
    decoder's own message gives a position in a buffer, not a line)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"line {n}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); "
            "re-encode the file as UTF-8"
        ) from None


def first_non_utf8(path: str) -> str | None:
    """`path: line N: not UTF-8 (...)` for the first line of `path` that is not UTF-8; None when
    all are."""
    try:
        with open_binary(path) as f:
            for n, raw in enumerate(f, start=1):
                decode_line(raw, n)
    except DataError as e:
        return f"{path}: {e}"
    except (OSError, EOFError):
        return None
    return None


def rebatch(values: Iterable[Any], rows: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for v in values:
        batch.append(v)
        if len(batch) == rows:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass(frozen=True)
class FileRows:
    """One domain's rows from its files: `counts` per file (from the scan), and reads in file
    order, fresh on every call. Plain data, so that a task of one file (data.tasks) can be sent
    to a worker process."""

    kind: str  # jsonl, text, parquet or arrow
    files: list[str]
    counts: list[int]
    text_field: str = "text"
    sample_by: str = "document"
    where: str = ""

    @property
    def num_rows(self) -> int:
        return sum(self.counts)

    def batches(self, rows: int) -> Iterator[list[Any]]:
        for path in self.files:
            yield from self.file_batches(path, rows)

    def file_batches(self, path: str, rows: int) -> Iterator[list[Any]]:
        """The rows of one of the files, in lists of at most `rows`."""
        if self.kind == "jsonl":
            return rebatch(iter_jsonl([path], self.text_field, self.where), rows)
        if self.kind == "text":
            return rebatch(iter_text([path], self.sample_by, self.where), rows)
        if self.kind == "parquet":
            return _parquet_batches(path, self.text_field, self.where, rows)
        return _arrow_text_batches(path, self.text_field, self.where, rows)


# -- JSON lines ------------------------------------------------------------------------------


def _jsonl_objects(files: list[str], where: str) -> Iterator[dict[str, Any]]:
    for path in files:
        try:
            with open_binary(path) as f:
                for n, raw in enumerate(f, start=1):
                    try:
                        line = decode_line(raw, n)
                        if not line.strip():
                            continue
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
                        if not isinstance(row, dict):
                            raise DataError(f"line {n}: expected a JSON object, got {type(row).__name__}")
                    except DataError as e:
                        raise DataError(f"{where}: could not read {path} as JSON lines: {e}") from None
                    yield row
        except DataError:
            raise
        except (ValueError, OSError, EOFError) as e:
            raise DataError(
                f"{where}: could not read {path} as JSON lines ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})"
            ) from None


def scan_jsonl(files: list[str], text_field: str, where: str) -> list[int]:
    """Rows (non-blank lines) of each JSON-lines file; an error naming the files when no line
    has the field, and the file and its line (counted from 1, blank lines included) when a line
    is not UTF-8, not JSON or not an object."""
    counts = []
    fields: dict[str, None] = {}
    found = False
    for path in files:
        count = 0
        for row in _jsonl_objects([path], where):
            if text_field in row:
                found = True
            elif not found:
                fields.update(dict.fromkeys(row))
            count += 1
        counts.append(count)
    if sum(counts) and not found:
        raise DataError(
            f"{where}: {', '.join(files)} have no field {text_field!r} (fields: {', '.join(fields)}); set text_field"
        )
    return counts


def iter_jsonl(files: list[str], text_field: str, where: str) -> Iterator[Any]:
    """`text_field` of every row, in order (None where a line lacks it, as `datasets` gives)."""
    for row in _jsonl_objects(files, where):
        yield row.get(text_field)


def jsonl_rows(files: list[str], text_field: str, where: str) -> FileRows:
    return FileRows("jsonl", files, scan_jsonl(files, text_field, where), text_field, where=where)


# -- text ------------------------------------------------------------------------------------

TEXT_CHUNK = 1 << 20


def _paragraphs(f: io.TextIOBase) -> Iterator[str]:
    """The non-empty parts of the text split at `\\n\\n`, read in chunks: the part after a chunk's
    last separator is carried into the next, so the parts are those of the whole text."""
    carry = ""
    while chunk := f.read(TEXT_CHUNK):
        parts = (carry + chunk).split("\n\n")
        carry = parts.pop()
        yield from (p for p in parts if p)
    if carry:
        yield carry


def _text_values(path: str, sample_by: str) -> Iterator[str]:
    with io.TextIOWrapper(open_binary(path), encoding="utf-8", newline=None) as f:
        if sample_by == "line":
            for line in f:
                yield line[:-1] if line.endswith("\n") else line
        elif sample_by == "paragraph":
            yield from _paragraphs(f)
        else:
            yield f.read()


def iter_text(files: list[str], sample_by: str, where: str) -> Iterator[str]:
    """Rows of text files as `datasets`' text builder gives them: universal newlines, a line
    without its `\\n`, paragraphs split at `\\n\\n` (empty ones dropped), or the whole file;
    files of 0 bytes hold no row."""
    for path in files:
        if Path(path).stat().st_size == 0:
            continue
        try:
            yield from _text_values(path, sample_by)
        except UnicodeDecodeError:
            bad = first_non_utf8(path)
            raise DataError(f"{where}: {bad or f'{path}: not UTF-8'}") from None
        except (ValueError, OSError, EOFError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{where}: could not read {path} as text ({msg})") from None


def text_rows(files: list[str], sample_by: str, where: str) -> FileRows:
    if all(Path(f).stat().st_size == 0 for f in files):
        raise DataError(f"{where}: empty domain ({', '.join(files)}: empty file)")
    counts = [sum(1 for _ in iter_text([f], sample_by, where)) for f in files]
    return FileRows("text", files, counts, sample_by=sample_by, where=where)


# -- parquet and arrow -----------------------------------------------------------------------


def _no_field(where: str, files: list[str], field: str, names: list[str]) -> DataError:
    return DataError(
        f"{where}: {', '.join(files)} have no field {field!r} (fields: {', '.join(names)}); set text_field"
    )


def _parquet(path: str, where: str) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types; report the first line
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{where}: could not read {path} as parquet ({msg})") from None


def parquet_rows(files: list[str], text_field: str, where: str) -> FileRows:
    """Parquet files read by record batches of the text column alone."""
    counts = []
    for path in files:
        pf = _parquet(path, where)
        names = pf.schema_arrow.names
        if text_field not in names:
            raise _no_field(where, files, text_field, names)
        counts.append(pf.metadata.num_rows)
    return FileRows("parquet", files, counts, text_field, where=where)


def _parquet_batches(path: str, text_field: str, where: str, rows: int) -> Iterator[list[Any]]:
    for batch in _parquet(path, where).iter_batches(batch_size=rows, columns=[text_field]):
        yield batch.column(0).to_pylist()


def _arrow_batches(path: str, where: str) -> Iterator[Any]:
    """Record batches of an Arrow IPC file: the stream format (what `datasets` saves), else the
    file format, as `datasets`' arrow builder reads them."""
    import pyarrow as pa

    try:
        with pa.memory_map(path) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.lib.ArrowInvalid:
                source.seek(0)
                file_reader = pa.ipc.open_file(source)
                reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            yield from reader
    except pa.lib.ArrowException as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{where}: could not read {path} as arrow ({msg})") from None


def arrow_rows(files: list[str], text_field: str, where: str) -> FileRows:
    counts = []
    for path in files:
        n = 0
        for batch in _arrow_batches(path, where):
            if text_field not in batch.schema.names:
                raise _no_field(where, files, text_field, batch.schema.names)
            n += batch.num_rows
        counts.append(n)
    return FileRows("arrow", files, counts, text_field, where=where)


def _arrow_text_batches(path: str, text_field: str, where: str, rows: int) -> Iterator[list[Any]]:
    for batch in _arrow_batches(path, where):
        column = batch.column(text_field)
        for start in range(0, len(column), rows):
            yield column.slice(start, rows).to_pylist()
