import json
import os

import numpy as np
import pytest

from data.config import DataConfig, DomainSource, SyntheticSpec, TokenizerConfig
from data.errors import DataError
from data.preprocess.preprocess import StoresInUseError, byte_budgets, preprocess, tokenizer_training_texts
from data.preprocess.split import validation_mask
from data.sources.sources import SourceReader, plan_domains
from data.store.store import MANIFEST_FILE, open_stores, token_dtype
from data.tokenizer.tokenizer import ByteTokenizer, load_tokenizer

DOCS = {
    "alpha": [f"document {i}: {'ünï ✓ ' * (i % 7)}line\nsecond line {i * i}\n" for i in range(40)],
    "beta": [f"def f{i}(x):\n    return x * {i}\n" for i in range(30)],
}


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return str(path)


def config(tmp_path, domains, **kw):
    kw.setdefault("num_proc", 1)
    kw.setdefault("validation_fraction", 0.1)
    return DataConfig(domains=domains, store_dir=str(tmp_path / "stores"), **kw)


def jsonl_domains(tmp_path):
    return [DomainSource(name=n, paths=[write_jsonl(tmp_path / f"{n}.jsonl", t)]) for n, t in DOCS.items()]


def decoded_documents(stores, tok, domain):
    out = {}
    for split in ("train", "validation"):
        idx = stores.documents(domain, split)
        out[split] = [tok.decode(stores.document(domain, split, i).tolist()) for i in range(len(idx) - 1)]
    return out


def file_bytes(store):
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


def test_round_trip_counts_and_split(tmp_path):
    cfg = config(tmp_path, jsonl_domains(tmp_path))
    manifest = preprocess(cfg, progress=False)
    stores = open_stores(cfg.store_dir, expect_tokenizer=ByteTokenizer().identity)
    tok = load_tokenizer(cfg.store_dir)
    assert manifest.domain_names == ["alpha", "beta"] and manifest.dtype == "uint16"
    for name, docs in DOCS.items():
        got = decoded_documents(stores, tok, name)
        assert len(got["validation"]) == round(0.1 * len(docs))
        assert sorted(got["train"] + got["validation"]) == sorted(docs)
        # each split keeps the source order
        assert got["train"] == [d for d in docs if d in got["train"]]
        entry = manifest.domain(name)
        for split in ("train", "validation"):
            tokens, idx = stores.tokens(name, split), stores.documents(name, split)
            counts = entry.split(split)
            assert counts.documents == len(idx) - 1 == len(got[split])
            assert counts.tokens == len(tokens) == idx[-1]
            assert os.path.getsize(stores.store_dir / name / f"{split}.bin") == counts.tokens * 2
            assert counts.tokens == sum(len(d.encode()) + 1 for d in got[split])
            assert counts.bytes == sum(len(d.encode()) for d in got[split])
            assert np.all(tokens[idx[1:] - 1] == 256)  # EOS closes every document
        assert entry.entropy is None


def test_bpe_trains_on_an_equal_share_of_bytes_per_domain(tmp_path):
    """The first N bytes in domain order would leave the later domains out of the vocabulary."""
    assert byte_budgets(["a", "b", "c"], 90, "equal") == [30, 30, 30]
    assert byte_budgets(["a", "b", "c"], 90, {"a": 2, "c": 1}) == [60, 0, 30]
    cfg = config(tmp_path, jsonl_domains(tmp_path))
    reader = SourceReader(cfg, None)
    sources = []
    for p in plan_domains(cfg):
        src = reader.open(p)
        sources.append((p, src, validation_mask(src.num_rows, cfg.validation_fraction, cfg.split_seed, p.name)))
    budget = 600
    texts = list(tokenizer_training_texts(sources, budget, "equal"))
    alpha = [t for t in texts if t.startswith("document")]
    beta = [t for t in texts if t.startswith("def")]
    assert len(alpha) + len(beta) == len(texts)
    for part in (alpha, beta):
        n = sum(len(t.encode()) for t in part)
        assert budget / 2 <= n < budget / 2 + max(len(t.encode()) for t in part)
    with pytest.raises(DataError, match="train_shares: expected shares >= 0 .* unknown: gamma"):
        config(
            tmp_path,
            jsonl_domains(tmp_path),
            tokenizer=TokenizerConfig(kind="bpe", vocab_size=300, train_shares={"gamma": 1.0}),
        ).validate()


