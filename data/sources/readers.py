"""Streaming readers of local files: JSON lines (plain, .gz, .xz, .bz2, .zst; also one file set
split by a domain column), text (by line, paragraph or document; plain or compressed), parquet (by
record batch) and Arrow IPC files.

Issue 42: a domain of hundreds of GB cannot be held as a list of documents. Each reader is a
`scan` (one pass that counts the rows and raises every error the full read would, before
anything is written) and a `batches(rows)` generator that re-reads the files in the same order,
so memory is bounded by one batch whatever the domain's size. The row count is what the split
needs (data.preprocess.split: the validation mask is a function of the document index and the seed), so the
stores' bytes are those of the former whole-domain reads (tests/test_data_stream_golden.py). The
rows are those `datasets` gave for text, parquet and arrow (its text builder: universal newlines,
`\\n\\n` paragraphs, empty files skipped), and those of the former `read_jsonl_rows` for JSON lines.
"""

from __future__ import annotations

import array
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
    order, fresh on every call. Plain data, so that a task of one file (data.preprocess.tasks) can be sent
    to a worker process."""

    kind: str  # jsonl, text, parquet, arrow, or column (JSON lines of one domain-column value)
    files: list[str]
    counts: list[int]
    text_field: str = "text"
    sample_by: str = "document"
    where: str = ""
    route: ColumnRoute | None = None  # kind column: which rows are this domain's

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
        if self.kind == "column":
            assert self.route is not None
            return rebatch(self.route.texts(path, self.text_field, self.where), rows)
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


# -- JSON lines split by a domain column -------------------------------------------------------


def column_value(row: dict[str, Any], column: str, nested: bool) -> str:
    """The domain of a row: `str` of the column's value, as the former `datasets` route gave it (a
    missing value is None, hence the domain "None"). `nested`: `a.b` is field `b` of the object
    in field `a` (The Pile's `meta.pile_set_name`), as `datasets`' `flatten()` made it."""
    if not nested:
        return str(row.get(column))
    value: Any = row
    for key in column.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return str(value)


@dataclass(frozen=True)
class ColumnRoute:
    """Which rows of a dataset's files are one domain's: those whose column holds `value`. With
    `codes` (per file, a `.npy` of each row's value number, written by the scan), only the
    domain's own rows are parsed: a file's JSON is not parsed again for every domain."""

    column: str
    nested: bool
    value: str
    code: int = -1
    codes: dict[str, str] | None = None

    def texts(self, path: str, text_field: str, where: str) -> Iterator[Any]:
        if self.codes is None:
            for row in _jsonl_objects([path], where):
                if column_value(row, self.column, self.nested) == self.value:
                    yield row.get(text_field)
            return
        import numpy as np

        codes = np.load(self.codes[path], mmap_mode="r")
        row = 0
        with open_binary(path) as f:
            for raw in f:
                # The scan checked every non-blank line is a JSON object, hence starts with `{`
                # after JSON whitespace; any other line is blank, as _jsonl_objects skips it.
                if raw.lstrip()[:1] != b"{":
                    continue
                if codes[row] == self.code:
                    yield json.loads(raw.decode("utf-8")).get(text_field)
                row += 1


def _flat_names(row: dict[str, Any], prefix: str, names: dict[str, None]) -> None:
    for key, value in row.items():
        if isinstance(value, dict) and value:
            _flat_names(value, f"{prefix}{key}.", names)
        else:
            names[f"{prefix}{key}"] = None


@dataclass(frozen=True)
class ColumnScan:
    """One pass over a dataset split by a domain column: each value's rows per file (what the
    split and the per-(domain, file) tasks need), and the dataset's fields, as `datasets` named
    them. Memory: values x files counts, whatever the dataset's size."""

    files: list[str]
    column: str
    nested: bool
    counts: dict[str, list[int]]
    fields: list[str]
    codes: dict[str, str] | None = None  # file -> its rows' value numbers (.npy), when written

    def rows(self, value: str, text_field: str, where: str) -> FileRows:
        code = list(self.counts).index(value)
        route = ColumnRoute(self.column, self.nested, value, code, self.codes)
        return FileRows("column", self.files, self.counts[value], text_field, where=where, route=route)


def scan_column(files: list[str], column: str, where: str, codes_dir: Path | None = None) -> ColumnScan:
    """Count each value of `column` per JSON-lines file; with `codes_dir`, also write each file's
    rows' value numbers there (4 bytes a row, one file's held at a time), so that a domain's reads
    parse only its own rows. The column `a.b` is a nested field when no row has a top-level key
    `a.b` (as the former route flattened the dataset only then)."""
    nonempty = [f for f in files if Path(f).stat().st_size > 0]  # as `datasets` skipped them
    if not nonempty:
        raise DataError(f"{where}: empty domain ({', '.join(files)}: empty file)")
    files = nonempty
    dotted = "." in column
    counts: dict[bool, dict[str, list[int]]] = {False: {}, True: {}}
    keys: dict[str, None] = {}
    flat: dict[str, None] = {}
    written: dict[bool, dict[str, str]] = {False: {}, True: {}}
    number: dict[bool, dict[str, int]] = {False: {}, True: {}}
    for i, path in enumerate(files):
        numbers: dict[bool, array.array] = {False: array.array("I"), True: array.array("I")}
        for row in _jsonl_objects([path], where):
            keys.update(dict.fromkeys(row))
            for nested in (False, True) if dotted else (False,):
                per_value, value = counts[nested], column_value(row, column, nested)
                if value not in per_value:
                    per_value[value] = [0] * len(files)
                    number[nested][value] = len(number[nested])  # the value's place in `counts`
                per_value[value][i] += 1
                numbers[nested].append(number[nested][value])
            if dotted:
                _flat_names(row, "", flat)
        if codes_dir is not None:
            for nested in (False, True) if dotted else (False,):
                written[nested][path] = _save_codes(codes_dir, f"{i}-{int(nested)}", numbers[nested])
    nested = dotted and column not in keys
    fields = list(flat if nested else keys)
    if column not in fields:
        raise DataError(
            f"data.domain_column: {', '.join(files)} have no column {column!r} (columns: {', '.join(fields)})"
        )
    return ColumnScan(files, column, nested, counts[nested], fields, written[nested] if codes_dir else None)


def _save_codes(codes_dir: Path, name: str, numbers: array.array) -> str:
    import numpy as np

    codes_dir.mkdir(parents=True, exist_ok=True)
    path = codes_dir / f"column-codes-{name}.npy"
    np.save(path, np.frombuffer(numbers, dtype=np.uint32))
    return str(path)


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
