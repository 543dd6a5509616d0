"""The domain-column route (one file set, a column names the domain: The Pile's
`meta.pile_set_name`) read by streaming JSON lines (data/sources/readers.py `column_rows`, issue 42
item 1), in memory bounded by one batch, as per-(domain, file) tasks.

EXPECTED holds the XXH3-64 hashes of the store files, computed with the code before this change
(the route through `datasets`, which held the whole column and a per-domain index of every row in
memory): the streamed route gives the same bytes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from data.config import DataConfig, DomainSource, TokenizerConfig
from data.errors import DataError
from data.preprocess.preprocess import preprocess
from tests.store_hashes import store_hashes

zstandard = pytest.importorskip("zstandard")

NAMES = ["Pile-CC", "Github", "Enron Emails", "ArXiv"]


def _rows(n: int, seed: int) -> list[str]:
    words = ["data", "mixing", "ünï", "✓", "weights", "x = 1", "\t", "Ωmega", "日本語", '"dq"', "/"]
    lines = []
    for i in range(n):
        text = " ".join(words[(i * j + seed) % len(words)] for j in range(2 + (i * 5 + seed) % 9)) + f" {i}.{seed}"
        name = NAMES[(i * 3 + seed) % len(NAMES)]
        if i % 11 == 3:
            lines.append("")  # blank line: not a row
        if i % 13 == 5:
            row = {"text": text}  # no meta: the domain "None", as `datasets` gives it
        elif i % 7 == 2:
            row = {"meta": {"pile_set_name": name}, "id": i}  # no text: a row, dropped as empty
        elif i % 17 == 6:
            row = {"text": "  \n ", "meta": {"pile_set_name": name}}
        else:
            row = {"text": text, "meta": {"pile_set_name": name}, "content": f"c{i} {text[::-1]}"}
        lines.append(json.dumps(row, ensure_ascii=i % 2 == 0))
    return lines


def corpus(tmp_path: Path) -> list[str]:
    d = tmp_path / "pile"
    d.mkdir()
    for k, n in enumerate((70, 55)):
        raw = ("\n".join(_rows(n, k + 1)) + "\n").encode()
        (d / f"{k:02d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(raw))
    (d / "02.jsonl.gz").write_bytes(gzip.compress(("\n".join(_rows(40, 3)) + "\n").encode(), mtime=0))
    return [str(d / "*.jsonl.*")]


def configs(tmp_path: Path, dataset: list[str]) -> dict[str, DataConfig]:
    common = {"dataset": dataset, "domain_column": "meta.pile_set_name", "validation_fraction": 0.2, "split_seed": 5}
    return {
        "all": DataConfig(store_dir=str(tmp_path / "all"), num_proc=1, **common),
        "listed": DataConfig(
            domains=[
                DomainSource(name="Github", max_documents=9),
                DomainSource(name="Pile-CC", text_field="content"),
                DomainSource(name="None"),
                DomainSource(name="web", paths=[dataset[0]]),
            ],
            store_dir=str(tmp_path / "listed"),
            tokenizer=TokenizerConfig(kind="bpe", vocab_size=300),
            num_proc=2,
            **common,
        ),
    }


EXPECTED: dict[str, dict[str, str]] = {
    "all": {
        "ArXiv/train.bin": "d93e822e1372328b",
        "ArXiv/train.idx": "15ae741b1a00e509",
        "ArXiv/validation.bin": "ede8e4b4211c52f7",
        "ArXiv/validation.idx": "76de62bbc073a045",
        "Enron Emails/train.bin": "30be7de663dcacf0",
        "Enron Emails/train.idx": "abac57cac2b0a98c",
        "Enron Emails/validation.bin": "2dd36acf40dc093d",
        "Enron Emails/validation.idx": "4ecc633e74b93380",
        "Github/train.bin": "f028dee9af7e0864",
        "Github/train.idx": "d6a12bff7b5da939",
        "Github/validation.bin": "5a04656c5cb2ee06",
        "Github/validation.idx": "4f11d1c4b4be41d2",
        "None/train.bin": "3e1d6e274ddc8868",
        "None/train.idx": "32d21cd67cab0fcc",
        "None/validation.bin": "80a1314e688d82d6",
        "None/validation.idx": "24b2b8884527a985",
        "Pile-CC/train.bin": "7998665e6e16b5eb",
        "Pile-CC/train.idx": "c76ffea0cbce7b08",
        "Pile-CC/validation.bin": "456cef3594fc018e",
        "Pile-CC/validation.idx": "7fff4e3acf33adf3",
        "manifest.json": "bd59daa8cec1fd37",
        "tokenizer.json": "64b3f049b86762f4",
    },
    "listed": {
        "Github/train.bin": "15764e1155a8ab9d",
        "Github/train.idx": "7600211b75204590",
        "Github/validation.bin": "3ca392fa9d86b39a",
        "Github/validation.idx": "5d68fbc3a37583b1",
        "None/train.bin": "1ce86d9161623bd8",
        "None/train.idx": "47cce8aed2186f2d",
        "None/validation.bin": "2f0207188f74144f",
        "None/validation.idx": "90ab70a1acb6eadb",
        "Pile-CC/train.bin": "d03f0df1f68cf5ec",
        "Pile-CC/train.idx": "7857119e6b0c4001",
        "Pile-CC/validation.bin": "1cda1a5156366f4e",
        "Pile-CC/validation.idx": "38c8fd5438e7c23e",
        "manifest.json": "45f715b77c80330c",
        "tokenizer.json": "5d2a2d91c43ca386",
        "web/train.bin": "8e80a7a95fc40a38",
        "web/train.idx": "9d3345dc63b14bd9",
        "web/validation.bin": "345cee1972fcd8ee",
        "web/validation.idx": "02911b202433940d",
    },
}


@pytest.mark.parametrize("name", ["all", "listed"])
def test_stores_are_byte_identical_to_the_datasets_route(tmp_path, name):
    cfg = configs(tmp_path, corpus(tmp_path))[name]
    preprocess(cfg, progress=False)
    assert store_hashes(cfg.store_dir) == EXPECTED[name]


def test_the_route_streams_without_datasets(tmp_path, monkeypatch):
    """No `datasets` load (which held the whole column and an index of every row): the rows of
    each (domain, file) are a task of their own."""
    import datasets

    from data.sources.sources import SourceReader, column_plans, plan_domains

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("loaded through datasets"))
    cfg = configs(tmp_path, corpus(tmp_path))["all"]
    reader = SourceReader(cfg, None)
    plans = column_plans(cfg, reader, plan_domains(cfg))
    assert [p.name for p in plans] == ["ArXiv", "Enron Emails", "Github", "None", "Pile-CC"]
    source = reader.open(plans[3])
    assert source.files is not None and source.files.counts == [5, 4, 3] and source.num_rows == 12
    rows = [r for b in source.batches(4) for r in b]
    assert len(rows) == 12 and source.files.route.codes is None  # no cache directory: parse every row
    cached = SourceReader(cfg, tmp_path / "cache")
    source = cached.open(column_plans(cfg, cached, plan_domains(cfg))[3])
    assert source.files.route.codes is not None  # the scan's value numbers: parse own rows only
    assert [r for b in source.batches(5) for r in b] == rows
    preprocess(cfg, progress=False)
    assert store_hashes(cfg.store_dir) == EXPECTED["all"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"domain_column": "meta.name"},
            r"^data.domain_column: .*02.jsonl.gz have no column 'meta.name' "
            r"\(columns: text, meta.pile_set_name, content, id\)$",
        ),
        (
            {"domains": [DomainSource(name="Books3")]},
            r"^domain 'Books3': empty domain: no row of data.dataset has meta.pile_set_name='Books3'$",
        ),
        (
            {"text_field": "body"},
            r"^domain 'ArXiv': data.dataset have no field 'body' \(fields: text, meta.pile_set_name, content, id\); "
            r"set text_field$",
        ),
    ],
)
def test_bad_column_inputs_are_one_line_and_write_nothing(tmp_path, change, message):
    cfg = configs(tmp_path, corpus(tmp_path))["all"]
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(DataError, match=message):
        preprocess(cfg, progress=False)
    assert not [p for p in Path(cfg.store_dir).iterdir() if p.name.startswith(".tasks-")]