def test_rerun_does_no_work_and_changes_rebuild(tmp_path, monkeypatch):
    cfg = config(tmp_path, jsonl_domains(tmp_path))
    first = preprocess(cfg, progress=False)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "stores").rglob("*")}
    import data.preprocess.preprocess as pre

    monkeypatch.setattr(pre, "_build", lambda *a, **k: pytest.fail("rebuilt unchanged stores"))
    assert preprocess(cfg, progress=False) == first
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "stores").rglob("*")} == before
    monkeypatch.undo()
    write_jsonl(tmp_path / "beta.jsonl", DOCS["beta"][:-1])
    with pytest.raises(StoresInUseError, match=r"other inputs \(changed: domain 'beta' source; .*--force"):
        preprocess(cfg, progress=False)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "stores").rglob("*")} == before
    second = preprocess(cfg, force=True, progress=False)
    assert second.fingerprint != first.fingerprint
    assert second.domain("beta").train.documents + second.domain("beta").validation.documents == 29


def test_parallel_and_repeated_builds_are_byte_identical(tmp_path):
    one = config(tmp_path / "a", jsonl_domains(tmp_path), tokenizer=TokenizerConfig(kind="bpe", vocab_size=300))
    two = config(
        tmp_path / "b", jsonl_domains(tmp_path), tokenizer=TokenizerConfig(kind="bpe", vocab_size=300), num_proc=2
    )
    preprocess(one, progress=False)
    preprocess(two, progress=False)
    assert file_bytes(tmp_path / "a" / "stores") == file_bytes(tmp_path / "b" / "stores")
    other_seed = config(tmp_path / "c", jsonl_domains(tmp_path), split_seed=7)
    m = preprocess(other_seed, progress=False)
    tok = load_tokenizer(other_seed.store_dir)
    val_c = decoded_documents(open_stores(other_seed.store_dir), tok, "alpha")["validation"]
    tok_a = load_tokenizer(one.store_dir)
    val_a = decoded_documents(open_stores(one.store_dir), tok_a, "alpha")["validation"]
    assert m.split["seed"] == 7 and val_c != val_a


@pytest.mark.parametrize("fmt", ["json", "parquet", "txt", "arrow", "csv", "jsonl.gz"])
def test_file_formats(tmp_path, fmt):
    import datasets

    texts = DOCS["alpha"][:12]
    ds = datasets.Dataset.from_dict({"body": texts})
    if fmt == "json":
        (tmp_path / "d.json").write_text(json.dumps([{"body": t} for t in texts]))
        paths = [str(tmp_path / "d.json")]
    elif fmt == "parquet":
        ds.to_parquet(str(tmp_path / "d.parquet"))
        paths = [str(tmp_path / "d.parquet")]
    elif fmt == "csv":
        ds.to_csv(str(tmp_path / "d.csv"), index=False)
        paths = [str(tmp_path / "d.csv")]
    elif fmt == "arrow":
        ds.save_to_disk(str(tmp_path / "saved"))
        paths = [str(tmp_path / "saved" / "*.arrow")]
    elif fmt == "jsonl.gz":
        import gzip

        with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"body": t}) + "\n" for t in texts)
        paths = [str(tmp_path / "d.jsonl.gz")]
    else:
        for i, t in enumerate(texts):
            (tmp_path / f"doc{i:02d}.txt").write_text(t)
        paths = [str(tmp_path / "doc*.txt")]
    field = "text" if fmt == "txt" else "body"
    cfg = config(tmp_path, [DomainSource(name="d", paths=paths, text_field=field)])
    preprocess(cfg, progress=False)
    got = decoded_documents(open_stores(cfg.store_dir), ByteTokenizer(), "d")
    assert sorted(got["train"] + got["validation"]) == sorted(texts)


def test_domain_column_dataset(tmp_path):
    rows = [{"content": t, "src": n} for n, texts in DOCS.items() for t in texts]
    path = tmp_path / "all.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(
        dataset=[str(path)], domain_column="src", text_field="content", num_proc=1, store_dir=str(tmp_path / "stores")
    )
    manifest = preprocess(cfg, progress=False)
    assert manifest.domain_names == ["alpha", "beta"]
    stores = open_stores(cfg.store_dir)
    for name, docs in DOCS.items():
        got = decoded_documents(stores, ByteTokenizer(), name)
        assert sorted(got["train"] + got["validation"]) == sorted(docs)
    # listing domains selects and orders them (other inputs: replaced only with force)
    cfg.domains = [DomainSource(name="beta")]
    assert preprocess(cfg, force=True, progress=False).domain_names == ["beta"]


