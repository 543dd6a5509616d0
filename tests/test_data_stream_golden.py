"""The stores of every existing source kind stay byte-identical to what the code before the
streaming readers (issue 42) produced: a study trains on stores built by that code.

EXPECTED holds the XXH3-64 hashes of the store files (tokens, offsets of both splits, the
tokenizer) and of the manifest's content, computed with the code at commit 4f0024c, i.e. BEFORE
the streaming readers replaced `read_jsonl_rows` and the `datasets` loads of text, parquet and
arrow files. They cannot be recomputed from the old code path after the change, so they are
committed here; a change to them is a change to the bytes of existing stores.

Manifest fields that depend on the bytes of binary or compressed inputs (the fingerprints of
parquet, arrow and compressed files, whose bytes may differ between library versions) are left
out of its hash; the fingerprints of plain-text inputs are kept.
"""

import bz2
import gzip
import json
import lzma

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.config import DataConfig, DomainSource, TokenizerConfig
from data.preprocess.preprocess import preprocess
from tests.store_hashes import store_hashes

PLAIN = {"j", "jmax", "tline", "tpara", "tdoc", "emb"}


def _texts(n: int, seed: int) -> list[str]:
    words = ["data", "mixing", "ünï", "✓", "weights", "domain", "x = 1", "\t", "Ωmega", "日本語", "'q'", '"dq"']
    out = []
    for i in range(n):
        k = 3 + (i * 7 + seed) % 11
        out.append(" ".join(words[(i * j + seed) % len(words)] for j in range(k)) + f" {i * seed}")
    return out


def _jsonl_bytes(texts: list[str]) -> bytes:
    lines = []
    for i, t in enumerate(texts):
        if i % 9 == 4:
            lines.append("")  # blank line: not a row
        if i % 13 == 5:
            lines.append(json.dumps({"id": i}))  # no text field: a row, dropped as empty
        elif i % 17 == 6:
            lines.append(json.dumps({"text": "   \n ", "id": i}))  # whitespace only: a row, dropped
        else:
            lines.append(json.dumps({"text": t, "id": i, "meta": {"k": i}}, ensure_ascii=i % 2 == 0))
    return ("\n".join(lines) + "\n").encode()


def _text_file(texts: list[str]) -> bytes:
    parts = []
    for i, t in enumerate(texts):
        sep = ["\n", "\r\n", "\n\n", "\r", "\n\n\n", "\u2028\n"][i % 6]
        parts.append(t + sep)
    return "".join(parts).encode()


