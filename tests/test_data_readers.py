"""Streaming readers (data/sources/readers.py, issue 42): rows read lazily in bounded batches, the same
rows as the whole-file reads, `.jsonl.zst` a known format."""

import itertools
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.config import DataConfig, DomainSource
from data.errors import DataError
from data.preprocess.preprocess import preprocess
from data.sources import readers
from data.sources.sources import SourceReader, plan_domains


def _lines(n: int) -> bytes:
    return "".join(json.dumps({"text": f"doc {i} ünï"}) + "\n" for i in range(n)).encode()


def test_jsonl_rows_are_read_lazily_after_the_scan(tmp_path):
    """The scan counts; `batches` re-reads the file batch by batch: a corrupt tail is reached
    only when the read gets there (nothing held beyond one batch)."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(_lines(100))
    rows = readers.jsonl_rows([str(path)], "text", "domain 'a'")
    assert rows.num_rows == 100
    path.write_bytes(_lines(100)[:-20] + b"{broken\n")
    batches = rows.batches(8)
    assert next(batches) == [f"doc {i} ünï" for i in range(8)]
    assert [len(b) for b in itertools.islice(batches, 11)] == [8] * 11
    with pytest.raises(DataError, match=r"line 100: not valid JSON"):
        list(rows.batches(8))


def test_zst_jsonl_gives_the_stores_of_the_plain_file(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    for d in (plain, packed):
        d.mkdir()
    (plain / "a.jsonl").write_bytes(_lines(200))
    (packed / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_lines(200)))
    built = []
    for d, name in ((plain, "a.jsonl"), (packed, "a.jsonl.zst")):
        cfg = DataConfig(
            domains=[DomainSource(name="a", paths=[str(d / name)])],
            store_dir=str(d / "stores"),
            num_proc=1,
            validation_fraction=0.1,
        )
        preprocess(cfg, progress=False)
        built.append({f: (d / "stores" / "a" / f).read_bytes() for f in ("train.bin", "train.idx", "validation.bin")})
    assert built[0] == built[1] and len(built[0]["validation.bin"]) > 0


def test_zst_without_zstandard_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd")
    cfg = DataConfig(domains=[DomainSource(name="a", paths=[str(path)])], store_dir=str(tmp_path / "s"), num_proc=1)
    with pytest.raises(DataError) as e:
        SourceReader(cfg, None).open(plan_domains(cfg)[0])
    assert str(e.value) == (
        f"{path}: reading .zst files needs the zstandard package: pip install 'doremi-mix[zst]' (or: pip install zstandard)"
    )
    assert not (tmp_path / "s").exists()


TEXT = "p1 l1\r\np1 l2\n\n\np2\rp2b\n\n\n\nx\u2028y\n\n" + "long " * 40 + "\n\nlast"


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 20])
def test_text_rows_do_not_depend_on_the_read_chunk(tmp_path, monkeypatch, chunk):
    """Paragraphs straddling a chunk boundary, `\\r\\n` split across reads: the rows are those of
    the whole text (universal newlines, as `datasets`' text builder reads)."""
    monkeypatch.setattr(readers, "TEXT_CHUNK", chunk)
    path = tmp_path / "a.txt"
    path.write_bytes(TEXT.encode())
    whole = TEXT.replace("\r\n", "\n").replace("\r", "\n")
    paragraphs = list(readers.iter_text([str(path)], "paragraph", "d"))
    assert paragraphs == [p for p in whole.split("\n\n") if p]
    assert paragraphs[:2] == ["p1 l1\np1 l2", "\np2\np2b"]
    lines = list(readers.iter_text([str(path)], "line", "d"))
    assert lines == whole.split("\n") and lines[9] == "x\u2028y"
    assert list(readers.iter_text([str(path)], "document", "d")) == [whole]


@pytest.mark.parametrize("sample_by", ["line", "paragraph", "document"])
def test_text_rows_are_those_of_datasets_text_builder(tmp_path, sample_by):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "a.txt"
    path.write_bytes(TEXT.encode())
    ds = datasets.load_dataset(
        "text", data_files=[str(path)], split="train", sample_by=sample_by, cache_dir=str(tmp_path / "c")
    )
    assert list(readers.iter_text([str(path)], sample_by, "d")) == ds["text"]


def test_parquet_and_arrow_read_in_bounded_batches(tmp_path):
    texts = [f"t{i}" for i in range(50)]
    table = pa.table({"id": list(range(50)), "text": texts})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=16)
    with pa.ipc.new_file(tmp_path / "a.arrow", table.schema) as w:  # the IPC file format
        w.write_table(table, max_chunksize=32)
    for rows in (
        readers.parquet_rows([str(tmp_path / "a.parquet")], "text", "d"),
        readers.arrow_rows([str(tmp_path / "a.arrow")], "text", "d"),
    ):
        assert rows.num_rows == 50
        batches = list(rows.batches(10))
        assert max(len(b) for b in batches) <= 10 and sum(batches, []) == texts
    with pytest.raises(DataError, match=r"have no field 'body' \(fields: id, text\); set text_field$"):
        readers.parquet_rows([str(tmp_path / "a.parquet")], "body", "d")
