"""Where each domain's documents come from: local files (JSON lines, text, parquet and arrow
streamed by data.sources.readers, csv and whole-JSON files through `datasets`), one dataset split by a
domain column, a hub dataset, the embedded corpus, or a synthetic generator.

`plan_domains` resolves the config into one `DomainPlan` per domain (with a fingerprint of its
inputs, cheap enough to decide whether preprocessing can be skipped) and checks that every file
exists. `SourceReader.open` then loads a text domain as a `TextSource` (rows in order, read in
batches); errors name the domain, the file and the field.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data.config import DataConfig, DomainSource, SyntheticSpec
from data.errors import DataError
from data.progress import datasets_bars
from data.sources.readers import (
    ColumnScan,
    FileRows,
    arrow_rows,
    first_non_utf8,
    iter_jsonl,
    jsonl_rows,
    open_binary,
    parquet_rows,
    rebatch,
    scan_column,
    scan_jsonl,
    text_rows,
)

CORPUS_DIR = Path(__file__).resolve().parents[1] / "corpus"
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".arrow": "arrow",
    ".csv": "csv",
}


def embedded_domains() -> list[str]:
    return sorted(p.name[: -len(".jsonl.gz")] for p in CORPUS_DIR.glob("*.jsonl.gz"))


def embedded_path(name: str) -> Path:
    path = CORPUS_DIR / f"{name}.jsonl.gz"
    if not path.is_file():
        raise DataError(f"embedded corpus {name!r} not found; available: {', '.join(embedded_domains())}")
    return path


def read_embedded(name: str) -> list[str]:
    """The documents of embedded corpus domain `name`, in order."""
    with gzip.open(embedded_path(name), "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def file_format(path: str) -> str:
    name = path.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    ext = Path(name).suffix
    if ext not in FORMATS:
        raise DataError(
            f"{path}: unknown file type {ext or '(none)'!r}; expected one of "
            f"{', '.join(sorted(FORMATS))} (optionally compressed)"
        )
    return FORMATS[ext]


def expand_paths(paths: list[str], where: str) -> list[str]:
    """Files named by `paths` (globs allowed), each of which must exist."""
    out: list[str] = []
    for p in paths:
        matches = sorted(glob.glob(str(Path(p).expanduser()))) if glob.has_magic(p) else [str(Path(p).expanduser())]
        if not matches or not Path(matches[0]).exists():
            raise DataError(f"{where}: file {p} not found")
        for m in matches:
            if not Path(m).is_file():
                raise DataError(f"{where}: {m} is not a file")
        out.extend(matches)
    return out


#: JSON-lines files are read here (data.sources.readers), without `datasets` (which a GPU machine may lack).
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz", ".jsonl.bz2", ".jsonl.zst")


def jsonl_opener(path: str) -> Callable[..., Any] | None:
    name = path.lower()
    return open_binary if name.endswith(JSONL_SUFFIXES) else None


def read_jsonl_rows(files: list[str], text_field: str, where: str) -> list[Any]:
    """`text_field` of every line of JSON-lines files, in order, as a list (data.sources.readers streams
    them; this is for small files and tests)."""
    scan_jsonl(files, text_field, where)
    return list(iter_jsonl(files, text_field, where))


def file_rows(fmt: str, files: list[str], plan: DomainPlan, where: str) -> FileRows | None:
    """The domain's files read by a streaming reader (data.sources.readers), or None where only
    `datasets` reads them (csv, whole-JSON `.json`, `.lz4` and compressed parquet/arrow)."""
    compressed = any(f.lower().endswith(COMPRESSION_SUFFIXES) for f in files)
    if all(jsonl_opener(f) for f in files):
        return jsonl_rows(files, plan.text_field, where)
    if fmt == "text" and not any(f.lower().endswith(".lz4") for f in files):
        assert plan.source is not None
        return text_rows(files, plan.source.sample_by, where)
    if fmt in ("parquet", "arrow") and not compressed:
        nonempty = [f for f in files if Path(f).stat().st_size > 0]
        if not nonempty:
            raise DataError(f"{where}: empty domain ({', '.join(files)}: empty file)")
        read = parquet_rows if fmt == "parquet" else arrow_rows
        return read(nonempty, plan.text_field, where)
    return None


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class DomainPlan:
    """One domain, resolved: `kind` is `files`, `column`, `hub`, `embedded` or `synthetic`."""

    name: str
    kind: str
    fingerprint: str
    description: str
    files: list[str] = field(default_factory=list)
    text_field: str = "text"
    source: DomainSource | None = None
    synthetic: SyntheticSpec | None = None


def _file_group(paths: list[str], where: str) -> tuple[list[str], str]:
    files = expand_paths(paths, where)
    formats = {file_format(f) for f in files}
    if len(formats) > 1:
        raise DataError(f"{where}: files of different types ({', '.join(sorted(formats))}); one type per source")
    return files, formats.pop()


def shared_dataset_digest(cfg: DataConfig) -> str | None:
    """Fingerprint of `data.dataset` (the one dataset split by a domain column), if any."""
    if not cfg.dataset:
        return None
    files, fmt = _file_group(cfg.dataset, "data.dataset")
    return digest([fmt, cfg.domain_column, cfg.text_field] + [file_digest(f) for f in files])


def plan_domains(cfg: DataConfig) -> list[DomainPlan]:
    """Resolve and check every listed domain's source and fingerprint its inputs. With
    `data.dataset` and no source-less domain listed, the column's values add domains later
    (`column_plans`), once the dataset is read."""
    shared = shared_dataset_digest(cfg)
    return [_domain_plan(cfg, i, d, shared) for i, d in enumerate(cfg.domains)]


def _domain_plan(cfg: DataConfig, i: int, d: DomainSource, shared: str | None) -> DomainPlan:
    """Domain `i`'s plan by the kind of its source; the options that change its documents
    (`common`) enter the fingerprint of every read source."""
    where = f"data.domains[{i}] ({d.name})"
    text_field = d.text_field or cfg.text_field
    common = {"text_field": text_field, "max_documents": d.max_documents, "sample_by": d.sample_by}
    if d.synthetic is not None:
        return DomainPlan(
            d.name,
            "synthetic",
            digest(["synthetic", asdict(d.synthetic)]),
            f"synthetic:{d.synthetic.kind}",
            synthetic=d.synthetic,
        )
    if d.embedded:
        return _embedded_plan(d, d.embedded)
    if d.paths:
        return _files_plan(d, where, text_field, common)
    if d.hub:
        return _hub_plan(d, text_field, common)
    return DomainPlan(
        d.name,
        "column",
        digest(["column", shared, d.name, common]),
        f"column:{cfg.domain_column}={d.name}",
        text_field=text_field,
        source=d,
    )


def _embedded_plan(d: DomainSource, name: str) -> DomainPlan:
    path = embedded_path(name)
    return DomainPlan(
        d.name,
        "embedded",
        digest(["embedded", file_digest(str(path)), d.max_documents]),
        f"embedded:{name}",
        source=d,
        text_field="text",
    )


def _files_plan(d: DomainSource, where: str, text_field: str, common: dict[str, Any]) -> DomainPlan:
    files, fmt = _file_group(d.paths, where)
    fp = digest(["files", fmt, common] + [file_digest(f) for f in files])
    return DomainPlan(
        d.name,
        "files",
        fp,
        f"files:{','.join(Path(f).name for f in files)}",
        files=files,
        text_field=text_field,
        source=d,
    )


def _hub_plan(d: DomainSource, text_field: str, common: dict[str, Any]) -> DomainPlan:
    pinned = [{"config": d.hub_config, "revision": d.hub_revision}] if d.hub_config or d.hub_revision else []
    config = f"/{d.hub_config}" if d.hub_config else ""
    revision = f"@{d.hub_revision}" if d.hub_revision else ""
    return DomainPlan(
        d.name,
        "hub",
        digest(["hub", d.hub, d.hub_split, common] + pinned),
        f"hub:{d.hub}{config}[{d.hub_split}]{revision}",
        text_field=text_field,
        source=d,
    )


def needs_column_plans(cfg: DataConfig, plans: list[DomainPlan]) -> bool:
    return bool(cfg.dataset) and not any(p.kind == "column" for p in plans)


def known_domains(cfg: DataConfig) -> list[str] | None:
    """The domain names, before any work: the config's when it lists them all, else (one
    dataset split by a column) the built stores', else None (known only once it is read)."""
    if not cfg.dataset or any(not (d.paths or d.hub or d.embedded or d.synthetic) for d in cfg.domains):
        return [d.name for d in cfg.domains]
    from data.store.store import MANIFEST_FILE, read_manifest

    if (Path(cfg.store_dir) / MANIFEST_FILE).is_file():
        return read_manifest(cfg.store_dir).domain_names
    return None