def golden_corpus(tmp_path) -> dict[str, list[str]]:
    d = tmp_path / "in"
    d.mkdir()
    (d / "j.jsonl").write_bytes(_jsonl_bytes(_texts(60, 1)))
    (d / "jgz.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(_texts(50, 2)), mtime=0))
    (d / "jxz.jsonl.xz").write_bytes(lzma.compress(_jsonl_bytes(_texts(45, 3))))
    (d / "jbz.jsonl.bz2").write_bytes(bz2.compress(_jsonl_bytes(_texts(40, 4))))
    (d / "jmax.jsonl").write_bytes(_jsonl_bytes(_texts(30, 5)))
    (d / "a.txt").write_bytes(_text_file(_texts(70, 6)))
    (d / "b.txt").write_bytes(_text_file(_texts(20, 7)))
    (d / "empty.txt").write_bytes(b"")
    (d / "tgz.txt.gz").write_bytes(gzip.compress(_text_file(_texts(35, 8)), mtime=0))
    table = pa.table({"id": list(range(55)), "text": _texts(55, 9)})
    pq.write_table(table.slice(0, 30), d / "p0.parquet", row_group_size=7)
    pq.write_table(table.slice(30), d / "p1.parquet", row_group_size=10)
    with pa.ipc.new_stream(d / "s.arrow", table.schema) as w:
        for batch in pa.table({"id": list(range(33)), "text": _texts(33, 10)}).to_batches(max_chunksize=8):
            w.write_batch(batch)
    (d / "c.csv").write_text(
        "id,text\n" + "".join(f'{i},"{t.replace(chr(34), chr(34) * 2)}"\n' for i, t in enumerate(_texts(25, 11)))
    )
    rows = [{"text": t, "src": ["web", "code", "books"][i % 3]} for i, t in enumerate(_texts(48, 12))]
    (d / "col.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "j": [str(d / "j.jsonl")],
        "jgz": [str(d / "jgz.jsonl.gz")],
        "jxz": [str(d / "jxz.jsonl.xz")],
        "jbz": [str(d / "jbz.jsonl.bz2")],
        "jmax": [str(d / "jmax.jsonl")],
        "txt": [str(d / "a.txt"), str(d / "empty.txt"), str(d / "b.txt")],
        "tgz": [str(d / "tgz.txt.gz")],
        "pq": [str(d / "p*.parquet")],
        "arrow": [str(d / "s.arrow")],
        "csv": [str(d / "c.csv")],
        "col": [str(d / "col.jsonl")],
    }


def golden_configs(tmp_path, paths: dict[str, list[str]]) -> dict[str, DataConfig]:
    files = [
        DomainSource(name="j", paths=paths["j"]),
        DomainSource(name="jgz", paths=paths["jgz"]),
        DomainSource(name="jxz", paths=paths["jxz"]),
        DomainSource(name="jbz", paths=paths["jbz"]),
        DomainSource(name="jmax", paths=paths["jmax"], max_documents=11),
        DomainSource(name="tline", paths=paths["txt"], sample_by="line"),
        DomainSource(name="tpara", paths=paths["txt"], sample_by="paragraph"),
        DomainSource(name="tdoc", paths=paths["txt"], sample_by="document"),
        DomainSource(name="tgz", paths=paths["tgz"], sample_by="line", max_documents=20),
        DomainSource(name="pq", paths=paths["pq"]),
        DomainSource(name="arrow", paths=paths["arrow"], max_documents=21),
        DomainSource(name="csv", paths=paths["csv"]),
        DomainSource(name="emb", embedded="notes", max_documents=25),
    ]
    common = {"validation_fraction": 0.2, "split_seed": 7, "num_proc": 1}
    bpe_domains = [DomainSource(name=d.name, paths=d.paths, sample_by=d.sample_by) for d in files[:8]]
    return {
        "byte": DataConfig(domains=files, store_dir=str(tmp_path / "byte"), **common),
        "bpe": DataConfig(
            domains=bpe_domains,
            store_dir=str(tmp_path / "bpe"),
            tokenizer=TokenizerConfig(kind="bpe", vocab_size=300),
            **common,
        ),
        "column": DataConfig(
            domains=[],
            dataset=paths["col"],
            domain_column="src",
            store_dir=str(tmp_path / "column"),
            **common,
        ),
    }


EXPECTED: dict[str, dict[str, str]] = {
    "bpe": {
        "j/train.bin": "9626302f2135898b",
        "j/train.idx": "87d9595615b84f02",
        "j/validation.bin": "9cbb65c51abe8160",
        "j/validation.idx": "d60dddc383213502",
        "jbz/train.bin": "fd82dca14d5fae24",
        "jbz/train.idx": "68ab79c5d3fb7529",
        "jbz/validation.bin": "643cff5007d16f0c",
        "jbz/validation.idx": "67e5379021fe178b",
        "jgz/train.bin": "a222dab395b47442",
        "jgz/train.idx": "8f56dcd2538d94ab",
        "jgz/validation.bin": "a631ac62262fc2d8",
        "jgz/validation.idx": "c019bd3b24929255",
        "jmax/train.bin": "315414f76e1ebbdc",
        "jmax/train.idx": "9e087cdd9834dd5a",
        "jmax/validation.bin": "75c45f22e51e1f15",
        "jmax/validation.idx": "1c2cccb6b1a104ee",
        "jxz/train.bin": "e1d6dc84f4eae2a9",
        "jxz/train.idx": "0e1dbef4068d597a",
        "jxz/validation.bin": "a99bcf390ecac4d6",
        "jxz/validation.idx": "6d161e9de2630185",
        "manifest.json": "395eb4e95904eee3",
        "tdoc/train.bin": "fe0377b9f4f5c571",
        "tdoc/train.idx": "f5a1f717f6511675",
        "tdoc/validation.bin": "f7dfc734db85db80",
        "tdoc/validation.idx": "543e6993cec0fbe0",
        "tline/train.bin": "63ed887be2579e4f",
        "tline/train.idx": "0ebabbb7a0256415",
        "tline/validation.bin": "6921e9f648431b50",
        "tline/validation.idx": "65c961f6826da41e",
        "tokenizer.json": "ee7b3da8cb543a3e",
        "tpara/train.bin": "155115f5f7162d21",
        "tpara/train.idx": "761f1e4ae4251022",
        "tpara/validation.bin": "c85581753f154a7b",
        "tpara/validation.idx": "b6130305a7c26cb1",
    },
    "byte": {
        "arrow/train.bin": "bc3d0ccdb6b12be1",
        "arrow/train.idx": "3cebffc67c2fc40f",
        "arrow/validation.bin": "aa6f4f29a1b57e80",
        "arrow/validation.idx": "efdb5792241f46d7",
        "csv/train.bin": "1900af665c6ff29a",
        "csv/train.idx": "b64a408f2dc7782f",
        "csv/validation.bin": "680e084f166af8f5",
        "csv/validation.idx": "94f39e182fc15247",
        "emb/train.bin": "720a95cf5846cf6d",
        "emb/train.idx": "036100703f036bd7",
        "emb/validation.bin": "a71cd5343dc7a7de",
        "emb/validation.idx": "48c574ce11b59f5a",
        "j/train.bin": "2ef5780ede04f27e",
        "j/train.idx": "617c03f329fc651f",
        "j/validation.bin": "5064991bcbc3c3b8",
        "j/validation.idx": "ad4a3daa5bc31b17",
        "jbz/train.bin": "8236dfa752031e50",
        "jbz/train.idx": "1280fc6014066bf2",
        "jbz/validation.bin": "cc34103f723e192e",
        "jbz/validation.idx": "7bc68e32daec3b88",
        "jgz/train.bin": "d932fc83d3df2e56",
        "jgz/train.idx": "785124f82c7c5115",
        "jgz/validation.bin": "5624d486551d8f18",
        "jgz/validation.idx": "9e087fc87f5f5bb3",
        "jmax/train.bin": "9a8dd74d68fc9762",
        "jmax/train.idx": "5911539a9190f29a",
        "jmax/validation.bin": "9516fd201948ea42",
        "jmax/validation.idx": "ac6ddc26c5608f0e",
        "jxz/train.bin": "c5ae972002bc917a",
        "jxz/train.idx": "076f54de88f399c9",
        "jxz/validation.bin": "b876253195c4fdd9",
        "jxz/validation.idx": "20bba41e25593851",
        "manifest.json": "d7557cd109fd03ca",
        "pq/train.bin": "ef6773722e934a7e",
        "pq/train.idx": "9ff2903565277f8c",
        "pq/validation.bin": "5a63ac23f7f075c4",
        "pq/validation.idx": "12c98756f2848f70",
        "tdoc/train.bin": "9cc0cf1a042b9af4",
        "tdoc/train.idx": "7bdf84183de0678a",
        "tdoc/validation.bin": "c3e63eb80866b810",
        "tdoc/validation.idx": "2c9f8439ff23937f",
        "tgz/train.bin": "74fb6b2875db84cf",
        "tgz/train.idx": "9cab1618396465f0",
        "tgz/validation.bin": "c95a771a513755a6",
        "tgz/validation.idx": "6d53e289446df717",
        "tline/train.bin": "e10ff380a3d68b0d",
        "tline/train.idx": "afef0d6f9c18b27c",
        "tline/validation.bin": "03a13ca54d6284b4",
        "tline/validation.idx": "7754d1fa9c1894ef",
        "tokenizer.json": "64b3f049b86762f4",
        "tpara/train.bin": "3ea6303abf575f9e",
        "tpara/train.idx": "22f408cbb50edc30",
        "tpara/validation.bin": "0c2e222e7a867f69",
        "tpara/validation.idx": "97f467e86acd4820",
    },
    "column": {
        "books/train.bin": "acb560d27380b362",
        "books/train.idx": "ae5d1cb879593c22",
        "books/validation.bin": "2ec460ba78f33bf6",
        "books/validation.idx": "eecb7aa437329fce",
        "code/train.bin": "8ab4d9364a159c79",
        "code/train.idx": "2d9b6f136f372bba",
        "code/validation.bin": "f254bf10a5b1fb5f",
        "code/validation.idx": "6eb0189edf749ecc",
        "manifest.json": "4308c65f6ddc15dc",
        "tokenizer.json": "64b3f049b86762f4",
        "web/train.bin": "b21b72a82df72adb",
        "web/train.idx": "93a0e01adbbf7def",
        "web/validation.bin": "ef583bc2b06059c7",
        "web/validation.idx": "38ea0a7f171bcc5a",
    },
}


@pytest.mark.parametrize("name", ["byte", "bpe", "column"])
def test_stores_are_byte_identical_to_before_streaming(tmp_path, name):
    cfg = golden_configs(tmp_path, golden_corpus(tmp_path))[name]
    preprocess(cfg, progress=False)
    assert store_hashes(cfg.store_dir, PLAIN) == EXPECTED[name]