def test_max_documents_and_empty_documents_dropped(tmp_path):
    texts = ["a", "", "b", None, "c", "d"]
    path = tmp_path / "e.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = config(tmp_path, [DomainSource(name="e", paths=[str(path)], max_documents=5)], validation_fraction=0.0)
    m = preprocess(cfg, progress=False)
    assert m.domain("e").train.documents == 3 and m.domain("e").validation.documents == 0
    assert decoded_documents(open_stores(cfg.store_dir), ByteTokenizer(), "e")["train"] == ["a", "b", "c"]


# ---- bad input: one-line DataError, nothing written -------------------------------------------


def assert_nothing_written(tmp_path):
    store = tmp_path / "stores"
    assert not store.exists() or [p.name for p in store.iterdir()] == []


def test_missing_file(tmp_path):
    cfg = config(tmp_path, [DomainSource(name="x", paths=[str(tmp_path / "missing.jsonl")])])
    with pytest.raises(DataError, match=r"data.domains\[0\] \(x\): file .*missing.jsonl not found"):
        preprocess(cfg, progress=False)
    assert_nothing_written(tmp_path)


def test_missing_field_leaves_nothing_and_keeps_old_stores(tmp_path):
    domains = jsonl_domains(tmp_path)
    cfg = config(tmp_path, domains)
    preprocess(cfg, progress=False)
    before = file_bytes(tmp_path / "stores")
    domains[1].text_field = "body"
    with pytest.raises(DataError, match=r"domain 'beta': .*beta.jsonl have no field 'body' \(fields: text, id\)"):
        preprocess(cfg, force=True, progress=False)  # even when replacing
    assert file_bytes(tmp_path / "stores") == before
    assert [p.name for p in (tmp_path / "stores").iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("texts", [[], ["", None]])
def test_empty_domain(tmp_path, texts):
    path = tmp_path / "empty.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = config(
        tmp_path,
        [
            DomainSource(name="a", paths=[write_jsonl(tmp_path / "a.jsonl", ["x"])]),
            DomainSource(name="empty", paths=[str(path)]),
        ],
    )
    with pytest.raises(DataError, match="domain 'empty': empty domain"):
        preprocess(cfg, progress=False)
    assert_nothing_written(tmp_path)


def test_domain_named_twice(tmp_path):
    from trainer.config.tools import from_dict

    raw = {"domains": [{"name": "a", "embedded": "code"}, {"name": "a", "embedded": "docs"}]}
    with pytest.raises(DataError, match="data.domains: domain 'a' is named twice"):
        from_dict(DataConfig, raw, "data")
    cfg = config(tmp_path, [DomainSource(name="a", embedded="code"), DomainSource(name="a", embedded="docs")])
    with pytest.raises(DataError, match="named twice"):
        preprocess(cfg, progress=False)
    assert_nothing_written(tmp_path)


def test_non_text_field(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text('{"text": 5}\n{"text": 6}\n')
    with pytest.raises(DataError, match="domain 'n': field 'text' holds int, expected text"):
        preprocess(config(tmp_path, [DomainSource(name="n", paths=[str(path)])]), progress=False)
    assert_nothing_written(tmp_path)


def test_vocabulary_that_does_not_fit_the_dtype(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["</s>"] = len(vocab)
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "big.json"))
    assert token_dtype(70_001) == "uint32" and token_dtype(65_536) == "uint16"
    cfg = config(
        tmp_path,
        jsonl_domains(tmp_path),
        token_dtype="uint16",
        tokenizer=TokenizerConfig(kind="file", path=str(tmp_path / "big.json")),
    )
    with pytest.raises(
        DataError, match="data.token_dtype: uint16 holds ids < 65536 but the tokenizer's vocabulary has 70001 ids"
    ):
        preprocess(cfg, progress=False)
    assert_nothing_written(tmp_path)


def test_synthetic_vocab_that_does_not_fit_the_tokenizer(tmp_path):
    cfg = config(tmp_path, [DomainSource(name="n", synthetic=SyntheticSpec(kind="noise", vocab=300, num_tokens=100))])
    with pytest.raises(DataError, match="domain 'n': synthetic vocab 300 needs token ids up to 300"):
        preprocess(cfg, progress=False)
    assert_nothing_written(tmp_path)


