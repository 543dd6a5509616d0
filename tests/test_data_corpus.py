import hashlib
import json

from data.config import DataConfig, DomainSource, SyntheticSpec, TokenizerConfig
from data.preprocess.preprocess import preprocess
from data.sources.sources import CORPUS_DIR, embedded_domains, read_embedded
from data.store.store import open_stores
from data.tokenizer.tokenizer import load_tokenizer


def test_embedded_corpus_files_match_their_record():
    meta = json.loads((CORPUS_DIR / "corpus.json").read_text())
    assert embedded_domains() == sorted(meta["domains"]) == ["code", "docs", "notes"]
    for name, rec in meta["domains"].items():
        path = CORPUS_DIR / rec["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["sha256"]
        docs = read_embedded(name)
        assert len(docs) == rec["documents"] and sum(map(len, docs)) == rec["characters"]
        assert len(docs) >= 100
    assert sum((CORPUS_DIR / r["file"]).stat().st_size for r in meta["domains"].values()) < 3_000_000
    assert (CORPUS_DIR / "README.md").is_file() and (CORPUS_DIR / "LICENSE.md").is_file()


def test_quickstart_like_build_round_trips_the_embedded_corpus(tmp_path):
    cfg = DataConfig(
        domains=[DomainSource(name=n, embedded=n) for n in ("code", "docs", "notes")]
        + [DomainSource(name="noise", synthetic=SyntheticSpec(kind="noise", num_tokens=20_000))],
        tokenizer=TokenizerConfig(kind="bpe", vocab_size=1024),
        store_dir=str(tmp_path / "stores"),
        num_proc=1,
    )
    manifest = preprocess(cfg, progress=False)
    stores = open_stores(cfg.store_dir, expect_tokenizer={"name": "bpe-1024", "vocab_size": 1024})
    tok = load_tokenizer(cfg.store_dir)
    for name in ("code", "docs", "notes"):
        got = []
        for split in ("train", "validation"):
            got += [
                tok.decode(stores.document(name, split, i).tolist())
                for i in range(manifest.domain(name).split(split).documents)
            ]
        assert sorted(got) == sorted(read_embedded(name))
        assert manifest.domain(name).validation.documents >= 5
    # BPE compresses real text well below one token per byte
    code_bytes = sum(len(t.encode()) for t in read_embedded("code"))
    assert manifest.domain("code").train.tokens + manifest.domain("code").validation.tokens < code_bytes / 2.5