def column_plans(cfg: DataConfig, reader: SourceReader, plans: list[DomainPlan]) -> list[DomainPlan]:
    """One domain per value of `data.domain_column` (sorted), after the listed domains."""
    shared = shared_dataset_digest(cfg)
    out = []
    for value in reader.column_values():
        if any(p.name == value for p in plans):
            raise DataError(
                f"data.domains: domain {value!r} is named twice (in data.domains and as a "
                f"value of column {cfg.domain_column!r})"
            )
        out.append(
            DomainPlan(
                value,
                "column",
                digest(["column", shared, value, cfg.text_field]),
                f"column:{cfg.domain_column}={value}",
                text_field=cfg.text_field,
                source=DomainSource(name=value),
            )
        )
    return out


@dataclass
class TextSource:
    """A text domain's rows, in order; `batches(n)` yields lists of up to n texts (None or
    non-strings are passed through for the caller to reject)."""

    name: str
    num_rows: int
    read: Callable[[int], Iterator[list[Any]]]
    # Local files read by data.sources.readers: the first `num_rows` of their rows, in file order, can
    # be read as one task per file (data.preprocess.tasks).
    files: FileRows | None = None

    def batches(self, rows: int) -> Iterator[list[Any]]:
        return self.read(rows)


def _list_batches(texts: list[Any]) -> Callable[[int], Iterator[list[Any]]]:
    def read(rows: int) -> Iterator[list[Any]]:
        for i in range(0, len(texts), rows):
            yield texts[i : i + rows]

    return read