def test_stores_built_with_another_tokenizer(tmp_path):
    cfg = config(tmp_path, jsonl_domains(tmp_path), tokenizer=TokenizerConfig(kind="bpe", vocab_size=300))
    preprocess(cfg, progress=False)
    with pytest.raises(DataError, match="stores were built with tokenizer 'bpe-300' .* but the run asks for 'byte'"):
        open_stores(cfg.store_dir, expect_tokenizer=ByteTokenizer().identity)
    with pytest.raises(DataError, match="asks for 'bpe-512'"):
        open_stores(cfg.store_dir, expect_tokenizer={"name": "bpe-512"})
    assert open_stores(cfg.store_dir, expect_tokenizer={"name": "bpe-300"}).manifest.tokenizer["vocab_size"] == 300


def test_truncated_token_file_is_detected_and_rebuilt(tmp_path):
    cfg = config(tmp_path, jsonl_domains(tmp_path))
    preprocess(cfg, progress=False)
    good = file_bytes(tmp_path / "stores")
    path = tmp_path / "stores" / "alpha" / "train.bin"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(DataError, match=rf"alpha/train.bin: expected {size} bytes .* found {size - 2}: truncated"):
        open_stores(cfg.store_dir)
    preprocess(cfg, progress=False)
    assert file_bytes(tmp_path / "stores") == good


def test_missing_manifest_and_unknown_split(tmp_path):
    with pytest.raises(DataError, match="no manifest; build the stores with `doremi preprocess` first"):
        open_stores(tmp_path)
    cfg = config(tmp_path, jsonl_domains(tmp_path))
    preprocess(cfg, progress=False)
    with pytest.raises(DataError, match="unknown split 'val'"):
        open_stores(cfg.store_dir).tokens("alpha", "val")
    (tmp_path / "stores" / MANIFEST_FILE).write_text("{}")
    with pytest.raises(DataError, match="not a valid manifest"):
        open_stores(cfg.store_dir)


def test_unknown_file_type_and_mixed_sources(tmp_path):
    (tmp_path / "x.docx").write_text("x")
    with pytest.raises(DataError, match="unknown file type '.docx'"):
        preprocess(config(tmp_path, [DomainSource(name="x", paths=[str(tmp_path / "x.docx")])]), progress=False)
    with pytest.raises(DataError, match=r"expected one source, got paths and embedded"):
        preprocess(config(tmp_path, [DomainSource(name="x", paths=["a.jsonl"], embedded="code")]), progress=False)
    assert_nothing_written(tmp_path)


def test_jsonl_compressed_reads_without_datasets(tmp_path, monkeypatch):
    """JSON lines (plain, .gz, .xz, .bz2) are read natively: GPU machines may lack `datasets`."""
    import bz2
    import gzip
    import lzma
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # importing it now raises ImportError
    lines = "".join(json.dumps({"text": t}) + "\n" for t in DOCS["alpha"])
    paths = []
    for suffix, opener in (("jsonl", open), ("jsonl.gz", gzip.open), ("jsonl.xz", lzma.open), ("jsonl.bz2", bz2.open)):
        path = tmp_path / f"a.{suffix}"
        with opener(path, "wt", encoding="utf-8") as f:
            f.write(lines)
        paths.append(str(path))
    cfg = config(tmp_path, [DomainSource(name=f"d{i}", paths=[p]) for i, p in enumerate(paths)])
    manifest = preprocess(cfg, progress=False)
    totals = {
        (
            d.train.tokens + d.validation.tokens,
            d.train.documents + d.validation.documents,
            d.train.bytes + d.validation.bytes,
        )
        for d in manifest.domains
    }  # splits differ by domain name
    nbytes = sum(len(t.encode()) for t in DOCS["alpha"])
    assert totals == {(nbytes + len(DOCS["alpha"]), len(DOCS["alpha"]), nbytes)}  # byte tokens + one EOS each
    bad = tmp_path / "bad.jsonl.xz"
    with lzma.open(bad, "wt") as f:
        f.write('{"text": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"domain 'bad': could not read .*bad.jsonl.xz as JSON lines"):
        preprocess(config(tmp_path / "b", [DomainSource(name="bad", paths=[str(bad)])]), progress=False)