def _dataset_batches(ds: Any, text_field: str) -> Callable[[int], Iterator[list[Any]]]:
    def read(rows: int) -> Iterator[list[Any]]:
        for batch in ds.select_columns([text_field]).iter(batch_size=rows):
            yield batch[text_field]

    return read


def _streamed(plan: DomainPlan, ds: Any, where: str) -> TextSource:
    """A streamed hub dataset (an IterableDataset) as a TextSource: a first pass counts the rows
    (at most max_documents), as the split needs their number; every read streams again."""
    assert plan.source is not None
    limit = plan.source.max_documents
    field = plan.text_field
    first = next(iter(ds.take(1)), None)
    if first is not None and field not in first:
        raise DataError(f"{where} have no field {field!r} (fields: {', '.join(first)}); set text_field")

    def values() -> Iterator[Any]:
        return itertools.islice((row.get(field) for row in ds), limit)

    try:
        num_rows = sum(1 for _ in values())
    except Exception as e:  # the stream's own errors (network, format): the first line
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{where}: could not be read: {msg}") from None

    def read(rows: int) -> Iterator[list[Any]]:
        return rebatch(itertools.islice(values(), num_rows), rows)

    return TextSource(plan.name, num_rows, read)


class SourceReader:
    """Loads text domains through `datasets`; `cache_dir` holds the Arrow caches of local files
    (a staging directory that the caller removes), hub datasets use the default HF cache."""

    def __init__(self, cfg: DataConfig, cache_dir: Path | None):
        self.cfg = cfg
        self.cache_dir = cache_dir
        self._shared: Any = None
        self._shared_index: dict[str, list[int]] | None = None
        self._scan: ColumnScan | None = None

    def _load(self, fmt: str, files: list[str], where: str, sample_by: str = "document") -> Any:
        import datasets

        nonempty = [f for f in files if Path(f).stat().st_size > 0]
        if not nonempty:
            raise DataError(f"{where}: empty domain ({', '.join(files)}: empty file)")
        files = nonempty
        kwargs: dict[str, Any] = {"sample_by": sample_by} if fmt == "text" else {}
        try:
            with datasets_bars(False):  # local files: no "Generating train split" bars
                return datasets.load_dataset(
                    fmt,
                    data_files=files,
                    split="train",
                    cache_dir=str(self.cache_dir) if self.cache_dir else None,
                    **kwargs,
                )
        except Exception as e:  # datasets raises many types; report the first line
            bad = next((b for f in files if (b := first_non_utf8(f))), None) if fmt in ("text", "csv", "json") else None
            if bad is not None:  # the file and line, not a position in datasets' buffer
                raise DataError(f"{where}: {bad}") from None
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{where}: could not read {', '.join(files)} as {fmt} ({msg})") from None

    def _shared_dataset(self) -> tuple[Any, dict[str, list[int]]]:
        if self._shared is None:
            files, fmt = _file_group(self.cfg.dataset, "data.dataset")
            ds = self._load(fmt, files, "data.dataset")
            col = self.cfg.domain_column
            if col not in ds.column_names and "." in (col or ""):
                ds = ds.flatten()  # `meta.pile_set_name`: a field of a struct column (The Pile's files)
            if col not in ds.column_names:
                raise DataError(
                    f"data.domain_column: {', '.join(files)} have no column {col!r} "
                    f"(columns: {', '.join(ds.column_names)})"
                )
            index: dict[str, list[int]] = {}
            for i, v in enumerate(ds[col]):
                index.setdefault(str(v), []).append(i)
            self._shared, self._shared_index = ds, index
        assert self._shared_index is not None
        return self._shared, self._shared_index

    def _column_scan(self) -> ColumnScan | None:
        """JSON lines split by a domain column, streamed (data.sources.readers.scan_column: counts per
        value and file, not an index of every row); None for other formats (`datasets`)."""
        if self._scan is None:
            files, _ = _file_group(self.cfg.dataset, "data.dataset")
            if not all(jsonl_opener(f) for f in files):
                return None
            codes = self.cache_dir / "column-codes" if self.cache_dir else None  # lives as long as the build
            self._scan = scan_column(files, self.cfg.domain_column or "", "data.dataset", codes)
        return self._scan

    def column_values(self) -> list[str]:
        scan = self._column_scan()
        return sorted(scan.counts) if scan is not None else sorted(self._shared_dataset()[1])

    def _column_source(self, plan: DomainPlan, scan: ColumnScan, where: str) -> TextSource:
        if plan.name not in scan.counts:
            raise DataError(f"{where}: empty domain: no row of data.dataset has {scan.column}={plan.name!r}")
        if plan.text_field not in scan.fields:
            raise DataError(
                f"{where}: data.dataset have no field {plan.text_field!r} (fields: "
                f"{', '.join(scan.fields)}); set text_field"
            )
        rows = scan.rows(plan.name, plan.text_field, "data.dataset")
        assert plan.source is not None
        return self._limit(TextSource(plan.name, rows.num_rows, rows.batches, rows), plan.source.max_documents)

    def open(self, plan: DomainPlan) -> TextSource:
        where = f"domain {plan.name!r}"
        src = plan.source
        assert src is not None
        if plan.kind == "embedded":
            texts: list[Any] = read_embedded(src.embedded or "")
            return self._limit(TextSource(plan.name, len(texts), _list_batches(texts)), src.max_documents)
        rows = file_rows(file_format(plan.files[0]), plan.files, plan, where) if plan.kind == "files" else None
        if rows is not None:
            if not rows.num_rows:
                raise DataError(f"{where}: empty domain ({', '.join(plan.files)}: empty file)")
            return self._limit(TextSource(plan.name, rows.num_rows, rows.batches, rows), src.max_documents)
        if plan.kind == "files":
            fmt = file_format(plan.files[0])
            ds = self._load(fmt, plan.files, where, src.sample_by)
            files = ", ".join(plan.files)
        elif plan.kind == "hub":
            import datasets

            try:
                with datasets_bars(not Path(src.hub).is_dir()):  # a local dataset directory: no bars
                    ds = datasets.load_dataset(
                        src.hub,
                        name=src.hub_config,
                        split=src.hub_split,
                        revision=src.hub_revision,
                        streaming=src.hub_streaming,
                    )
            except Exception as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise DataError(f"{where}: {plan.description} could not be loaded (offline?): {msg}") from None
            files = f"hub dataset {src.hub}"
            if src.hub_streaming:
                return _streamed(plan, ds, f"{where}: {files}")
        else:
            if (scan := self._column_scan()) is not None:
                return self._column_source(plan, scan, where)
            shared, index = self._shared_dataset()
            if plan.name not in index:
                raise DataError(
                    f"{where}: empty domain: no row of data.dataset has {self.cfg.domain_column}={plan.name!r}"
                )
            ds = shared.select(index[plan.name])
            files = "data.dataset"
        if plan.text_field not in ds.column_names:
            raise DataError(
                f"{where}: {files} have no field {plan.text_field!r} (fields: "
                f"{', '.join(ds.column_names)}); set text_field"
            )
        if src.max_documents is not None and src.max_documents < len(ds):
            ds = ds.select(range(src.max_documents))
        return TextSource(plan.name, len(ds), _dataset_batches(ds, plan.text_field))

    @staticmethod
    def _limit(source: TextSource, max_documents: int | None) -> TextSource:
        if max_documents is None or max_documents >= source.num_rows:
            return source
        inner = source.read

        def read(rows: int) -> Iterator[list[Any]]:
            left = max_documents
            for batch in inner(rows):
                if left <= 0:
                    return
                yield batch[:left]
                left -= len(batch)

        return TextSource(source.name, max_documents, read, source.files)
